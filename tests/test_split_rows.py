"""The split-row fused kernel (kernels/split_rows.py) against fusedrl.reference, on CPU.

Under the interpreter programs run one after another, so the group barrier cannot run here:
rows of one slice take the one-launch kernel (no exchange), rows of 2-18 slices the two-launch
form (the partials through global memory between launches), which runs every line of the
one-launch kernel except the barrier itself (tests/test_gpu.py runs that on a GPU). The
exchange's arithmetic (`merge_partials`) is also tested on its own against float64.
"""

from __future__ import annotations

import math

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, reference

from .conftest import make_batch, needs_interpreter, run_loss
from .test_backends import OPTIONS, assert_matches_reference, assert_within_one_rounding

pytestmark = needs_interpreter

split_rows = pytest.importorskip("fusedrl.kernels.split_rows")
from fusedrl.kernels.token_args import LossVariant, TokenLossArgs  # noqa: E402

# The presets and options whose loss is the fused token-level kernel (the others take the
# two-pass path: `test_every_fused_case_runs_the_split_kernel` checks the list).
FUSED_PRESETS = ["ppo", "grpo", "dapo", "dr_grpo", "lite_ppo", "cispo", "sapo", "dcpo", "pg"]
FUSED_OPTIONS = [
    "dual_clip",
    "delta",
    "entropy_bonus_seq",
    "temperature",
    "sum_norm",
    "dcpo_kl",
    "sapo_is",
    "kl_k2",
    "kl_k1+",
    "is_low",
    "luspo_token_dual",
    "rejection_token_seq",
    "trust_region_max",
]


@pytest.fixture
def launches(monkeypatch):
    """Every fused loss call through the split-row kernel; the list of its calls' slice counts
    (a test asserts that the kernel it means to test ran, with the slices it means)."""
    monkeypatch.setattr(split_rows, "POLICY", "always")
    seen = []
    launch = split_rows.split_row_loss

    def spy(logits, *args, **kwargs):
        width = split_rows.block_size(logits.shape[-1], logits.device, logits.element_size())
        seen.append(-(-logits.shape[-1] // width))
        return launch(logits, *args, **kwargs)

    monkeypatch.setattr(split_rows, "split_row_loss", spy)
    return seen


def _matches(data, cfg, launches, slices, **kwargs):
    out = assert_matches_reference(data, cfg, "triton", **kwargs)
    assert launches and set(launches) == {slices}, launches
    return out


@pytest.mark.parametrize("name", FUSED_PRESETS)
def test_every_fused_preset(name, launches):
    data = make_batch(batch=4, time=9, vocab=1031, seed=3, per_token_adv=name == "dapo")
    _matches(data, LossConfig.preset(name), launches, slices=3)


@pytest.mark.parametrize("name", FUSED_OPTIONS)
def test_options(name, launches):
    data = make_batch(batch=4, time=9, vocab=523, seed=4, per_token_adv=True)
    _matches(data, OPTIONS[name], launches, slices=2)


def test_every_fused_case_runs_the_split_kernel(launches):
    """FUSED_PRESETS / FUSED_OPTIONS are exactly the cases that reach the fused kernel."""
    data = make_batch(batch=2, time=5, vocab=300, seed=1)
    fused = set()
    cases = {**{f"preset:{n}": LossConfig.preset(n) for n in LossConfig.presets()}}
    cases.update({f"option:{n}": c for n, c in OPTIONS.items()})
    for name, cfg in cases.items():
        launches.clear()
        run_loss(lambda *a, **k: fusedrl.policy_loss(*a, backend="triton", **k), data, cfg)
        if launches:
            fused.add(name)
    assert {f"preset:{n}" for n in FUSED_PRESETS} <= fused
    assert {f"option:{n}" for n in FUSED_OPTIONS} <= fused


@pytest.mark.parametrize("vocab, slices", [(65, 2), (200, 4), (1031, 17), (1100, 18)])
def test_slices_from_2_to_18_with_the_label_in_every_slice(vocab, slices, launches, monkeypatch):
    monkeypatch.setattr(split_rows, "INTERPRETED_SLICE", 64)
    data = make_batch(batch=3, time=12, vocab=vocab, seed=vocab, per_token_adv=True)
    rows = torch.arange(36).reshape(3, 12)
    # row r's label in slice r % slices, at an offset that moves through the slice
    data["labels"] = torch.clamp((rows % slices) * 64 + (rows * 11) % 64, max=vocab - 1)
    data["mask"][:] = True  # every row counted: the labels reach every slice
    _with_a_far_label(data)
    assert set(data["labels"].div(64, rounding_mode="floor").flatten().tolist()) == set(
        range(slices)
    )
    _matches(data, LossConfig.preset("dapo", entropy_coef=0.01), launches, slices=slices)


def test_ties_of_the_max_across_slices_and_banned_slices(launches, monkeypatch):
    monkeypatch.setattr(split_rows, "INTERPRETED_SLICE", 64)
    data = make_batch(batch=2, time=6, vocab=300, seed=7, empty_rows=())
    logits = data["logits"]
    logits[0, :, [10, 70, 250]] = 9.0  # the same max in three slices
    logits[1, :, :192] = -float("inf")  # slices 0-2 banned: their partials drop out
    data["labels"][1] = 200 + torch.arange(6)
    _matches(data, LossConfig.preset("grpo", entropy_coef=0.02), launches, slices=5)


def _with_a_far_label(data):
    """Row (0, 0)'s label ~170 nats below its row's max: the sums relative to it overflow, and
    the row takes the exact round."""
    label = int(data["labels"][0, 0])
    data["logits"][0, 0, label] = -120.0
    data["logits"][0, 0, (label + 1) % data["logits"].shape[-1]] = 50.0
    assert data["mask"][0, 0]
    return data


def test_one_launch_without_exchange(launches):
    """Rows of one slice: the kernel as a GPU runs it, without the barrier."""
    data = _with_a_far_label(make_batch(batch=3, time=7, vocab=300, seed=2))
    _matches(data, LossConfig.preset("dapo", kl="k3", beta=0.1), launches, slices=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_one_rounding(dtype, launches):
    data = make_batch(batch=3, time=8, vocab=1031, seed=5, dtype=dtype)
    cfg = LossConfig.preset("dapo", entropy_coef=0.01)
    ours, grad = run_loss(lambda *a, **k: fusedrl.policy_loss(*a, backend="triton", **k), data, cfg)
    exact = {k: (v.double() if v.is_floating_point() else v) for k, v in data.items()}
    want, want_grad = run_loss(reference.policy_loss, exact, cfg)
    torch.testing.assert_close(ours.loss.double(), want.loss, atol=1e-5, rtol=1e-5)
    assert grad.dtype == dtype
    assert_within_one_rounding(grad, want_grad)
    assert launches == [3]


def test_in_place(launches):
    data = make_batch(batch=3, time=7, vocab=1031, seed=6)
    cfg = LossConfig.preset("cispo", entropy_coef=0.01)
    want, want_grad = run_loss(reference.policy_loss, data, cfg)
    logits = data["logits"].clone().requires_grad_(True)
    args = {k: v for k, v in data.items() if k != "logits"}
    out = fusedrl.policy_loss(logits, config=cfg, inplace=True, backend="triton", **args)
    out.loss.backward()
    torch.testing.assert_close(out.loss, want.loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(logits.grad, want_grad, atol=1e-6, rtol=1e-5)
    assert launches == [3]


@pytest.mark.parametrize(
    "extra",
    [
        {"softcap": 30.0, "logit_scale": 0.5},
        {"temperature": "per_token"},
        {"entropy_coef": torch.tensor(0.02)},
    ],
    ids=["softcap", "row_temperature", "entropy_coef_tensor"],
)
def test_head_and_row_options(extra, launches):
    data = make_batch(batch=3, time=7, vocab=523, seed=8)
    if extra.get("temperature") == "per_token":
        extra = {"temperature": 0.5 + torch.rand(3, 7, generator=torch.Generator().manual_seed(0))}
    bonus = {} if "entropy_coef" in extra else {"entropy_coef": 0.01}
    cfg = LossConfig.preset("dapo", **bonus)
    _matches(data, cfg, launches, slices=2, **extra)


def test_sum_pi_squared_is_the_two_sweep_kernels(launches, monkeypatch):
    """The Optimal Token Baseline's sum of p^2 runs on the two-sweep kernel (the split one
    refuses the buffer: a fifth running sum spills registers in some of its variants)."""
    data = make_batch(batch=3, time=7, vocab=523, seed=8)
    run = lambda *a, **k: fusedrl.policy_loss(*a, backend="triton", **k)  # noqa: E731
    ours, _ = run_loss(run, data, LossConfig.preset("dapo"), return_sum_pi_squared=True)
    probs = torch.softmax(data["logits"].double(), -1)
    want = torch.where(data["mask"], (probs**2).sum(-1), 0.0)
    torch.testing.assert_close(ours.sum_pi_squared.double(), want, atol=1e-6, rtol=1e-5)
    assert launches == []
    rows = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="sum_sq"):
        args = TokenLossArgs(rows.long(), rows > -1, rows, LossVariant(), rows, sum_sq=rows)
        split_rows.split_row_loss(torch.zeros(1, 2, 9), torch.zeros(1, 2, 9), args)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_grad_scale_writes_the_scaled_gradient(as_tensor, launches):
    data = make_batch(batch=3, time=7, vocab=1031, seed=9)
    cfg = LossConfig.preset("dapo")
    scale = torch.tensor(0.25) if as_tensor else 0.25
    logits = data["logits"].clone().requires_grad_(True)
    args = {k: v for k, v in data.items() if k != "logits"}
    out = fusedrl.policy_loss(logits, config=cfg, backend="triton", grad_scale=scale, **args)
    (0.25 * out.loss).backward()
    _, want_grad = run_loss(reference.policy_loss, data, cfg)
    torch.testing.assert_close(logits.grad, 0.25 * want_grad, atol=1e-7, rtol=1e-5)
    assert launches == [3]


def test_nan_and_inf_rows_propagate_and_masked_rows_are_zero(launches):
    data = make_batch(batch=3, time=6, vocab=1031, seed=10, with_nan_padding=True)
    data["logits"][0, 0, 700] = float("nan")
    data["logits"][2, 0, 5] = float("inf")
    assert data["mask"][0, 0] and data["mask"][2, 0]
    ours, grad = run_loss(
        lambda *a, **k: fusedrl.policy_loss(*a, backend="triton", **k),
        data,
        LossConfig.preset("dapo"),
        return_entropy=True,
    )
    assert ours.logp[0, 0].isnan() and ours.logp[2, 0].isnan()
    assert grad[0, 0].isnan().any() and grad[2, 0].isnan().any()
    assert (grad[~data["mask"]] == 0).all()
    assert (ours.logp[~data["mask"]] == 0).all()


def test_all_masked_batch_gives_zero_loss_and_gradient(launches):
    data = make_batch(batch=2, time=5, vocab=1031, seed=11, with_nan_padding=True)
    data["mask"][:] = False
    data["logits"][:] = float("nan")
    ours, grad = run_loss(
        lambda *a, **k: fusedrl.policy_loss(*a, backend="triton", **k),
        data,
        LossConfig.preset("grpo"),
    )
    assert ours.loss.item() == 0.0 and (grad == 0).all()
    assert launches == [3]


def test_the_interpreter_refuses_a_barrier():
    logits = torch.zeros(1, 2, 1031)
    labels = torch.zeros(1, 2, dtype=torch.long)
    rows = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="barrier"):
        args = TokenLossArgs(labels, rows > -1, rows, LossVariant(), rows)
        split_rows.split_row_loss(logits, torch.empty_like(logits), args, two_launches=False)


# ------------------------------------------------------------------ the exchange's merge alone
def _partials_of(y: torch.Tensor, slices: int, width: int) -> torch.Tensor:
    """[rows, MAX_SLICES, 4] fp32 partials of base-2 rows y (as `_slice_partial` defines them:
    lanes past the row and y below FLOOR count at FLOOR) and the float64 truth."""
    rows = y.shape[0]
    floor = -1e20
    padded = torch.full((rows, slices * width), floor, dtype=torch.float64)
    padded[:, : y.shape[1]] = y.clamp(min=floor)
    parts = padded.reshape(rows, slices, width)
    local_max = parts.max(-1).values
    e = torch.exp2(parts - local_max[..., None])
    out = torch.zeros(rows, split_rows.MAX_SLICES.value, 4, dtype=torch.float64)
    out[:, :, 0] = -math.inf  # absent slices
    out[:, :slices] = torch.stack([local_max, e.sum(-1), (e * parts).sum(-1), (e * e).sum(-1)], -1)
    return out.float()


@pytest.mark.parametrize("slices", [2, 3, 5, 8, 13, 18])
def test_merge_of_partials_matches_float64(slices):
    width = 16
    gen = torch.Generator().manual_seed(slices)
    vocab = slices * width - 3
    y = 4.0 * torch.randn(6, vocab, generator=gen, dtype=torch.float64)
    y[1, : width * max(1, slices // 2)] = -math.inf  # leading slices with no mass
    y[2, :] = y[2, 0]  # one value everywhere: the max tied in every slice
    y[3, [0, width, vocab - 1]] = 20.0  # a tie of the max across three slices
    y[4, :] = -math.inf  # no mass at all: lse -inf, mean NaN
    got = split_rows.merge_partials_rows(_partials_of(y, slices, width), slices)
    finite = y[:4].clone()
    p = torch.softmax(finite * math.log(2), -1)
    lse2 = torch.logsumexp(finite * math.log(2), -1) / math.log(2)
    mean_y = (p * torch.where(p > 0, finite, 0.0)).sum(-1)
    sum_sq = (p * p).sum(-1)
    want = torch.stack([lse2, mean_y, sum_sq], -1).float()
    torch.testing.assert_close(got[:4], want, atol=2e-6, rtol=2e-6)
    assert got[4, 0] == -math.inf and got[4, 1].isnan() and got[4, 2].isnan()
    truth5 = torch.stack(
        [
            torch.logsumexp(y[5] * math.log(2), -1) / math.log(2),
            (torch.softmax(y[5] * math.log(2), -1) * y[5]).sum(),
            (torch.softmax(y[5] * math.log(2), -1) ** 2).sum(),
        ]
    ).float()
    torch.testing.assert_close(got[5], truth5, atol=2e-6, rtol=2e-6)


def test_merge_rejects_a_wrong_shape():
    with pytest.raises(ValueError, match="partials must be float32"):
        split_rows.merge_partials_rows(torch.zeros(2, 8, 4), 2)


# ------------------------------------------------------------------ the grid's arithmetic
def test_resident_programs_per_sm():
    # 80 registers x 256 threads: 25 warps' worth of the 64K registers -> 3 programs of 8 warps
    assert split_rows.resident_per_sm(80, 0, 8) == 3
    assert split_rows.resident_per_sm(64, 0, 8) == 4  # registers allow 4 (threads allow 8)
    assert split_rows.resident_per_sm(32, 0, 8) == 8  # the threads' limit (2048 / 256)
    assert split_rows.resident_per_sm(81, 0, 8) == 2  # 88 allocated: 23 warps -> 2 programs
    assert split_rows.resident_per_sm(40, 100 * 1024, 8) == 2  # shared memory (+1 KB each)
    assert split_rows.resident_per_sm(255, 0, 16) == 0
    assert split_rows.max_registers(8) == 128
    assert split_rows.resident_per_sm(128, 0, 8) == 2
    budget = split_rows.max_registers(split_rows.SPLIT_WARPS)
    assert split_rows.resident_per_sm(budget, 0, 8) >= split_rows.PROGRAMS_PER_SM


def test_groups_never_exceed_the_rows_or_the_partials():
    assert split_rows._groups(rows=16384, slices=10, partial_rows=132, per_sm=3, sms=132) == 39
    assert split_rows._groups(rows=5, slices=10, partial_rows=132, per_sm=3, sms=132) == 5
    assert split_rows._groups(rows=9999, slices=2, partial_rows=132, per_sm=3, sms=132) == 132
