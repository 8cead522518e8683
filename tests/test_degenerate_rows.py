"""A valid row whose logits are all -inf has no distribution: every backend says NaN.

The promise (kernels/rows.py `row_stats`, and fusedrl.reference, whose log_softmax of such a row
is NaN): logp and entropy are NaN for that row, the loss is NaN, and nothing else changes: the
other rows keep their values and gradients, and masked rows, whatever they hold, stay exact
zeros with a zero gradient. Checked on the torch backend and the Triton kernels (interpreted;
tests/test_gpu.py runs them compiled, and the CUDA backend) against the reference, in fp32 and
bf16, for a token-level loss with and without a KL term, a sequence-level one, token_logprobs,
with sampling-mask replay off and on, and the LM-head loss with an all -inf bias.
"""

from __future__ import annotations

import math

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, linear_triton, reference, row_blocks
from fusedrl.config import OPEN_LOWER_BOUND

from .conftest import LOGITS_BACKENDS, make_batch, needs_interpreter, run_loss

DEGENERATE = (0, 1)  # valid, all -inf
MASKED = (1, 2)  # masked (the whole of sequence 1 is), all -inf too
# vLLM's filters of the rollouts: the sampled set of an all -inf row is the row itself. (top_k
# and min_p: top_p's select takes 16 passes over an fp32 row, slow when interpreted.)
SAMPLING = {"off": {}, "on": dict(top_k=20, min_p=0.05)}


@pytest.fixture(params=LOGITS_BACKENDS)
def backend(request, monkeypatch):
    if request.param == "triton":
        launch = pytest.importorskip("fusedrl.kernels.launch")
        # 64-wide tiles: a row of 131 spans two whole tiles and a remainder, so the all -inf
        # row runs the unmasked loop, the masked remainder and the exact fallback.
        monkeypatch.setattr(launch, "MAX_BLOCK_V_INTERPRETED", 64)
    else:  # blocks of 4 rows: the degenerate row shares its block with finite ones
        monkeypatch.setattr(row_blocks, "BLOCK_ELEMENTS", 4 * 131)
    return request.param


def _batch(dtype):
    data = make_batch(batch=3, time=5, vocab=131, dtype=dtype, seed=29, per_token_adv=True)
    data["mask"][0, :3] = True  # the degenerate row and two finite ones are valid
    data["mask"][1] = False
    data["logits"][DEGENERATE] = -math.inf
    data["logits"][MASKED] = -math.inf
    assert data["mask"][DEGENERATE] and not data["mask"][MASKED]
    return data


def _call(backend):
    def call(*args, **kwargs):
        return fusedrl.policy_loss(*args, backend=backend, **kwargs)

    return call


def _assert_degenerate_row(logp, entropy):
    assert torch.isnan(logp[DEGENERATE]) and torch.isnan(entropy[DEGENERATE])
    assert logp[MASKED] == 0 and entropy[MASKED] == 0


@pytest.mark.filterwarnings("ignore:(invalid value|divide by zero) encountered")  # numpy (interp.)
@pytest.mark.parametrize("sampling", sorted(SAMPLING))
@pytest.mark.parametrize("preset", ["dapo", "grpo", "gspo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_policy_loss_says_nan_for_an_all_inf_row(dtype, preset, sampling, backend):
    """dapo: one fused kernel (Triton); grpo: the same with its k3 KL term and seq-mean
    aggregation; gspo: two passes and a sequence ratio. Replay writes the masked copy first."""
    data = _batch(dtype)
    cfg = LossConfig.preset(preset, temperature=0.9, **SAMPLING[sampling])
    ref, ref_grad = run_loss(reference.policy_loss, data, cfg, return_entropy=True)
    _assert_degenerate_row(ref.logp, ref.entropy)  # the oracle's own answer
    assert torch.isnan(ref.loss)
    for inplace in (False, True):
        given = dict(data, logits=data["logits"].clone())
        ours, grad = run_loss(_call(backend), given, cfg, return_entropy=True, inplace=inplace)
        _assert_degenerate_row(ours.logp, ours.entropy)
        assert torch.isnan(ours.loss)
        # Every other row: the reference's values (NaN only where it has NaN).
        tol = dict(atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.logp, ref.logp, equal_nan=True, **tol)
        torch.testing.assert_close(ours.entropy, ref.entropy, equal_nan=True, **tol)
        # The NaN row's gradient is NaN, never a quiet finite one. (The reference's is what
        # autograd makes of NaN: NaN, or 0 where replay's masked_fill cut the row, so it is
        # not compared there.)
        assert torch.isnan(grad[DEGENERATE]).all()
        assert (grad[MASKED] == 0).all() and (grad[1] == 0).all()
        compared = torch.ones(data["labels"].shape, dtype=torch.bool)
        compared[DEGENERATE] = False
        if preset == "gspo":  # a NaN sequence ratio: its other tokens' gradient is undefined too
            compared[DEGENERATE[0]] = False
        grad_tol = dict(atol=1e-6, rtol=2e-2) if dtype == torch.bfloat16 else tol
        torch.testing.assert_close(grad[compared].float(), ref_grad[compared].float(), **grad_tol)
        assert torch.isfinite(grad[2]).all() and (grad[2] != 0).any()  # a sequence that trains
    with torch.no_grad():  # two passes, the masked rows skipped by the kernels' `valid`
        args = {k: v for k, v in data.items() if k != "logits"}
        fast = fusedrl.policy_loss(
            data["logits"], **args, config=cfg, backend=backend, return_entropy=True
        )
    _assert_degenerate_row(fast.logp, fast.entropy)
    torch.testing.assert_close(fast.logp, ref.logp, equal_nan=True, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:(invalid value|divide by zero) encountered")
@pytest.mark.parametrize("sampling", sorted(SAMPLING))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_says_nan_for_an_all_inf_row(dtype, sampling, backend):
    data = _batch(dtype)
    logits, labels = data["logits"], data["labels"]
    kwargs = dict(temperature=0.9, return_entropy=True, **SAMPLING[sampling])
    ref_x = logits.detach().requires_grad_(True)
    ref_logp, ref_ent = reference.token_logprobs(ref_x, labels, **kwargs)
    x = logits.detach().requires_grad_(True)
    logp, ent = fusedrl.token_logprobs(x, labels, backend=backend, **kwargs)
    # token_logprobs has no mask: the all -inf row at MASKED is degenerate here as well.
    for values in (ref_logp, ref_ent, logp, ent):
        assert torch.isnan(values[DEGENERATE]) and torch.isnan(values[MASKED])
    torch.testing.assert_close(logp, ref_logp, equal_nan=True, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, equal_nan=True, atol=1e-5, rtol=1e-5)
    weights = torch.randn(2, *labels.shape, generator=torch.Generator().manual_seed(3))
    finite = ~torch.isnan(ref_logp)  # the degenerate rows' gradient is NaN, as their values
    (grad,) = torch.autograd.grad((logp * weights[0] + ent * weights[1])[finite].sum(), x)
    (ref_grad,) = torch.autograd.grad(
        (ref_logp * weights[0] + ref_ent * weights[1])[finite].sum(), ref_x
    )
    tol = dict(atol=1e-6, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad[finite].float(), ref_grad[finite].float(), **tol)
    with torch.no_grad():
        fast, fast_ent = fusedrl.token_logprobs(logits, labels, backend=backend, **kwargs)
    torch.testing.assert_close(fast, ref_logp, equal_nan=True, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast_ent, ref_ent, equal_nan=True, atol=1e-5, rtol=1e-5)


def test_a_nan_logit_makes_its_row_nan(backend):
    """One NaN logit, not the label's: the row's logp and entropy are NaN, as the reference says
    (the torch backend's entropy summed no term for it and said -0.0), the other rows unchanged."""
    data = make_batch(batch=2, time=4, vocab=131, seed=31)
    logits, labels = data["logits"].clone(), data["labels"]
    logits[0, 1, (labels[0, 1] + 1) % 131] = float("nan")
    want = reference.token_logprobs(logits, labels, temperature=0.9, return_entropy=True)
    with torch.no_grad():
        got = fusedrl.token_logprobs(logits, labels, 0.9, return_entropy=True, backend=backend)
    for values in (*want, *got):
        assert torch.isnan(values[0, 1]) and torch.isfinite(values[0, 0]), values
    for ours, truth in zip(got, want):
        torch.testing.assert_close(ours, truth, equal_nan=True, atol=1e-5, rtol=1e-5)


NAN_INPUT_CONFIGS = {
    "dapo": LossConfig.preset("dapo"),  # the fused kernel
    "grpo_k3": LossConfig.preset("grpo", beta=0.1),  # + a KL estimate reading ref_logp
    "ppo_dual_clip": LossConfig.preset("ppo", dual_clip_c=3.0),
    "cispo": LossConfig.preset("cispo"),
    # TRL's CISPO: no lower bound (1e-12), below the kernels' exp(-20) of a NaN log-ratio
    "cispo_open_low": LossConfig.preset("cispo", eps_low=OPEN_LOWER_BOUND),
    "sapo": LossConfig.preset("sapo"),
    "dapo_token_is": LossConfig.preset("dapo", is_correction="token_truncate", is_cap=2.0),
    "gspo": LossConfig.preset("gspo"),  # sequence-level ratio: the whole sequence
    "gmpo": LossConfig.preset("gmpo"),
    "vespo": LossConfig.preset("vespo"),
    "dapo_sequence_is": LossConfig.preset("dapo", is_correction="sequence_truncate", is_cap=2.0),
    "dapo_sequence_is_mask": LossConfig.preset("dapo", is_correction="sequence_mask", is_cap=2.0),
}


# Which gradient rows a NaN at token (0, 1) makes NaN: "token", "sequence" (sequence 0's four
# counted tokens), or None (the input is not read, or a mask / VESPO's phi drops it: the loss stays
# finite). Not listed: "token".
NAN_INPUT_ROWS = {
    ("old_logp", "gspo"): "sequence",
    ("old_logp", "gmpo"): "sequence",
    ("old_logp", "dapo_sequence_is"): "sequence",
    ("old_logp", "vespo"): None,
    ("advantages", "gmpo"): "sequence",
    ("logits", "gspo"): "sequence",  # its log-prob enters the sequence's ratio
    ("logits", "gmpo"): "sequence",
    ("rollout_logp", "dapo_sequence_is"): "sequence",
    ("rollout_logp", "dapo_sequence_is_mask"): None,
    **{
        ("rollout_logp", name): None
        for name in NAN_INPUT_CONFIGS
        if name not in ("dapo_token_is", "dapo_sequence_is", "dapo_sequence_is_mask")
    },
    **{("ref_logp", name): None for name in NAN_INPUT_CONFIGS if name != "grpo_k3"},
}


@pytest.mark.parametrize("name", sorted(NAN_INPUT_CONFIGS))
@pytest.mark.parametrize("field", ["old_logp", "advantages", "ref_logp", "rollout_logp", "logits"])
def test_a_nan_input_makes_the_rows_that_read_it_nan(name, field, backend):
    """A NaN in an input a counted token's loss computes with: the loss is NaN and so is the
    gradient row of every token whose loss term reads it (the token's; its sequence's where the
    input enters a shared sequence value), on every backend and the oracle alike (the fused
    kernels' clamps and selects dropped it: Triton and the oracle gave a finite row, torch a NaN
    one). An input the loss does not read (ref_logp with beta = 0, rollout_logp without IS
    correction), a mask decided on a NaN, or VESPO's phi (0 for a NaN ratio, as TRL) leave the
    loss finite. docs/losses.md, "NaN inputs"."""
    cfg = NAN_INPUT_CONFIGS[name]
    data = make_batch(batch=3, time=5, vocab=131, seed=41, per_token_adv=True)
    data["mask"][0, :4] = True  # sequence 0: four counted tokens, the NaN at the second
    if field == "logits":  # not the label's: the row's logp is NaN
        data["logits"][0, 1, (data["labels"][0, 1] + 1) % 131] = float("nan")
    else:
        data[field][0, 1] = float("nan")
    ours, grad = run_loss(fusedrl.policy_loss, data, cfg, backend=backend)
    want, want_grad = run_loss(reference.policy_loss, data, cfg)
    rows = NAN_INPUT_ROWS.get((field, name), "token")
    expected = torch.zeros(data["mask"].shape, dtype=torch.bool)
    if rows is not None:
        expected[0, 1] = True
        if rows == "sequence":
            expected[0, :4] = True
    assert torch.isnan(ours.loss) == torch.isnan(want.loss) == (rows is not None)
    assert torch.equal(grad.isnan().any(-1), expected), grad.isnan().any(-1)
    assert torch.equal(want_grad.isnan().any(-1), expected), want_grad.isnan().any(-1)
    assert grad[expected].isnan().all()  # every element of those rows
    torch.testing.assert_close(grad[~expected], want_grad[~expected], atol=1e-6, rtol=1e-5)
    # The clip fractions count a NaN ratio as torch's comparisons do (CISPO's
    # `ratio != clamp(ratio)`: NaN != NaN, clipped; the others' <, >: not)
    for key in ("clipfrac", "clip_low", "clip_high", "dual_clipfrac"):
        if key in want.metrics:
            torch.testing.assert_close(ours.metrics[key], want.metrics[key], msg=key)


LINEAR_BACKENDS = [
    "torch",
    pytest.param("triton:gemm", marks=needs_interpreter),
    pytest.param("triton:on-chip", marks=needs_interpreter),
]


@pytest.mark.filterwarnings("ignore:(invalid value|divide by zero) encountered")
@pytest.mark.parametrize("backend", LINEAR_BACKENDS)
@pytest.mark.parametrize("preset", ["dapo", "gspo", "token_logprobs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_with_an_all_inf_bias(dtype, preset, backend, monkeypatch):
    """hidden @ W.T + b is all -inf in every row only when b is: then every valid row is NaN
    (both Triton designs: the row kernels on cuBLAS chunks, and the on-chip tiles) and every
    masked row 0, with a zero gradient w.r.t. its hidden state."""
    name, _, design = backend.partition(":")
    if design:
        monkeypatch.setenv(linear_triton.DESIGN_ENV, design)
    gen = torch.Generator().manual_seed(31)
    hidden = torch.randn(2, 5, 24, generator=gen).to(dtype).requires_grad_(True)
    weight = (0.4 * torch.randn(131, 24, generator=gen)).to(dtype)
    bias = torch.full((131,), -math.inf, dtype=dtype)
    labels = torch.randint(0, 131, (2, 5), generator=gen)
    logits = torch.nn.functional.linear(hidden.detach(), weight, bias)
    if preset == "token_logprobs":
        logp, ent = fusedrl.linear_token_logprobs(
            hidden, weight, labels, 0.9, True, bias=bias, backend=name
        )
        ref_logp, ref_ent = reference.token_logprobs(logits, labels, 0.9, True)
        assert torch.isnan(ref_logp).all() and torch.isnan(ref_ent).all()
        assert torch.isnan(logp).all() and torch.isnan(ent).all()
        return
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    args = dict(
        advantages=torch.randn(2, generator=gen),
        mask=mask,
        old_logp=-2.0 - torch.rand(2, 5, generator=gen),
        config=LossConfig.preset(preset),
        return_entropy=True,
    )
    ref = reference.policy_loss(logits, labels, **args)
    out = fusedrl.linear_policy_loss(hidden, weight, labels, **args, bias=bias, backend=name)
    for result in (ref, out):
        assert torch.isnan(result.logp[mask]).all() and torch.isnan(result.entropy[mask]).all()
        assert (result.logp[~mask] == 0).all() and (result.entropy[~mask] == 0).all()
        assert torch.isnan(result.loss)
    (grad,) = torch.autograd.grad(out.loss, hidden)
    assert torch.isnan(grad[mask]).all() and (grad[~mask] == 0).all()


@needs_interpreter
@pytest.mark.filterwarnings("ignore:(invalid value|divide by zero|overflow) encountered")
def test_a_row_at_floor_reads_as_no_logit_above_it(monkeypatch):
    """The Triton sweeps count logits at or below FLOOR (kernels/rows.py) as p = 0, so a row of
    them has no logit above FLOOR: NaN, as an all -inf row. Logits that scale to FLOOR exactly
    (here -1e20 at T = log2(e): y = x exactly) are the case where sweep 1's offsets from the
    label, FLOOR - FLOOR, are 0 rather than clamped: without the label check its sums were V
    ones, a finite lse, a finite logp and an entropy of 0. An all -inf row clamps to 2^FLOOR = 0
    instead and reaches the fallback through 0 / 0; both now take the exact path on purpose."""
    from fusedrl.kernels import launch, rows

    monkeypatch.setattr(launch, "MAX_BLOCK_V_INTERPRETED", 64)
    temperature = math.log2(math.e)  # scale2 = LOG2E / T = 1: y = x, no rounding
    floor = torch.tensor(rows.FLOOR.value, dtype=torch.float32)
    logits = torch.randn(2, 3, 131, generator=torch.Generator().manual_seed(2))
    logits[0, 1] = floor  # fp32: bf16 has no value that lands on FLOOR exactly
    assert logits[0, 1, 0] * (rows.LOG2E.value / temperature) == floor
    labels = torch.randint(0, 131, (2, 3), generator=torch.Generator().manual_seed(3))
    logp, ent = fusedrl.token_logprobs(logits, labels, temperature, True, backend="triton")
    assert torch.isnan(logp[0, 1]) and torch.isnan(ent[0, 1])
    ref_logp, ref_ent = reference.token_logprobs(logits, labels, temperature, True)
    others = torch.ones(2, 3, dtype=torch.bool)
    others[0, 1] = False
    torch.testing.assert_close(logp[others], ref_logp[others], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent[others], ref_ent[others], atol=1e-5, rtol=1e-5)
