"""The Triton backend at real sizes on a GPU (skipped without CUDA).

Run on a GPU machine with `python -m pytest tests/test_gpu.py -q` (bench/run_gpu.sh does it).
Oracle: fusedrl.reference in fp32 on the same device; at V = 152k the fp32 reference needs several
GB per 1k rows, so the large-N cases compare against the torch backend (itself tested against the
reference) or check invariants instead.
"""

from __future__ import annotations

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, reference

from .conftest import make_batch, run_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_kernels_are_compiled_not_interpreted():
    """With TRITON_INTERPRET=1 every "GPU" test would copy to the host and interpret."""
    from triton.runtime.jit import JITFunction

    from fusedrl.kernels import aot

    kernels = aot.launch_kernels()  # raises if any of them is an InterpretedFunction
    assert kernels and all(isinstance(k, JITFunction) for k in kernels.values())


def _on_gpu(data):
    return {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in data.items()}


# Both fused backends run the same suite; the CUDA one JIT-builds csrc/ on first use.
FUSED = pytest.mark.parametrize("backend", ["triton", "cuda"])


def _impl(backend):
    def call(*args, **kwargs):
        return fusedrl.policy_loss(*args, backend=backend, **kwargs)

    return call


@pytest.mark.parametrize("vocab", [128256, 151936, 262144])
@pytest.mark.parametrize("preset", list(LossConfig.presets()))
@FUSED
def test_presets_at_real_vocab(vocab, preset, backend):
    data = _on_gpu(
        make_batch(
            batch=4,
            time=33,
            vocab=vocab,
            dtype=torch.bfloat16,
            seed=1,
            per_token_adv=preset == "gspo_token",
        )
    )
    cfg = LossConfig.preset(preset).replace(entropy_coef=0.01)
    ours, grad = run_loss(_impl(backend), data, cfg, return_entropy=True)
    ref, ref_grad = run_loss(reference.policy_loss, data, cfg, return_entropy=True)
    torch.testing.assert_close(ours.loss, ref.loss, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ours.logp, ref.logp, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ours.entropy, ref.entropy, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=1e-6, rtol=1e-2)
    for key, value in ref.metrics.items():
        torch.testing.assert_close(ours.metrics[key], value, atol=1e-5, rtol=1e-4, msg=key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inplace", [False, True])
@FUSED
def test_dtypes_and_inplace(dtype, inplace, backend):
    data = _on_gpu(make_batch(batch=8, time=65, vocab=32003, dtype=dtype, seed=2))
    cfg = LossConfig.preset("grpo").replace(entropy_coef=0.01, temperature=0.7)
    _, expected = run_loss(reference.policy_loss, data, cfg)
    logits = data["logits"].clone().requires_grad_(True)
    args = {k: v for k, v in data.items() if k != "logits"}
    out = fusedrl.policy_loss(logits, config=cfg, inplace=inplace, backend=backend, **args)
    (grad,) = torch.autograd.grad(out.loss, logits)
    torch.testing.assert_close(grad.float(), expected.float(), atol=1e-6, rtol=2e-2)
    if inplace:
        assert grad.data_ptr() == logits.data_ptr()


@pytest.mark.parametrize("rows", [65536, 131072])
@FUSED
def test_many_rows(rows, backend):
    """N beyond any grid-dimension limit of a 2-D launch; compared with the torch backend."""
    vocab = 4099
    gen = torch.Generator(device="cuda").manual_seed(3)
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16, generator=gen)
    labels = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    adv = torch.randn(rows, device="cuda", generator=gen)
    mask = torch.rand(rows, device="cuda", generator=gen) > 0.2
    cfg = LossConfig.preset("dapo")
    results = []
    for impl in (backend, "torch"):
        leaf = logits.clone().requires_grad_(True)
        out = fusedrl.policy_loss(leaf, labels, adv, mask, config=cfg, backend=impl)
        results.append((out.loss, torch.autograd.grad(out.loss, leaf)[0], out.logp))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(results[0][2], results[1][2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[0][1].float(), results[1][1].float(), atol=1e-7, rtol=1e-2)


@FUSED
def test_strided_view_is_not_copied(backend):
    full = torch.randn(4, 50, 151936, device="cuda", dtype=torch.bfloat16)
    view = full[:, 17:49]
    data = _on_gpu(make_batch(batch=4, time=32, vocab=151936, seed=4))
    data["logits"] = view
    cfg = LossConfig.preset("dapo")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ours, _ = run_loss(_impl(backend), data, cfg)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < 1.1 * view.numel() * view.element_size()  # the gradient, no copy of the input
    ref, _ = run_loss(reference.policy_loss, data, cfg)
    torch.testing.assert_close(ours.loss, ref.loss, atol=1e-5, rtol=1e-4)


@FUSED
def test_inplace_extra_memory_is_tiny(backend):
    data = _on_gpu(make_batch(batch=16, time=1024, vocab=151936, dtype=torch.bfloat16, seed=5))
    logits = data.pop("logits").requires_grad_(True)
    cfg = LossConfig.preset("dapo")
    fusedrl.policy_loss(
        logits.detach().clone().requires_grad_(True),
        config=cfg,
        inplace=True,
        backend=backend,
        **data,
    )  # compile outside the measurement
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fusedrl.policy_loss(logits, config=cfg, inplace=True, backend=backend, **data)
    torch.autograd.grad(out.loss, logits)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra <= 0.01 * logits.numel() * logits.element_size(), extra


@FUSED
def test_no_host_sync_on_the_hot_path(backend):
    data = _on_gpu(make_batch(batch=4, time=32, vocab=32003, dtype=torch.bfloat16, seed=6))
    cfg = LossConfig.preset("grpo").replace(is_correction="token_truncate")
    run_loss(_impl(backend), data, cfg)  # compile and warm up first
    torch.cuda.set_sync_debug_mode("error")
    try:
        for preset in ("dapo", "grpo", "gspo", "gmpo"):
            run_loss(_impl(backend), data, LossConfig.preset(preset))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@FUSED
def test_batch_invariance_on_gpu(backend):
    data = _on_gpu(
        make_batch(batch=8, time=64, vocab=151936, dtype=torch.bfloat16, seed=7, empty_rows=())
    )
    full, _ = fusedrl.token_logprobs(data["logits"], data["labels"], backend=backend)
    alone, _ = fusedrl.token_logprobs(data["logits"][3:4], data["labels"][3:4], backend=backend)
    assert torch.equal(full[3:4], alone)


@pytest.mark.parametrize("preset", ["dapo", "grpo", "gspo", "cispo"])
@FUSED
def test_policy_loss_rows_are_batch_invariant_on_gpu(preset, backend):
    """The contract of tests/test_batch_invariance.py, compiled: with a normalizer, a sequence's
    logp, entropy and gradient rows are bitwise the same alone, moved or among others."""
    data = _on_gpu(
        make_batch(batch=6, time=40, vocab=151936, dtype=torch.bfloat16, seed=12, empty_rows=())
    )
    cfg = LossConfig.preset(preset).replace(entropy_coef=0.01)
    rows = {}
    for name, index in {"all": [0, 1, 2, 3, 4, 5], "moved": [5, 3], "alone": [3]}.items():
        part = {k: v[torch.tensor(index, device="cuda")] for k, v in data.items()}
        out, grad = run_loss(_impl(backend), part, cfg, normalizer=100.0, return_entropy=True)
        at = index.index(3)
        rows[name] = (out.logp[at], out.entropy[at], grad[at])
    for name in ("moved", "alone"):
        for what, a, b in zip(("logp", "entropy", "grad"), rows["all"], rows[name]):
            assert torch.equal(a, b), f"{what} differs ({name})"


@pytest.mark.parametrize("preset", ["dapo", "grpo", "gspo"])
@FUSED
def test_torch_compile_inductor_fullgraph(preset, backend):
    data = _on_gpu(make_batch(batch=4, time=64, vocab=32003, dtype=torch.bfloat16, seed=8))
    cfg = LossConfig.preset(preset)

    def step(logits, labels, advantages, mask, old_logp, ref_logp):
        out = fusedrl.policy_loss(
            logits,
            labels,
            advantages,
            mask,
            old_logp=old_logp,
            ref_logp=ref_logp,
            config=cfg,
            backend=backend,
        )
        return out.loss

    run_loss(_impl(backend), data, cfg)  # eager first: builds / loads the kernels
    compiled = torch.compile(step, fullgraph=True)
    logits = data["logits"].clone().requires_grad_(True)
    loss = compiled(
        logits, data["labels"], data["advantages"], data["mask"], data["old_logp"], data["ref_logp"]
    )
    loss.backward()
    ref, ref_grad = run_loss(reference.policy_loss, data, cfg)
    torch.testing.assert_close(loss, ref.loss, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(logits.grad.float(), ref_grad.float(), atol=1e-6, rtol=2e-2)


@pytest.mark.parametrize("one_read", ["1", "0"])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("vocab", [151936, 32003, 7])
def test_cuda_one_read_and_two_sweep_kernels(vocab, inplace, one_read, monkeypatch):
    """backend='cuda' on sm_90 runs the thread-block-cluster kernel (one read of each row, from
    shared memory); FUSEDRL_CUDA_ONE_READ=0 forces the two-sweep kernel. Both against the
    reference: odd V, a [B, P+T, V] slice, masked rows, a label far below the row's max (the exact
    online fallback), the entropy bonus."""
    monkeypatch.setenv("FUSEDRL_CUDA_ONE_READ", one_read)
    data = _on_gpu(make_batch(batch=4, time=9, vocab=vocab, dtype=torch.bfloat16, seed=9))
    full = torch.randn(4, 12, vocab, device="cuda", dtype=torch.bfloat16)
    full[:, 3:] = data["logits"]
    data["logits"] = full[:, 3:]
    data["logits"][0, 0, data["labels"][0, 0]] = -120.0  # sums relative to the label overflow
    cfg = LossConfig.preset("dapo").replace(entropy_coef=0.01)
    ref, ref_grad = run_loss(reference.policy_loss, data, cfg, return_entropy=True)
    logits = data["logits"].clone() if inplace else data["logits"]
    logits = logits.detach().requires_grad_(True)
    args = {k: v for k, v in data.items() if k != "logits"}
    out = fusedrl.policy_loss(
        logits, config=cfg, inplace=inplace, backend="cuda", return_entropy=True, **args
    )
    (grad,) = torch.autograd.grad(out.loss, logits)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.logp, ref.logp, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out.entropy, ref.entropy, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=1e-6, rtol=2e-2)


@pytest.mark.parametrize("design", ["gemm", "on-chip"])
@pytest.mark.parametrize("preset", ["dapo", "grpo", "gspo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_policy_loss_designs(dtype, preset, design, monkeypatch):
    """linear_policy_loss on the GPU in both Triton designs (fusedrl.linear_triton) against the
    torch backend in fp32 (itself tested against the reference): a real vocab, odd H and N, a
    strided [B, P+T, H] view, masked rows holding NaN, chunks of a few rows."""
    from fusedrl import linear_triton

    monkeypatch.setenv(linear_triton.DESIGN_ENV, design)
    monkeypatch.setattr(linear_triton, "GRAD_CHUNK_BYTES", 7 * 151936 * 4)
    gen = torch.Generator(device="cuda").manual_seed(11)
    batch, prompt, time, size, vocab = 3, 5, 37, 200, 151936
    full = torch.randn(batch, prompt + time, size, device="cuda", generator=gen)
    weight = torch.randn(vocab, size, device="cuda", generator=gen) * (2.0 / size**0.5)
    labels = torch.randint(0, vocab, (batch, time), device="cuda", generator=gen)
    mask = torch.ones(batch, time, dtype=torch.bool, device="cuda")
    mask[1] = False
    mask[2, 30:] = False
    full[:, prompt:][~mask] = float("nan")
    adv = torch.randn(batch, device="cuda", generator=gen)
    with torch.no_grad():
        logp, _ = fusedrl.linear_token_logprobs(full[:, prompt:], weight, labels, backend="torch")
    old = torch.where(mask, logp, 0) + 0.3 * torch.randn(batch, time, device="cuda", generator=gen)
    cfg = LossConfig.preset(preset).replace(entropy_coef=0.01)

    def run(backend, dt):
        h = full.to(dt).requires_grad_(True)
        w = weight.to(dt).requires_grad_(True)
        out = fusedrl.linear_policy_loss(
            h[:, prompt:], w, labels, adv, mask, old_logp=old, config=cfg, backend=backend,
            return_entropy=True,
        )  # fmt: skip
        return out, torch.autograd.grad(out.loss, (h, w))

    ref, ref_grads = run("torch", torch.float32)
    out, grads = run("triton", dtype)
    exact = dtype == torch.float32
    tol = dict(atol=1e-4, rtol=1e-4) if exact else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.loss.float(), ref.loss, **tol)
    torch.testing.assert_close(out.logp, ref.logp, **tol)
    for g, rg in zip(grads, ref_grads):
        assert g.dtype == dtype and torch.isfinite(g).all()
        rel = (g.float() - rg).norm() / rg.norm()
        assert rel < (1e-4 if exact else 2e-2), float(rel)


@pytest.mark.parametrize("preset", ["dapo", "gspo"])
def test_linear_policy_loss_replays_sampling_masks(preset):
    """The gemm design masks each cuBLAS logits chunk with the select kernel: against the torch
    backend (topk per block) in fp32 at a real vocab. top_k and min_p select by value, exactly
    (top_p's sums are compared in test_sampled_set_kernel_against_the_torch_select)."""
    gen = torch.Generator(device="cuda").manual_seed(12)
    batch, time, size, vocab = 3, 29, 128, 151936
    hidden = torch.randn(batch, time, size, device="cuda", generator=gen)
    weight = torch.randn(vocab, size, device="cuda", generator=gen) * (4.0 / size**0.5)
    labels = torch.randint(0, vocab, (batch, time), device="cuda", generator=gen)
    with torch.no_grad():
        labels[:, ::2] = (hidden @ weight.T).argmax(-1)[:, ::2]
    mask = torch.ones(batch, time, dtype=torch.bool, device="cuda")
    adv = torch.randn(batch, device="cuda", generator=gen)
    cfg = LossConfig.preset(preset).replace(temperature=0.8, top_k=50, min_p=0.02)

    def run(backend):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = fusedrl.linear_policy_loss(h, w, labels, adv, mask, config=cfg, backend=backend)
        return out, torch.autograd.grad(out.loss, (h, w))

    (ref, ref_grads), (out, grads) = run("torch"), run("triton")
    torch.testing.assert_close(out.logp, ref.logp, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-4, rtol=1e-4)
    for g, rg in zip(grads, ref_grads):
        assert (g - rg).norm() / rg.norm() < 1e-4
    plain = fusedrl.linear_policy_loss(
        hidden, weight, labels, adv, mask, config=cfg.replace(top_k=None, min_p=None)
    )
    assert (out.logp > plain.logp).all()  # the mask acted on every row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "filters", [(50, None, None), (None, 0.9, None), (None, None, 0.05), (50, 0.9, 0.05)]
)
def test_sampled_set_kernel_against_the_torch_select(filters, dtype):
    """The compiled radix select (kernels/sampling.py) writes what fusedrl.sampling's torch.topk /
    sort route writes, at a real vocab. top_k and min_p compare values only: bit for bit. top_p
    sums probabilities in another order: in a few rows the boundary value (with its ties, many
    in bf16) may be in one set and not the other, and nothing else may differ."""
    from fusedrl.kernels.sampling import write_sampled_set
    from fusedrl.sampling import SamplingMask, mask_to_sampled_set

    top_k, top_p, min_p = filters
    gen = torch.Generator().manual_seed(17)
    logits = (2.0 * torch.randn(3, 97, 151936, generator=gen)).to("cuda", dtype)
    labels = torch.randint(0, 151936, (3, 97), generator=gen).cuda()
    out = torch.empty_like(logits)
    write_sampled_set(logits, labels, out, 0.7, top_k, top_p, min_p)
    expected = mask_to_sampled_set(
        logits.view(-1, 151936), labels.view(-1), 0.7, SamplingMask(top_k, top_p, min_p)
    ).view_as(logits)
    kept, expected_kept = out != -float("inf"), expected != -float("inf")
    assert (kept.sum(-1) < 151936).all()  # every row masked something
    assert torch.equal(out[kept], logits[kept])
    if top_p is None:
        assert torch.equal(kept, expected_kept)
    else:
        flipped = kept != expected_kept
        assert flipped.any(-1).float().mean() <= 0.1, flipped.sum(-1)
        union = (kept | expected_kept).scatter(-1, labels[..., None], False)
        boundary = torch.where(union, logits.float(), float("inf")).amin(-1, keepdim=True)
        assert (logits.float() == boundary)[flipped].all(), "a flip away from the boundary"


@pytest.mark.parametrize("grad", [False, True])
@FUSED
def test_sampling_mask_replay_at_real_vocab(backend, grad):
    """top_k / top_p / min_p replayed by the fused backends (logits masked to the sampled set)
    against the torch backend on the same GPU: a real vocab, bf16, temperature 0.7."""
    data = _on_gpu(make_batch(batch=4, time=33, vocab=151936, dtype=torch.bfloat16, seed=13))
    kwargs = dict(temperature=0.7, return_entropy=True, top_k=50, top_p=0.9, min_p=0.01)
    results = {}
    for name in (backend, "torch"):
        logits = data["logits"].clone().requires_grad_(grad)
        logp, ent = fusedrl.token_logprobs(logits, data["labels"], backend=name, **kwargs)
        dlogits = None
        if grad:
            (dlogits,) = torch.autograd.grad((logp + 0.1 * ent).sum(), logits)
        results[name] = (logp, ent, dlogits)
    for ours, ref in zip(results[backend], results["torch"]):
        if ours is not None:
            torch.testing.assert_close(ours.float(), ref.float(), atol=2e-5, rtol=1e-3)
