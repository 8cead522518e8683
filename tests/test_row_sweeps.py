"""The row sweeps at every alignment a row can have (Triton, interpreted).

The kernels split each row into a head (elements before the first 16-byte boundary), unmasked
aligned tiles, and one or two masked remainder tiles; the gradient is stored vectorised only when
it shares the logits' alignment. These cases make every one of those paths run: odd and even V,
rows starting at every element offset of a 16-byte vector, a tail one short of a whole tile
(two remainder tiles), V smaller than the head, in place and not, bf16 and fp32, against the
float64 reference.
"""

from __future__ import annotations

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, reference

from .conftest import needs_interpreter

pytestmark = needs_interpreter
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
rows = pytest.importorskip("fusedrl.kernels.rows")


@triton.jit
def _layout_kernel(x_ptr, out_ptr, vocab, BLOCK_V: tl.constexpr):
    head, full_tiles, body_ptr = rows.row_layout(x_ptr, vocab, BLOCK_V)
    tl.store(out_ptr, head)
    tl.store(out_ptr + 1, full_tiles)


BLOCK_CAP = 64  # many tiles per row at small V


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    from fusedrl.kernels import launch

    monkeypatch.setattr(launch, "MAX_BLOCK_V_INTERPRETED", BLOCK_CAP)


def _rows(vocab, offset, dtype, seed, rows=(2, 3)):
    """[B, T, V] logits whose first element sits `offset` elements past a 16-byte boundary
    (a [B, P+T, V]-style view into a larger buffer), with a banned (-inf) token per row."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(rows[0] * rows[1] * vocab + 64, generator=gen).to(dtype)
    assert base.data_ptr() % 16 == 0
    logits = base[offset : offset + rows[0] * rows[1] * vocab].view(*rows, vocab)
    labels = torch.randint(0, vocab, rows, generator=gen)
    if vocab > 2:
        banned = (labels + 1) % vocab
        logits.scatter_(-1, banned[..., None], float("-inf"))
    return logits, labels


# (vocab, why): the block is min(next_pow2(V), 64)
VOCABS = [
    (3, "V below the head of a misaligned row"),
    (37, "one partial tile"),
    (64, "exactly one tile"),
    (127, "tail one short of a tile: with a head, two remainder tiles"),
    (131, "two tiles and a short tail"),
    (200, "V multiple of 8: every row aligned when the base is"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0, 1, 3, 7])
@pytest.mark.parametrize("vocab", [v for v, _ in VOCABS])
def test_token_logprobs_and_grad_at_every_alignment(vocab, offset, dtype):
    logits, labels = _rows(vocab, offset, dtype, seed=vocab + offset)
    gen = torch.Generator().manual_seed(1)
    w_logp = torch.randn(labels.shape, generator=gen)
    w_ent = torch.randn(labels.shape, generator=gen)
    results = []
    for fn, x in (
        (fusedrl.token_logprobs, logits.detach().requires_grad_(True)),
        (reference.token_logprobs, logits.detach().double().requires_grad_(True)),
    ):
        kwargs = {"backend": "triton"} if fn is fusedrl.token_logprobs else {}
        logp, ent = fn(x, labels, temperature=0.8, return_entropy=True, **kwargs)
        (grad,) = torch.autograd.grad((logp * w_logp).sum() + (ent * w_ent).sum(), x)
        results.append((logp.double(), ent.double(), grad.double()))
    (logp, ent, grad), (ref_logp, ref_ent, ref_grad) = results
    torch.testing.assert_close(logp, ref_logp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=2e-5, rtol=1e-5)
    _assert_grad_close(grad, ref_grad, dtype)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0, 3])
@pytest.mark.parametrize("vocab", [37, 127, 131])
def test_fused_loss_at_every_alignment(vocab, offset, dtype, inplace):
    logits, labels = _rows(vocab, offset, dtype, seed=7 * vocab + offset)
    gen = torch.Generator().manual_seed(2)
    mask = torch.ones(labels.shape, dtype=torch.bool)
    mask[1, 2] = False
    adv = torch.randn(labels.shape[0], generator=gen)
    with torch.no_grad():
        old, _ = reference.token_logprobs(logits.float(), labels)
    old = old + 0.3 * torch.randn(old.shape, generator=gen)
    cfg = LossConfig.preset("dapo").replace(entropy_coef=0.05, temperature=0.9)
    args = dict(labels=labels, advantages=adv, mask=mask, old_logp=old, config=cfg)
    x = logits.detach().double().requires_grad_(True)
    ref = reference.policy_loss(x, **args)
    (ref_grad,) = torch.autograd.grad(ref.loss, x)
    leaf = logits.detach().clone() if inplace else logits.detach()
    leaf.requires_grad_(True)
    out = fusedrl.policy_loss(leaf, backend="triton", inplace=inplace, **args)
    (grad,) = torch.autograd.grad(out.loss, leaf)
    torch.testing.assert_close(out.loss.double(), ref.loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.logp.double(), ref.logp, atol=2e-5, rtol=1e-5)
    _assert_grad_close(grad.double(), ref_grad, dtype)
    assert torch.count_nonzero(grad[1, 2]) == 0


def _assert_grad_close(grad, ref_grad, dtype):
    """fp32: tight. bf16: within one rounding of the dtype per element (the interpreter truncates
    fp32 -> bf16, a GPU rounds to nearest: either is one ulp), plus fp32 noise near 0."""
    if dtype == torch.float32:
        torch.testing.assert_close(grad, ref_grad, atol=1e-7, rtol=1e-5)
    else:
        ulp = torch.finfo(torch.bfloat16).eps * ref_grad.abs()
        assert ((grad - ref_grad).abs() <= ulp + 1e-7).all(), (grad - ref_grad).abs().max()


def test_row_layout_puts_the_body_on_a_16_byte_boundary():
    """On a GPU the body's loads are 128-bit and a wrong head faults or reads the wrong bytes;
    the interpreter would not notice, so the head is checked against the address itself."""
    for dtype, elem in ((torch.bfloat16, 2), (torch.float32, 4)):
        base = torch.zeros(256, dtype=dtype)
        for offset in range(16 // elem):
            for vocab in (1, 5, 100):
                out = torch.zeros(2, dtype=torch.int32)
                _layout_kernel[(1,)](base[offset:], out, vocab, BLOCK_V=16)
                head, full_tiles = out.tolist()
                expected_head = min((-offset) % (16 // elem), vocab)
                assert head == expected_head, (dtype, offset, vocab)
                assert (base[offset:].data_ptr() + head * elem) % 16 == 0 or head == vocab
                assert full_tiles == (vocab - head) // 16


@pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered")  # interpreter's numpy
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["label_far_below_max", "label_banned", "nan_logit", "inf_logit"])
def test_rows_that_need_the_exact_online_sweep(case, dtype):
    """Sweep 1 sums 2^(y - y_label): rows where that overflows (the label's probability below
    ~1e-33, a banned label) or is undefined (NaN, +inf) take the exact online sweep instead. The
    first two must still give the reference's values; the last two NaN, never a finite lie."""
    logits, labels = _rows(131, 3, dtype, seed=11)
    logits = logits.clone()
    row = (0, 1)
    label = int(labels[row])
    if case == "label_far_below_max":
        logits[row][label] = -100.0  # others ~N(0, 1): y - y_label ~ 144 in base 2 at T = 1
    elif case == "label_banned":
        logits[row][label] = float("-inf")
    elif case == "nan_logit":
        logits[row][(label + 5) % 131] = float("nan")
    else:
        logits[row][(label + 5) % 131] = float("inf")
    x = logits.detach().requires_grad_(True)
    logp, ent = fusedrl.token_logprobs(x, labels, return_entropy=True, backend="triton")
    ref_logp, ref_ent = reference.token_logprobs(logits.double(), labels, return_entropy=True)
    if case.endswith("logit"):
        assert torch.isnan(logp[row]) and torch.isnan(ent[row])
    elif case == "label_banned":
        assert logp[row] == float("-inf")
        torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5, rtol=1e-5)
    else:
        assert logp[row] < -90
        torch.testing.assert_close(logp.double(), ref_logp, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5, rtol=1e-5)
    others = torch.ones_like(labels, dtype=torch.bool)
    others[row] = False
    torch.testing.assert_close(logp[others].double(), ref_logp[others], atol=2e-5, rtol=1e-5)


def test_persistent_grid_keeps_rows_in_flight_within_l2(monkeypatch):
    """The fused kernel's programs x row bytes fit an H100's L2 where one program per SM allows
    it (the sweep-2 re-read is then an L2 hit), never fewer programs than SMs, never more than
    rows; under the interpreter a few programs walk all rows (the row loop runs in tests)."""
    from fusedrl.kernels import launch

    sms, l2 = 132, 50 * 2**20
    monkeypatch.setattr(launch, "_sms_and_l2", lambda index: (sms, l2))
    cuda = torch.device("cuda", 0)
    for vocab, expected in ((32000, 2 * sms), (128256, sms), (151936, sms), (262144, sms)):
        programs = launch.persistent_programs(16384, vocab * 2, cuda)
        assert programs == expected, vocab
        assert programs * vocab * 2 <= l2 or programs == sms
    assert launch.persistent_programs(7, 151936 * 2, cuda) == 7
    assert launch.persistent_programs(100, 64, torch.device("cpu")) == 3


def test_fused_kernel_keeps_two_programs_per_sm_past_l2(monkeypatch):
    """The fused token-level kernel's grid is two programs per SM at every V (the measured
    sweeps: a second row in flight beats the L2 fit), never more programs than rows."""
    from types import SimpleNamespace

    from fusedrl.kernels import launch, token_loss

    sms, l2 = 132, 50 * 2**20
    monkeypatch.setattr(launch, "_sms_and_l2", lambda index: (sms, l2))
    cuda = torch.device("cuda", 0)
    for vocab in (32000, 151936, 262144):
        assert launch.persistent_programs(16384, vocab * 2, cuda, fit_l2=False) == 2 * sms
        logits = SimpleNamespace(shape=(4, 4096, vocab), element_size=lambda: 2, device=cuda)
        assert token_loss.sum_programs(logits) == 2 * sms, vocab
    assert launch.persistent_programs(7, 262144 * 2, cuda, fit_l2=False) == 7


@pytest.mark.parametrize("elem_bytes", [2, 4])
@pytest.mark.parametrize("vocab", [7, 131, 1031, 32003, 151936])
def test_gpu_launch_shape(vocab, elem_bytes):
    """The GPU launch the interpreter ignores: a tile is one 16-byte vector per thread (fewer
    warps for a small vocab, at least 4), and the register cap keeps two programs per SM."""
    from fusedrl.kernels import launch

    block = launch.block_size(vocab, torch.device("cuda"), elem_bytes)
    options = launch.launch_options(block, elem_bytes)
    warps, maxnreg = options["num_warps"], options["maxnreg"]
    threads_at_16_bytes = block * elem_bytes // launch.BYTES_PER_THREAD
    assert warps == max(4, threads_at_16_bytes // 32)
    assert warps <= launch.MAX_WARPS
    assert maxnreg * 32 * warps * launch.MIN_CTAS_PER_SM <= launch.REGISTERS_PER_SM
    assert maxnreg <= 255  # the hardware's limit per thread (sm_80, sm_90)
    # ... and is the largest that does (registers are allocated in steps of 8)
    assert maxnreg == 255 or (maxnreg + 8) * 32 * warps * launch.MIN_CTAS_PER_SM > (
        launch.REGISTERS_PER_SM
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_of_rows_whose_label_is_elsewhere(dtype):
    """A negative label (tensor parallelism: the label is in another rank's vocab slice) gets the
    softmax terms only; the rows with a label get the one-hot term too, at every alignment."""
    from fusedrl.kernels import logprobs

    logits, labels = _rows(131, 3, dtype, seed=5)
    labels[0, 1] = -1
    labels[1, 0] = -1
    gen = torch.Generator().manual_seed(6)
    dlogp = torch.randn(labels.shape, generator=gen)
    dentropy = torch.randn(labels.shape, generator=gen)
    temperature = 0.8
    z = logits.double() / temperature
    log_p = torch.log_softmax(z, -1)
    p = log_p.exp()
    entropy = -(p * torch.where(p > 0, log_p, 0.0)).sum(-1)
    lse = torch.logsumexp(z, -1)
    onehot = torch.zeros_like(z)
    owned = labels >= 0
    onehot[owned] = torch.nn.functional.one_hot(labels[owned], z.shape[-1]).double()
    entropy_term = p * torch.where(p > 0, log_p + entropy[..., None], 0.0)
    expected = (dlogp[..., None] * (onehot - p) - dentropy[..., None] * entropy_term) / temperature
    out = torch.empty_like(logits)
    logprobs.logits_backward(
        logits, labels, lse.float(), entropy.float(), dlogp, dentropy, temperature, out
    )
    # Rows (0, 0) and (0, 2) precede the label-less rows: a store at label -1 would land in them.
    _assert_grad_close(out.double(), expected, dtype)
