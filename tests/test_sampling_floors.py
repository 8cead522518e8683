"""Sampled sets read through each row's floor: no masked copy of the logits (Triton backend).

The select kernel stores one floor per row (`kernels.sampling.sampled_floors`) and the row kernels
read the logits through it: below the floor a logit reads as -inf, except the label, whose term
they add apart where the floor dropped it. Checked here, on the interpreter:
- the floors give the very set the masked write does (`write_sampled_set`), row by row;
- every row kernel reading the raw logits through the floors returns what it returns on the
  masked copy (to an ulp: the order of a sum), on rows that make each case act: the label in
  the set, below it (the sums' added term), below it with a probability under 1e-33 (the exact
  path, which needs no such term), an all -inf row but two tokens, a NaN row, per-token
  temperatures, the sum of p^2;
- `policy_loss` and `token_logprobs` on the Triton backend write no masked copy, with and without
  a gradient, in place or not. Their values against the reference: tests/test_sampling_replay.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusedrl
from fusedrl import LossConfig

from .conftest import make_batch, needs_interpreter

pytestmark = needs_interpreter

VOCAB = 1031  # 3 interpreted tiles of 512, the last partial
FILTERS = (0.8, 20, 0.9, 0.05)  # (temperature, top_k, top_p, min_p): every filter acts


def _rows(dtype, seed=0, batch=2, time=6):
    """Logits and labels whose rows make each case of the floors act (see the module doc)."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(batch, time, VOCAB, generator=gen)
    labels = torch.randint(0, VOCAB, (batch, time), generator=gen)
    labels[0, 0] = logits[0, 0].argmax()  # in the set
    labels[0, 1] = logits[0, 1].argmin()  # below the floor: its term added to the sums
    logits[0, 2, 5], labels[0, 2] = -200.0, 5  # p < 1e-33 and dropped: the exact path
    logits[0, 3] = -math.inf  # no mass but the label's and one other token's
    logits[0, 3, 9], logits[0, 3, 10], labels[0, 3] = 1.0, -2.0, 10
    logits[1, 0, 17] = math.nan  # a NaN row stays NaN
    logits = logits.to(dtype)
    return logits, labels


def _masked_and_floors(logits, labels, temperature, top_k, top_p, min_p, row_temps=None):
    from fusedrl.kernels import sampling

    masked = torch.empty_like(logits)
    sampling.write_sampled_set(
        logits, labels, masked, temperature, top_k, top_p, min_p, row_temps=row_temps
    )
    floors = sampling.sampled_floors(
        logits, labels, temperature, top_k, top_p, min_p, row_temps=row_temps
    )
    return masked, floors


def _equal(ours, theirs):
    """Equal but for the order of a sum: a dropped label's term is added after the row's, not
    at its place among them (an ulp of fp32)."""
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_floors_give_the_masked_write_set(dtype):
    logits, labels = _rows(dtype)
    masked, floors = _masked_and_floors(logits, labels, *FILTERS)
    columns = torch.arange(VOCAB)
    x = logits.float()
    kept = (x >= floors[..., None]) | (columns == labels[..., None]) | x.isnan()
    _equal(torch.where(kept, logits, -math.inf), masked)
    assert (floors > -math.inf).all() and (~kept).float().mean() > 0.9  # the filters acted
    # Off filters: -inf everywhere, no launch.
    none = fusedrl.kernels.sampling.sampled_floors(logits, labels, 1.0, None, 1.0, 0.0)
    assert (none == -math.inf).all()


@pytest.mark.parametrize("row_temperatures", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_kernels_through_floors_equal_them_on_the_masked_copy(dtype, row_temperatures):
    from fusedrl.kernels import logprobs

    logits, labels = _rows(dtype, seed=1)
    temperature, top_k, top_p, min_p = FILTERS
    row_temps = None
    if row_temperatures:
        row_temps = 0.5 + torch.rand(labels.shape, generator=torch.Generator().manual_seed(2))
    masked, floors = _masked_and_floors(logits, labels, *FILTERS, row_temps=row_temps)
    # the cases acted: the label below its floor, a p < 1e-33 label
    assert logits[0, 1, labels[0, 1]] < floors[0, 1] and masked[0, 2, 5] == -200.0
    sum_sq = {name: torch.empty(labels.shape) for name in ("copy", "floors")}
    on_copy = logprobs.logprobs_forward(
        masked, labels, None, temperature, row_temps, sum_sq=sum_sq["copy"]
    )
    through = logprobs.logprobs_forward(
        logits, labels, None, temperature, row_temps, sum_sq=sum_sq["floors"], floors=floors
    )
    for ours, theirs in zip((*through, sum_sq["floors"]), (*on_copy, sum_sq["copy"])):
        _equal(ours, theirs)
    assert through[0][0, 2] < -60 and through[0][1, 0].isnan()  # the exact path's row; NaN's
    _, lse, entropy = on_copy
    gen = torch.Generator().manual_seed(3)
    dlogp, dentropy = torch.randn(2, *labels.shape, generator=gen)
    grads = [torch.full_like(logits, 7.0) for _ in range(2)]
    args = (labels, lse, entropy, dlogp, dentropy, temperature)
    logprobs.logits_backward(masked, *args, grads[0], row_temps)
    logprobs.logits_backward(logits, *args, grads[1], row_temps, floors=floors)
    _equal(grads[1], grads[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_label_outside_the_row_is_not_in_its_set(dtype):
    """A vocab-parallel slice's rows whose label another rank holds (label < 0, or one past the
    row): the statistics and gradient over the set alone, as on the slice masked without a
    label. Column 0, which the forward reads as its reference, below the floor and above it;
    one row whose slice holds none of the set (no mass: lse -inf)."""
    from fusedrl.kernels import logprobs

    logits, labels = _rows(dtype, seed=8)
    temperature, top_k, top_p, min_p = FILTERS
    _, floors = _masked_and_floors(logits, labels, *FILTERS)
    floors[1, 2] = math.inf  # nothing of this row's set in the slice (its label outside)
    elsewhere = labels.clone()
    elsewhere[:, ::2] = -1
    elsewhere[1, 1] = VOCAB  # one past the row: not in it either
    logits[0, 4, 0] = logits[0, 4].max()  # the reference in the set
    for row in ((0, 0), (1, 4)):  # the largest logit outside the set: keeping it moves lse
        logits[row][0] = logits[row][logits[row].float() < floors[row]].max()
    logits[1, 1, 0] = floors[1, 1]  # exactly at the floor: in the set
    x = logits.float()
    in_set = (x >= floors[..., None]) | x.isnan()
    here = (elsewhere >= 0) & (elsewhere < VOCAB)
    in_set |= torch.arange(VOCAB) == torch.where(here, elsewhere, -1)[..., None]
    masked = torch.where(in_set, logits, -math.inf)
    outside = ~here
    # the cases acted: column 0 below the floor and in the set, in rows of an outside label
    assert (~in_set[..., 0] & outside).sum() >= 3 and (in_set[..., 0] & outside).any()
    on_copy = logprobs.logprobs_forward(masked, elsewhere, None, temperature)
    through = logprobs.logprobs_forward(logits, elsewhere, None, temperature, floors=floors)
    # lse, entropy (logp: only the owner's). Where column 0 is outside the set, the copy's row
    # takes the exact path (its reference reads -inf) and the floors' sums run relative to
    # column 0: two roundings of the same sums, entropy's difference of two large terms.
    for ours, theirs in zip(through[1:], on_copy[1:]):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5, equal_nan=True)
    _equal(through[0][here], on_copy[0][here])
    assert through[1][1, 2] == -math.inf
    _, lse, entropy = on_copy
    gen = torch.Generator().manual_seed(9)
    dlogp, dentropy = torch.randn(2, *labels.shape, generator=gen)
    grads = [torch.full_like(logits, 7.0) for _ in range(2)]
    grad_labels = torch.where(here, elsewhere, -1)  # the gradient's "elsewhere": < 0
    args = (grad_labels, lse, entropy, dlogp, dentropy, temperature)
    logprobs.logits_backward(masked, *args, grads[0])
    logprobs.logits_backward(logits, *args, grads[1], floors=floors)
    _equal(grads[1], grads[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_kernel_through_floors_equals_it_on_the_masked_copy(dtype):
    from fusedrl._inputs import prepare_loss_inputs
    from fusedrl.fused_backend import fused_token_args
    from fusedrl.kernels import token_loss

    data = make_batch(batch=2, time=6, vocab=VOCAB, seed=4, per_token_adv=True)
    logits, labels = _rows(dtype, seed=4)
    logits[1, 0, 17] = 0.0  # (a NaN row's loss is NaN either way; here the sums must agree)
    cfg = LossConfig.preset("grpo", temperature=FILTERS[0], entropy_coef=0.01)
    inp = prepare_loss_inputs(
        logits,
        labels,
        data["advantages"],
        data["mask"],
        data["old_logp"],
        data["ref_logp"],
        None,
        cfg,
        None,
        mask_rows=False,
    )
    args = fused_token_args(inp, cfg, sums=True)
    masked, floors = _masked_and_floors(logits, labels, *FILTERS)
    grads = [torch.full_like(logits, 7.0) for _ in range(2)]
    on_copy = token_loss.fused_token_loss(masked, grads[0], args)
    through = token_loss.fused_token_loss(logits, grads[1], args._replace(floors=floors))
    for ours, theirs in zip(through, on_copy):
        _equal(ours, theirs)
    _equal(grads[1], grads[0])
    assert (grads[1][inp.valid] == 0).float().mean() > 0.9  # the set acted


class _LogitsSizedAllocations(TorchDispatchMode):
    """Counts the tensors of at least `numel` elements that aten ops create."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.made = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        created = func._schema.name.startswith("aten::empty") or func in (
            torch.ops.aten.clone.default,
            torch.ops.aten.full.default,
            torch.ops.aten.where.self,
        )
        if created and isinstance(out, torch.Tensor) and out.numel() >= self.numel:
            self.made.append(str(func))
        return out


@pytest.fixture
def no_masked_write(monkeypatch):
    """Fails a test that writes a masked copy; counts the floors' selects."""
    from fusedrl.kernels import sampling

    selects = []
    real = sampling.sampled_floors

    def masked_write(*args, **kwargs):
        raise AssertionError("a masked copy of the logits was written")

    def floors(*args, **kwargs):
        selects.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(sampling, "write_sampled_set", masked_write)
    monkeypatch.setattr(sampling, "sampled_floors", floors)
    return selects


@pytest.mark.parametrize("grad", [False, True])
def test_token_logprobs_make_no_masked_copy(no_masked_write, grad):
    logits, labels = _rows(torch.bfloat16, seed=5)
    logits = logits.requires_grad_(grad)
    temperature, top_k, top_p, min_p = FILTERS
    count = _LogitsSizedAllocations(logits.numel())
    with count, torch.set_grad_enabled(grad):
        logp, _ = fusedrl.token_logprobs(
            logits, labels, temperature, False, "triton", top_k=top_k, top_p=top_p, min_p=min_p
        )
        if grad:
            logp.nan_to_num().sum().backward()
    assert no_masked_write == [logits.shape]
    # with a gradient, the gradient alone (before: a masked copy kept for backward as well)
    assert len(count.made) == int(grad), count.made


@pytest.mark.parametrize(
    "preset, grad, inplace",
    [("dapo", True, False), ("dapo", True, True), ("gspo", True, False), ("grpo", False, False)],
)
def test_policy_loss_makes_no_masked_copy(no_masked_write, preset, grad, inplace):
    data = make_batch(batch=3, time=5, vocab=VOCAB, seed=6, dtype=torch.bfloat16)
    logits = data.pop("logits").clone().requires_grad_(grad)
    temperature, top_k, top_p, min_p = FILTERS
    cfg = LossConfig.preset(preset, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    count = _LogitsSizedAllocations(logits.numel())
    with count, torch.set_grad_enabled(grad):
        out = fusedrl.policy_loss(logits, config=cfg, backend="triton", inplace=inplace, **data)
        if grad:
            out.loss.backward()
    assert len(no_masked_write) == 1
    # the gradient buffer alone (none in place, none without a gradient)
    assert len(count.made) == int(grad and not inplace), count.made


@pytest.mark.parametrize("preset", ["dapo", "gspo"])
def test_the_lm_head_loss_makes_no_masked_copy(no_masked_write, preset):
    """`linear_policy_loss` ("gemm" design): each cuBLAS chunk of logits is read through its
    floors by the fused kernel (dapo) or the two passes (gspo), never masked in place."""
    from fusedrl import linear_triton

    if linear_triton.design() != "gemm":
        pytest.skip("the on-chip design does not replay sampling masks (it raises)")
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(3, 5, 16, generator=gen).requires_grad_(True)
    weight = torch.randn(VOCAB, 16, generator=gen).requires_grad_(True)
    data = make_batch(batch=3, time=5, vocab=VOCAB, seed=7)
    data.pop("logits")
    temperature, top_k, top_p, min_p = FILTERS
    cfg = LossConfig.preset(preset, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    out = fusedrl.linear_policy_loss(hidden, weight, config=cfg, backend="triton", **data)
    torch.autograd.grad(out.loss, (hidden, weight))
    assert no_masked_write and all(shape[-1] == VOCAB for shape in no_masked_write)
    logp, _ = fusedrl.linear_token_logprobs(
        hidden, weight, data["labels"], temperature, backend="triton", top_k=top_k, top_p=top_p
    )
    torch.autograd.grad(logp.sum(), hidden)
