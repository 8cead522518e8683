"""Backward of the fused loss: the gradient written in the forward pass is handed on as it is.

When the loss is the terminal node the upstream gradient is 1, and backward must neither read nor
write the [B, T, V] gradient (a multiply by 1 would double the gradient's HBM traffic). Any other
upstream gradient scales it in one pass, on the device, without a host sync.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusedrl
from fusedrl import LossConfig, reference

from .conftest import BACKENDS, LOGITS_BACKENDS, make_batch, needs_interpreter, run_loss


class _OpsOnStorage(TorchDispatchMode):
    """Records every aten op that takes or returns a tensor on the watched storage."""

    def __init__(self, storage_ptr: int):
        super().__init__()
        self.storage_ptr, self.ops = storage_ptr, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = torch.utils._pytree.tree_leaves((args, kwargs, out))
        if any(
            isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == self.storage_ptr
            for t in flat
        ):
            self.ops.append(str(func))
        return out


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("preset", ["dapo", "gspo"])
@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_terminal_backward_touches_no_gradient(backend, preset, inplace):
    data = make_batch(batch=3, time=5, vocab=131, dtype=torch.bfloat16, seed=31)
    logits = data.pop("logits").clone().requires_grad_(True)
    out = fusedrl.policy_loss(
        logits, config=LossConfig.preset(preset), backend=backend, inplace=inplace, **data
    )
    (grad_buffer,) = out.loss.grad_fn.grads  # the gradient the forward pass wrote
    assert grad_buffer is not None and grad_buffer.shape == logits.shape
    if inplace:
        assert grad_buffer.data_ptr() == logits.data_ptr()
    watch = _OpsOnStorage(grad_buffer.untyped_storage().data_ptr())
    with watch:
        (grad,) = torch.autograd.grad(out.loss, logits)
    assert watch.ops == [], f"backward read or wrote the gradient: {watch.ops}"
    assert grad.data_ptr() == grad_buffer.data_ptr()  # handed on, not copied


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_upstream_gradient_scales_once(backend):
    data = make_batch(batch=3, time=5, vocab=131, seed=32)
    cfg = LossConfig.preset("dapo")
    ref, ref_grad = run_loss(reference.policy_loss, data, cfg)
    for scale in (2.5, 0.0, -1.0):
        logits = data["logits"].clone().requires_grad_(True)
        args = {k: v for k, v in data.items() if k != "logits"}
        out = fusedrl.policy_loss(logits, config=cfg, backend=backend, **args)
        (grad,) = torch.autograd.grad(scale * out.loss, logits)
        torch.testing.assert_close(grad, scale * ref_grad, atol=1e-6, rtol=1e-5)


def _linear_loss(backend, data, cfg, hidden, weight, **kw):
    args = {k: v for k, v in data.items() if k != "logits"}
    return fusedrl.linear_policy_loss(hidden, weight, config=cfg, backend=backend, **args, **kw)


def _distill_loss(backend, data, logits, **kw):
    teacher = data["logits"].flip(-1)
    return fusedrl.distill_loss(
        logits, teacher, data["labels"], data["mask"], backend=backend, **kw
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_place_ops_on_the_loss(backend):
    """`loss /= accumulation_steps`, as hand-written loops write it, then `loss *= -2`: every
    entry point's loss takes in-place ops (its autograd node's output was a view, which autograd
    refuses to modify in place) and the gradient is the plain one times -0.5."""
    data = make_batch(batch=3, time=5, vocab=131, seed=33)
    cfg = LossConfig.preset("dapo")
    hidden, weight = torch.randn(3, 5, 16), torch.randn(131, 16) / 4
    calls = {
        "policy_loss": (
            [data["logits"]],
            lambda x: fusedrl.policy_loss(
                x, config=cfg, backend=backend, **{k: v for k, v in data.items() if k != "logits"}
            ),
        ),
        "linear_policy_loss": (
            [hidden, weight],
            lambda h, w: _linear_loss(backend, data, cfg, h, w),
        ),
        "distill_loss": ([data["logits"]], lambda x: _distill_loss(backend, data, x)),
    }
    for name, (inputs, call) in calls.items():
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        plain = torch.autograd.grad(call(*leaves).loss, leaves)
        loss = call(*leaves).loss
        loss /= 4
        loss *= -2
        got = torch.autograd.grad(loss, leaves)
        for g, want in zip(got, plain):
            assert want.abs().sum() > 0, name
            torch.testing.assert_close(g, -0.5 * want, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_double_backward_raises_for_every_hand_written_gradient(backend):
    """create_graph=True through a gradient fusedrl computed by hand would make every
    second-order term silently 0 (token_logprobs returned a gradient without a graph)."""
    data = make_batch(batch=3, time=5, vocab=131, seed=34)
    hidden, weight = torch.randn(3, 5, 16), torch.randn(131, 16) / 4
    logits = data["logits"].detach().requires_grad_(True)
    h, w = hidden.requires_grad_(True), weight.requires_grad_(True)
    labels = data["labels"]
    outputs = {
        "token_logprobs": (fusedrl.token_logprobs(logits, labels, backend=backend)[0], logits),
        "token_logprobs, entropy": (
            fusedrl.token_logprobs(logits, labels, return_entropy=True, backend=backend)[1],
            logits,
        ),
        "linear_token_logprobs": (
            fusedrl.linear_token_logprobs(h, w, labels, backend=backend)[0],
            w,
        ),
        "policy_loss": (
            fusedrl.policy_loss(
                logits, backend=backend, **{k: v for k, v in data.items() if k != "logits"}
            ).loss,
            logits,
        ),
        "distill_loss": (_distill_loss(backend, data, logits).loss, logits),
    }
    for name, (value, leaf) in outputs.items():
        with pytest.raises(RuntimeError, match="does not support double backward"):
            torch.autograd.grad(value.sum(), leaf, create_graph=True)
        (grad,) = torch.autograd.grad(value.sum(), leaf)  # without it: the gradient, as before
        assert grad.abs().sum() > 0, name


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_an_upstream_factor_past_the_half_range_is_applied_in_fp32(backend):
    """An fp16 gradient times GradScaler's 2**16, or times 2**12 over a declared grad_scale of
    2**-5: the factor is past fp16's 65504, the product is not. Finite, and the float64 truth
    within fp16's rounding; a bf16 gradient times a factor bf16 cannot hold: its fp32 product
    rounded once."""
    data = make_batch(batch=3, time=5, vocab=131, seed=33)
    cfg = LossConfig.preset("dapo")
    _, truth = run_loss(reference.policy_loss, {**data, "logits": data["logits"].double()}, cfg)
    args = {k: v for k, v in data.items() if k != "logits"}
    for upstream, declared in ((2.0**16, None), (2.0**12, 2.0**-5)):
        logits = data["logits"].half().requires_grad_(True)
        out = fusedrl.policy_loss(logits, config=cfg, backend=backend, grad_scale=declared, **args)
        (grad,) = torch.autograd.grad(upstream * out.loss, logits)
        assert grad.dtype == torch.float16 and bool(grad.isfinite().all()), (upstream, declared)
        want = (upstream * truth).half().double()
        torch.testing.assert_close(grad.double(), want, atol=1e-3 * upstream, rtol=2e-3)
    factor = 1 + 2**-8 + 2**-10  # bf16 rounds it to 1 + 2**-7
    logits = data["logits"].bfloat16().requires_grad_(True)
    out = fusedrl.policy_loss(logits, config=cfg, backend=backend, **args)
    written = out.loss.grad_fn.grads[0].clone()
    (grad,) = torch.autograd.grad(factor * out.loss, logits)
    assert torch.equal(grad, (written.float() * factor).bfloat16())


def test_the_factor_is_fp32_on_every_route(monkeypatch):
    """The torch.compile route (traced: one fused multiply) and the chunked fallback of a device
    without the Triton kernel, contiguous (several chunks) or not: fp32 products rounded once."""
    from fusedrl import _autograd

    gen = torch.Generator().manual_seed(3)
    base = torch.randn(7, 33, generator=gen)
    for dtype, factor in ((torch.float16, 2.0**17), (torch.bfloat16, 1 + 2**-8 + 2**-10)):
        want = (base.to(dtype).float() * factor).to(dtype)
        traced = torch.compile(_autograd.scale_unless_one, backend="eager", fullgraph=True)
        assert torch.equal(traced(base.to(dtype), torch.tensor(factor)), want)
        monkeypatch.setattr(_autograd, "_FP32_CHUNK", 40)
        grad = base.to(dtype)
        _autograd._mul_in_fp32(grad, torch.tensor(factor))
        assert torch.equal(grad, want)
        strided = base.to(dtype).T  # not contiguous: one fp32 copy
        _autograd._mul_in_fp32(strided, torch.tensor(factor))
        assert torch.equal(strided, want.T)
    # fp64 stays fp64 (not through fp32) on the traced route
    factor = torch.tensor(1 / 3, dtype=torch.float64)
    traced = torch.compile(_autograd.scale_unless_one, backend="eager", fullgraph=True)
    assert torch.equal(traced(base.double(), factor), base.double() * factor)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_kernel_on_a_strided_view(dtype):
    """The device-side scaling kernel (CUDA tensors use it) on a [B, P+T, V] slice: only the
    slice's rows change, by exactly the fp32 product rounded once; a factor of 1 changes nothing."""
    from fusedrl.kernels import launch, scale

    full = torch.randn(2, 9, 1031, generator=torch.Generator().manual_seed(0)).to(dtype)
    for factor in (1.0, 0.37, -3.0):
        for block_cap in (2048, 256):  # one tile per row, and several with a partial last one
            buffer = full.clone()
            view = buffer[:, 3:8]
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(launch, "MAX_BLOCK_V_INTERPRETED", block_cap)
                scale.scale_rows_unless_one(view, torch.tensor(factor))
            product = full[:, 3:8].float() * factor
            expected = full.clone()
            expected[:, 3:8] = product.to(dtype)
            if dtype == torch.bfloat16:  # the interpreter rounds fp32 -> bf16 toward zero
                truncated = full.clone()
                truncated[:, 3:8] = _truncate_to_bf16(product)
                assert torch.equal(buffer, expected) or torch.equal(buffer, truncated)
            else:
                assert torch.equal(buffer, expected), (factor, block_cap)
    flat = full[0].clone()  # [N, V] input; x2 is exact in any dtype
    scale.scale_rows_unless_one(flat, torch.tensor([2.0]))
    assert torch.equal(flat, (full[0].float() * 2).to(dtype))


def _truncate_to_bf16(x: torch.Tensor) -> torch.Tensor:
    return (x.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
