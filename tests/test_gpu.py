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


SYNC_FREE_PRESETS = ("dapo", "grpo", "cispo", "gspo", "gspo_token", "gmpo")


@FUSED
def test_no_host_sync_on_the_hot_path(backend):
    """Forward + backward of every budgeted preset (tests/test_host_overhead.py) with a bool
    and a fractional mask: any .item() / bool() of a device tensor (a label check, a mask check,
    the upstream gradient's) raises under the sync debug mode."""
    data = _on_gpu(make_batch(batch=4, time=32, vocab=32003, dtype=torch.bfloat16, seed=6))
    fractional = {**data, "mask": data["mask"] * 0.5}
    cfg = LossConfig.preset("grpo").replace(is_correction="token_truncate")
    for preset in SYNC_FREE_PRESETS:  # compile and warm up first
        run_loss(_impl(backend), data, LossConfig.preset(preset))
    run_loss(_impl(backend), data, cfg)
    # made before the debug mode: its host-to-device copy is a sync, not the loss's
    device_scale = torch.tensor(0.25, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for preset in SYNC_FREE_PRESETS:
            for batch in (data, fractional):
                run_loss(_impl(backend), batch, LossConfig.preset(preset))
        run_loss(_impl(backend), data, cfg)
        for scale in (0.5, device_scale):  # grad_scale: no read either
            run_loss(_impl(backend), data, LossConfig.preset("dapo"), grad_scale=scale)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("preset", ["dapo", "grpo", "gspo"])
@FUSED
def test_grad_scale_writes_the_scaled_gradient_compiled(preset, backend):
    """grad_scale=s (a number, a device scalar) and (loss x s).backward(): the compiled kernels
    write s x the plain gradient (s a power of two: the same bits), the loss unchanged."""
    data = _on_gpu(make_batch(batch=4, time=40, vocab=32003, dtype=torch.bfloat16, seed=12))
    cfg = LossConfig.preset(preset)
    args = {k: v for k, v in data.items() if k != "logits"}
    plain, plain_grad = run_loss(_impl(backend), data, cfg)
    for scale in (0.125, torch.tensor(0.125, device="cuda")):
        leaf = data["logits"].detach().requires_grad_(True)
        out = fusedrl.policy_loss(leaf, config=cfg, backend=backend, grad_scale=scale, **args)
        (grad,) = torch.autograd.grad(out.loss * scale, leaf)
        assert torch.equal(out.loss, plain.loss)
        assert torch.equal(grad, plain_grad * 0.125)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_upstream_factor_scales_half_gradients_in_fp32(dtype):
    """The scaling kernel (rows it can walk) and its torch fallback (a transposed gradient):
    GradScaler's 2**16 and 1/3 times a half / bf16 gradient, the product in fp32 rounded once
    (a CUDA multiply by a 0-D tensor would cast the factor to the gradient's dtype: inf in
    fp16, low bits lost in bf16)."""
    from fusedrl.kernels.scale import scale_rows_unless_one

    gen = torch.Generator(device="cuda").manual_seed(5)
    for factor in (2.0**16, 1.0 / 3.0):
        for grad in (
            torch.randn(6, 1031, device="cuda", generator=gen).mul_(1e-3).to(dtype),
            torch.randn(1031, 6, device="cuda", generator=gen).mul_(1e-3).to(dtype).t(),
        ):
            truth = (grad.float() * factor).to(dtype)  # (the fp32 product, rounded once)
            scale_rows_unless_one(grad, torch.tensor([factor], device="cuda"))
            assert torch.equal(grad, truth), (factor, grad.is_contiguous())


@pytest.mark.parametrize("preset", ["dapo", "grpo", "gspo"])
@FUSED
def test_loss_forward_and_backward_replay_in_a_cuda_graph(preset, backend):
    """policy_loss and its backward captured in one CUDA graph (nothing syncs, every launch on
    the capture stream) and replayed on new inputs copied into the captured ones: the loss, the
    gradient and the metrics equal an eager call's on those inputs."""
    first = _on_gpu(make_batch(batch=4, time=48, vocab=32003, dtype=torch.bfloat16, seed=9))
    second = _on_gpu(make_batch(batch=4, time=48, vocab=32003, dtype=torch.bfloat16, seed=10))
    second["mask"] = first["mask"]  # (the captured masks are the same tensors)
    cfg = LossConfig.preset(preset)
    static = {k: v.clone() for k, v in first.items()}
    leaf = static.pop("logits").requires_grad_(True)

    def step():
        out = fusedrl.policy_loss(leaf, config=cfg, backend=backend, **static)
        (grad,) = torch.autograd.grad(out.loss, leaf)
        return out, grad

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: compiles, allocator pools
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, captured_grad = step()
    with torch.no_grad():
        leaf.copy_(second["logits"])
        for key, value in static.items():
            value.copy_(second[key])
    graph.replay()
    torch.cuda.synchronize()
    eager, eager_grad = run_loss(_impl(backend), second, cfg)
    torch.testing.assert_close(captured.loss, eager.loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(captured_grad.float(), eager_grad.float(), atol=1e-7, rtol=1e-2)
    for key, value in eager.metrics.items():
        torch.testing.assert_close(captured.metrics[key], value, atol=1e-6, rtol=1e-5, msg=key)


def test_bench_loss_times_cuda_graph_replays(tmp_path):
    """bench_loss.py --cuda-graph: fusedrl and Liger captured and replayed (a row with a time,
    or for a peer the error that stopped its capture), and a replay writes the eager step's
    gradient."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_loss

    case = bench_loss.Case(512, 32003, "dapo", torch.bfloat16, torch.device("cuda"), 2, 8)
    step = bench_loss.make_step("policy_loss_fwd_bwd", "fusedrl-triton", case)
    eager = [step()[1].clone() for _ in range(2)]
    replay = bench_loss.graphed(step, case)
    for want in eager:  # the replays cycle over the buffers in the eager steps' order
        torch.testing.assert_close(replay()[1], want, atol=0, rtol=0)
    args = ["--N", "512", "--V", "32003", "--presets", "dapo", "--ops", "policy_loss_fwd_bwd"]
    args += ["--impls", "fusedrl-triton", "liger", "--cuda-graph", "--copy-gib", "0.05"]
    args += ["--warmup-ms", "5", "--rep-ms", "20", "--out", str(tmp_path)]
    assert bench_loss.main(args) == 0
    (result,) = tmp_path.glob("policy_loss_fwd_bwd-*.json")
    rows = {row["impl"]: row for row in json.loads(result.read_text())["rows"]}
    assert rows["fusedrl-triton"]["ms"] > 0 and "CUDA-graph" in rows["fusedrl-triton"]["timing"]
    if "liger" in rows:  # (skipped where liger_kernel is not installed)
        assert rows["liger"].get("ms") or rows["liger"]["error"]
    assert eager[0].abs().sum() > 0


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
    # GSPO clips the sequence ratio at 1 -/+ 3e-4 / 4e-4: a per-sequence shift of 0.2 puts every
    # sequence's mean log-ratio far outside it, where bf16 rounding (~1e-2) cannot flip the clip.
    old += torch.tensor([0.2, -0.2, 0.2], device="cuda")[:, None]
    ref_logp = old - 0.1 * torch.rand(batch, time, device="cuda", generator=gen)  # grpo's KL
    cfg = LossConfig.preset(preset).replace(entropy_coef=0.01)

    def run(backend, dt):
        h = full.to(dt).requires_grad_(True)
        w = weight.to(dt).requires_grad_(True)
        out = fusedrl.linear_policy_loss(
            h[:, prompt:],
            w,
            labels,
            adv,
            mask,
            old_logp=old,
            ref_logp=ref_logp,
            config=cfg,
            backend=backend,
            return_entropy=True,
        )
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


@pytest.mark.parametrize("count", [False, True])
@pytest.mark.parametrize("preset", ["dapo", "gspo"])
def test_linear_policy_loss_skips_masked_rows(preset, count):
    """skip_masked_rows / live_rows on CUDA (the gather, the host-counted stable sort, the
    scatter; the gemm design's chunks of live rows): every output as without the skip, NaN in
    the skipped rows' hidden states never read; an all-masked call gives 0."""
    gen = torch.Generator(device="cuda").manual_seed(13)
    batch, time, size, vocab = 4, 37, 256, 151936
    hidden = torch.randn(batch, time, size, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(vocab, size, device="cuda", generator=gen) / size**0.5).bfloat16()
    labels = torch.randint(0, vocab, (batch, time), device="cuda", generator=gen)
    mask = torch.rand(batch, time, device="cuda", generator=gen) < 0.6
    adv = torch.randn(batch, device="cuda", generator=gen)
    cfg = LossConfig.preset(preset, entropy_coef=0.01)
    live = int(mask.sum())

    def run(h, m, **skip):
        h, w = h.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = fusedrl.linear_policy_loss(
            h, w, labels, adv, m, config=cfg, return_entropy=True, backend="triton", **skip
        )
        return [out.loss, out.logp, out.entropy, *torch.autograd.grad(out.loss, (h, w))]

    want = run(hidden, mask)
    padded = torch.where(mask[..., None], hidden, float("nan"))
    skip = {"live_rows": live} if count else {"skip_masked_rows": True}
    # cuBLAS may pick another kernel for fewer rows: a bf16 logit may round the other way, so
    # bf16-sized tolerances (a row mix-up is off by whole nats)
    got = run(padded, mask, **skip)
    for value, expected in zip(got[:3], want[:3]):
        assert torch.isfinite(value).all()
        torch.testing.assert_close(value, expected, atol=5e-2, rtol=2e-2)
    for grad, expected in zip(got[3:], want[3:]):
        assert torch.isfinite(grad).all()
        assert (grad.float() - expected.float()).norm() / expected.float().norm() < 2e-2
    nothing = torch.zeros_like(mask)
    empty = run(padded, nothing, **({"live_rows": 0} if count else skip))
    assert empty[0].item() == 0.0 and not empty[-1].any() and not empty[-2].any()


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


@pytest.mark.parametrize("crowded", [False, True])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "filters",
    [(50, None, None), (None, 0.9, None), (None, None, 0.05), (50, 0.9, 0.05), (None, 0.9, 0.05)],
)
def test_sampled_set_kernel_against_the_torch_select(filters, dtype, per_token, crowded):
    """The compiled select (kernels/sampling.py: the gathered candidates, or the radix passes)
    writes what fusedrl.sampling's torch.topk / sort route writes, at a real vocab. top_k and
    min_p compare values only: bit for bit. top_p sums probabilities in another order: in a few
    rows the boundary value (with its ties, many in bf16) may be in one set and not the other,
    and nothing else may differ. `per_token`: each row at its own temperature (ROW_TEMPERATURE),
    the torch route dividing by the column. `crowded`: every third row has 400 ties of its
    50th largest logit, more than the gathered way holds: those rows take the radix passes,
    beside rows that gather, in the same launch (the program's scratch reused row after row).
    Every third row from the second is peaked (40 logits far above the rest): there top_p's
    nucleus lies among the gathered logits, which decide it without top_k too; the flat rows'
    nucleus is wider (the radix passes)."""
    from fusedrl.kernels.sampling import write_sampled_set
    from fusedrl.sampling import SamplingMask, mask_to_sampled_set

    top_k, top_p, min_p = filters
    gen = torch.Generator().manual_seed(17)
    logits = (2.0 * torch.randn(3, 97, 151936, generator=gen)).to("cuda", dtype)
    labels = torch.randint(0, 151936, (3, 97), generator=gen).cuda()
    logits.view(-1, 151936)[1::3, 5000:5040] += 12.0
    if crowded:
        rows = logits.view(-1, 151936)[::3]
        rows[:, 1000:1400] = rows.topk(50, -1).values[:, -1:]
    out = torch.empty_like(logits)
    temps = (0.4 + 1.2 * torch.rand(3, 97, generator=gen)).cuda() if per_token else None
    write_sampled_set(logits, labels, out, 0.7, top_k, top_p, min_p, row_temps=temps)
    column = 0.7 if temps is None else temps.view(-1, 1)
    expected = mask_to_sampled_set(
        logits.view(-1, 151936), labels.view(-1), column, SamplingMask(top_k, top_p, min_p)
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


@pytest.mark.parametrize("inplace", [False, True])
@FUSED
def test_policy_loss_over_sampled_sets_at_real_vocab(backend, inplace):
    """The fused loss over sampled sets (Triton: the compiled kernels reading the logits through
    the select's floors; CUDA: a masked copy) against the torch backend: bf16, V = 151936."""
    data = _on_gpu(make_batch(batch=4, time=33, vocab=151936, dtype=torch.bfloat16, seed=14))
    cfg = LossConfig.preset("dapo", temperature=0.7, top_k=50, top_p=0.9, min_p=0.01)
    results = {}
    for name in (backend, "torch"):
        logits = data["logits"].clone().requires_grad_(True)
        rest = {k: v for k, v in data.items() if k != "logits"}
        use_inplace = inplace and name == backend
        out = fusedrl.policy_loss(logits, config=cfg, backend=name, inplace=use_inplace, **rest)
        (dlogits,) = torch.autograd.grad(out.loss, logits)
        results[name] = (out.loss, out.logp, dlogits)
    for ours, ref in zip(results[backend], results["torch"]):
        torch.testing.assert_close(ours.float(), ref.float(), atol=2e-5, rtol=1e-3)


# --- issue 29 items 2 and 5 ---


@pytest.mark.parametrize("preset", ["gspo", "dapo"])
@FUSED
def test_inplace_gradient_is_bitwise_the_out_of_place_one(preset, backend):
    """The in-place race: the gradient overwrites the row it reads, and the label's entry is
    computed from the label's logit. At V = 262144 (bf16) every row is whole tiles (no remainder
    loop and its barriers), and labels = V - 1 put the label in the tile the sweep stores first:
    a warp running ahead would overwrite it before it is read. 100 repetitions, bitwise."""
    vocab, shape = 262144, (4, 16)  # [B, T]: GSPO needs the sequences
    gen = torch.Generator(device="cuda").manual_seed(29)
    logits = torch.randn(*shape, vocab, device="cuda", dtype=torch.bfloat16, generator=gen)
    labels = torch.full(shape, vocab - 1, device="cuda")
    # Positive: every row keeps a gradient (GSPO clips a sequence at ratio e^-0.05 when A < 0).
    adv = 0.5 + torch.rand(shape[0], device="cuda", generator=gen)
    mask = torch.ones(shape, dtype=torch.bool, device="cuda")
    cfg = LossConfig.preset(preset)
    kwargs = dict(config=cfg, backend=backend)
    with torch.no_grad():
        old = fusedrl.token_logprobs(logits, labels, backend=backend)[0] + 0.05
    leaf = logits.clone().requires_grad_(True)
    out = fusedrl.policy_loss(leaf, labels, adv, mask, old_logp=old, **kwargs)
    (expected,) = torch.autograd.grad(out.loss, leaf)
    assert expected[..., -1].abs().min() > 0  # the label's entry carries the one-hot term
    for _ in range(100):
        leaf = logits.clone().requires_grad_(True)
        out = fusedrl.policy_loss(leaf, labels, adv, mask, old_logp=old, inplace=True, **kwargs)
        (grad,) = torch.autograd.grad(out.loss, leaf)
        assert grad.data_ptr() == leaf.data_ptr()
        assert torch.equal(grad, expected)


@pytest.mark.parametrize("preset", ["dapo", "gspo"])
@FUSED
def test_gradient_aligned_unlike_the_logits(preset, backend):
    """An odd V read from a [B, P+T, V] slice (TRL's call) into a separately allocated gradient:
    the rows of the two start at different offsets within a 16-byte vector, so the gradient loop
    walks the gradient's tiles with 16-bit loads. Against the reference in fp32."""
    vocab, prompt, time = 32003, 5, 40
    data = _on_gpu(make_batch(batch=4, time=time, vocab=vocab, dtype=torch.bfloat16, seed=30))
    full = torch.randn(4, prompt + time, vocab, device="cuda", dtype=torch.bfloat16)
    full[:, prompt:] = data["logits"]
    data["logits"] = full[:, prompt:]
    cfg = LossConfig.preset(preset).replace(entropy_coef=0.01)
    ours, grad = run_loss(_impl(backend), data, cfg)
    ref, expected = run_loss(reference.policy_loss, {**data, "logits": data["logits"].float()}, cfg)
    # Most rows of the gradient start at another offset within a 16-byte vector than the logits'.
    logits_rows = data["logits"].data_ptr() + 2 * (
        torch.arange(4)[:, None] * data["logits"].stride(0)
        + torch.arange(time)[None, :] * data["logits"].stride(1)
    )
    grad_rows = grad.data_ptr() + 2 * (
        torch.arange(4)[:, None] * grad.stride(0) + torch.arange(time)[None, :] * grad.stride(1)
    )
    assert (logits_rows % 16 != grad_rows % 16).float().mean() > 0.5
    torch.testing.assert_close(ours.loss, ref.loss, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grad.float(), expected.float(), atol=1e-6, rtol=2e-2)


# --- issue 29 item 8 ---


@pytest.mark.parametrize("sampling", ["off", "on"])
@pytest.mark.parametrize("preset", ["dapo", "grpo", "gspo", "token_logprobs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@FUSED
def test_an_all_inf_row_is_nan_compiled(dtype, preset, sampling, backend):
    """A valid all -inf row has no distribution: NaN logp and entropy, as the reference says,
    where the compiled sweeps differ from the interpreted ones (ex2.approx.ftz, div.full.f32,
    FFMA; the CUDA cluster kernel's on-chip fallback). Masked rows stay 0 with a zero gradient;
    the other rows keep the reference's values. tests/test_degenerate_rows.py runs the same on
    CPU (torch, Triton interpreted)."""
    inf = float("inf")
    data = make_batch(batch=3, time=9, vocab=32003, dtype=dtype, seed=33, per_token_adv=True)
    data["mask"][0, :3] = True
    data["mask"][1] = False
    data["logits"][0, 1] = -inf  # valid
    data["logits"][1, 2] = -inf  # masked
    data = _on_gpu(data)
    # top_k and min_p: the reference keeps ties at the boundary as the kernels do (top_p: not).
    filters = dict(top_k=50, min_p=0.01) if sampling == "on" else {}
    tol = dict(atol=1e-4, rtol=1e-5)
    if preset == "token_logprobs":
        kwargs = dict(temperature=0.9, return_entropy=True, **filters)
        ref_logp, ref_ent = reference.token_logprobs(data["logits"], data["labels"], **kwargs)
        for grad in (False, True):
            leaf = data["logits"].clone().requires_grad_(grad)
            logp, ent = fusedrl.token_logprobs(leaf, data["labels"], backend=backend, **kwargs)
            for values in (ref_logp, ref_ent, logp, ent):
                assert torch.isnan(values[0, 1]) and torch.isnan(values[1, 2])
            torch.testing.assert_close(logp, ref_logp, equal_nan=True, **tol)
            torch.testing.assert_close(ent, ref_ent, equal_nan=True, **tol)
        return
    cfg = LossConfig.preset(preset, temperature=0.9, **filters)
    ref, ref_grad = run_loss(reference.policy_loss, data, cfg, return_entropy=True)
    assert torch.isnan(ref.logp[0, 1]) and torch.isnan(ref.entropy[0, 1])
    for inplace in (False, True):
        given = dict(data, logits=data["logits"].clone())
        ours, grad = run_loss(_impl(backend), given, cfg, return_entropy=True, inplace=inplace)
        assert torch.isnan(ours.logp[0, 1]) and torch.isnan(ours.entropy[0, 1])
        assert ours.logp[1, 2] == 0 and ours.entropy[1, 2] == 0 and torch.isnan(ours.loss)
        torch.testing.assert_close(ours.logp, ref.logp, equal_nan=True, **tol)
        torch.testing.assert_close(ours.entropy, ref.entropy, equal_nan=True, **tol)
        assert torch.isnan(grad[0, 1]).all() and (grad[1] == 0).all()
        # GSPO: sequence 0's ratio is NaN, so its other tokens' gradient is undefined too.
        compared = torch.ones(data["labels"].shape, dtype=torch.bool, device="cuda")
        compared[0, 1] = False
        if preset == "gspo":
            compared[0] = False
        torch.testing.assert_close(
            grad[compared].float(), ref_grad[compared].float(), atol=1e-6, rtol=2e-2
        )


@FUSED
def test_a_row_at_floor_is_nan_compiled(backend):
    """Logits at or below FLOOR count as p = 0 (kernels/rows.py, csrc's kFloor), so a row of
    them is NaN. -1e20 at T = log2(e) scales to FLOOR exactly, and the compiled sweep's FFMA
    gives offsets FLOOR - FLOOR = 0 from the label (2^0 = 1 per element: a finite lse) unless
    the label check sends the row to the exact path, whose row max at FLOOR says NaN."""
    temperature = 1.4426950408889634  # log2(e): scale2 = 1, y = x
    logits = torch.randn(2, 3, 32003, device="cuda")
    logits[0, 1] = -1e20
    labels = torch.randint(0, 32003, (2, 3), device="cuda")
    logp, ent = fusedrl.token_logprobs(logits, labels, temperature, True, backend=backend)
    assert torch.isnan(logp[0, 1]) and torch.isnan(ent[0, 1])
    ref_logp, ref_ent = reference.token_logprobs(logits, labels, temperature, True)
    others = torch.ones(2, 3, dtype=torch.bool, device="cuda")
    others[0, 1] = False
    torch.testing.assert_close(logp[others], ref_logp[others], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ent[others], ref_ent[others], atol=1e-4, rtol=1e-5)


# --- issue 29 item 1 ---


@pytest.mark.parametrize("factor", [1.0, 2.0])
@pytest.mark.parametrize("preset", ["dapo", "gspo"])
@pytest.mark.parametrize("design", ["gemm", "on-chip"])
def test_linear_policy_loss_trains_the_lm_head_bias(design, preset, factor, monkeypatch):
    """A trainable LM-head bias (TRL and the trainer pass head.bias): backward hands its [V]
    gradient, with hidden's [B, T, H] and weight's [V, H], to the device-side scaling, which took
    [B, T, V] only and raised on the bias. Every gradient against the torch backend, with the loss
    the terminal node (factor 1: the kernel leaves them alone) and behind an upstream factor (2:
    the kernel scales each)."""
    from fusedrl import linear_triton

    monkeypatch.setenv(linear_triton.DESIGN_ENV, design)
    gen = torch.Generator(device="cuda").manual_seed(29)
    batch, time, size, vocab = 3, 37, 200, 32003
    hidden = torch.randn(batch, time, size, device="cuda", generator=gen)
    weight = torch.randn(vocab, size, device="cuda", generator=gen) * (2.0 / size**0.5)
    bias = 0.5 * torch.randn(vocab, device="cuda", generator=gen)
    labels = torch.randint(0, vocab, (batch, time), device="cuda", generator=gen)
    mask = torch.ones(batch, time, dtype=torch.bool, device="cuda")
    mask[1, 20:] = False
    adv = torch.randn(batch, device="cuda", generator=gen)
    with torch.no_grad():
        logp, _ = fusedrl.linear_token_logprobs(hidden, weight, labels, bias=bias, backend="torch")
    old = logp + 0.3 * torch.randn(batch, time, device="cuda", generator=gen)
    cfg = LossConfig.preset(preset).replace(entropy_coef=0.01)

    def run(backend):
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
        out = fusedrl.linear_policy_loss(
            leaves[0],
            leaves[1],
            labels,
            adv,
            mask,
            old_logp=old,
            config=cfg,
            bias=leaves[2],
            backend=backend,
        )
        (factor * out.loss).backward()
        return out, [t.grad for t in leaves]

    ref, ref_grads = run("torch")
    out, grads = run("triton")
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-4, rtol=1e-4)
    for name, g, rg in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert g is not None and g.shape == rg.shape, name
        rel = (g - rg).norm() / rg.norm()
        assert rel < 1e-4, (name, float(rel))


# --- issue 29 item 3 ---


def _results_on(device: torch.device, case: str) -> tuple[torch.Tensor, ...]:
    """Outputs and gradients of one call of `case` on inputs made on the CPU and moved to
    `device`, with an upstream factor of 2 (so the scaling kernel runs too)."""
    data = make_batch(batch=3, time=17, vocab=32003, dtype=torch.bfloat16, seed=21, device=device)
    rows = {k: v for k, v in data.items() if k not in ("logits", "rollout_logp")}
    logits = data["logits"].clone().requires_grad_(True)
    if case in ("dapo", "gspo"):
        cfg = LossConfig.preset(case).replace(entropy_coef=0.01)
        out = fusedrl.policy_loss(logits, config=cfg, backend="triton", return_entropy=True, **rows)
        (grad,) = torch.autograd.grad(2 * out.loss, logits)
        return out.loss, out.logp, out.entropy, grad
    if case == "token_logprobs":  # with top_k: the sampled-set kernel too
        logp, entropy = fusedrl.token_logprobs(
            logits,
            data["labels"],
            temperature=0.7,
            return_entropy=True,
            backend="triton",
            top_k=50,
        )
        (grad,) = torch.autograd.grad(2 * (logp + 0.1 * entropy).sum(), logits)
        return logp, entropy, grad
    gen = torch.Generator().manual_seed(22)
    head = [torch.randn(3, 17, 64, generator=gen), 0.25 * torch.randn(32003, 64, generator=gen)]
    head.append(torch.randn(32003, generator=gen))
    leaves = [t.to(device).requires_grad_(True) for t in head]
    cfg = LossConfig.preset("dapo")
    out = fusedrl.linear_policy_loss(
        leaves[0], leaves[1], bias=leaves[2], config=cfg, backend="triton", **rows
    )
    return out.loss, out.logp, *torch.autograd.grad(2 * out.loss, leaves)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize(
    "case", ["dapo", "gspo", "token_logprobs", "linear:gemm", "linear:on-chip"]
)
def test_kernels_launch_on_the_tensors_device(case, monkeypatch):
    """Inputs on cuda:1 while cuda:0 is current: Triton launches on the current device, so
    without the launchers' device guard every kernel ran on device 0 with device-1 pointers (an
    illegal address) and the persistent grids were sized from device 0. The results equal those
    of the same call on cuda:0 (bit for bit: the same kernels on the same GPU model), and the
    current device is 0 again after each call."""
    if case.startswith("linear:"):
        from fusedrl import linear_triton

        monkeypatch.setenv(linear_triton.DESIGN_ENV, case.split(":")[1])
    results = {}
    with torch.cuda.device(0):
        for index in (0, 1):
            results[index] = _results_on(torch.device("cuda", index), case)
            torch.cuda.synchronize(index)  # an illegal address surfaces here at the latest
            assert torch.cuda.current_device() == 0
    for a, b in zip(results[0], results[1], strict=True):
        assert a.device == torch.device("cuda", 0) and b.device == torch.device("cuda", 1)
        assert torch.equal(a.cpu(), b.cpu()), case


# --- issue 29 item 4 ---
# The CUDA extension's bindings and its choice of fused kernel. The bindings cannot be built
# without a CUDA torch, so their checks are tested here; the choice is also tested on the CPU,
# against a stub runtime (tests/test_cuda_build.py).
_CUDA_OP_TENSORS = {
    "cuda_logprobs_fwd": ("labels", "valid"),
    "cuda_logits_grad": ("labels", "lse", "entropy", "dlogp", "dentropy", "out"),
    "cuda_fused_token_loss": tuple(
        "grad labels valid advantages old_logp ref_logp is_weight agg_weight low high".split()
    ),
}


def _cuda_op_arguments(op: str, device, vocab: int = 1031) -> dict:
    """Keyword arguments of a `torch.ops.fusedrl` op (its schema's names), every tensor given."""
    gen = torch.Generator(device=device).manual_seed(29)
    shape = (2, 3)

    def per_token(low=-1.0, high=1.0):
        return low + (high - low) * torch.rand(shape, device=device, generator=gen)

    logits = torch.randn(*shape, vocab, device=device, dtype=torch.bfloat16, generator=gen)
    labels = torch.randint(0, vocab, shape, device=device, generator=gen)
    valid = torch.ones(shape, dtype=torch.bool, device=device)
    if op == "cuda_logprobs_fwd":
        return dict(logits=logits, labels=labels, valid=valid, temperature=1.0)
    if op == "cuda_logits_grad":
        return dict(
            logits=logits,
            labels=labels,
            lse=per_token(5, 8),
            entropy=per_token(0, 3),
            dlogp=per_token(),
            dentropy=per_token(),
            temperature=1.0,
            out=torch.empty_like(logits),
        )
    return dict(
        logits=logits,
        grad=torch.empty_like(logits),
        labels=labels,
        valid=valid,
        advantages=per_token(),
        old_logp=per_token(-8, -5),
        ref_logp=per_token(-8, -5),
        is_weight=per_token(0.5, 1),
        agg_weight=per_token(0, 0.1),
        low=per_token(0.7, 0.8),
        high=per_token(1.2, 1.3),
        temperature=1.0,
        loss="ppo",
        dual_clip_c=None,
        delta=None,
        tau_pos=1.0,
        tau_neg=1.05,
        kl="k3",
        beta=0.1,
        entropy_coef=0.01,
    )


@pytest.mark.parametrize("other", ["cpu", "cuda:1"])
@pytest.mark.parametrize(
    "op, name", [(op, name) for op, names in _CUDA_OP_TENSORS.items() for name in names]
)
def test_cuda_op_argument_on_another_device_is_named(op, name, other):
    """Every tensor argument of the CUDA ops must be on the logits' device (type and index): the
    kernels would read another device's memory through its pointers. The error names the
    argument and both devices; with all of them on the logits' device the same call runs."""
    import re

    from fusedrl.kernels import cuda

    if other == "cuda:1" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    cuda.load()
    fn = getattr(torch.ops.fusedrl, op)
    args = _cuda_op_arguments(op, "cuda:0")
    fn(**args)
    torch.cuda.synchronize()
    args[name] = args[name].to(other)
    message = f"fusedrl: {name} is on {other} but logits are on cuda:0"
    with pytest.raises(RuntimeError, match=re.escape(message)):
        fn(**args)


# Every other argument check of csrc/bindings.cpp: (op, changed arguments, the message's start).
# Only check_launch's ("launching ... failed") is left out: it takes a failing launch.
_CUDA_BAD_ARGUMENTS = [
    (
        "cuda_logprobs_fwd",
        lambda a: {"logits": a["logits"].cpu()},
        "fusedrl: logits must be a CUDA tensor, got device cpu",
    ),
    (
        "cuda_logprobs_fwd",
        lambda a: {"logits": a["logits"][0]},
        "fusedrl: logits must be [B, T, V], got shape [3, 1031]",
    ),
    (
        "cuda_logprobs_fwd",
        lambda a: {"logits": a["logits"][..., :0]},
        "fusedrl: logits has an empty vocab dimension",
    ),
    (
        "cuda_logprobs_fwd",
        lambda a: {"logits": a["logits"].new_empty(0, 3, 1 << 30)},
        "fusedrl: logits has a vocab dimension of 1073741824; at most 1073741823 is supported",
    ),
    (
        "cuda_logprobs_fwd",
        lambda a: {"logits": a["logits"].mT.contiguous().mT},
        "fusedrl: logits must be contiguous in its vocab dimension, got strides [3093, 1, 3]",
    ),
    (
        "cuda_logprobs_fwd",
        lambda a: {"logits": a["logits"].double()},
        "fusedrl: logits must be float32, float16 or bfloat16, got Double",
    ),
    (
        "cuda_logprobs_fwd",
        lambda a: {"labels": a["labels"].int()},
        "fusedrl: labels must be int64, got Int",
    ),
    (
        "cuda_logprobs_fwd",
        lambda a: {"labels": a["labels"][:, :2]},
        "fusedrl: labels shape [2, 2] must be [B, T] of logits [2, 3, 1031]",
    ),
    (
        "cuda_logprobs_fwd",
        lambda a: {"valid": a["valid"][:, :2]},
        "fusedrl: valid shape [2, 2] must equal labels shape [2, 3]",
    ),
    (
        "cuda_logits_grad",
        lambda a: {"out": a["out"].float()},
        "fusedrl: out must match logits in shape and dtype",
    ),
    (
        "cuda_logits_grad",
        lambda a: {"lse": a["lse"][:, :2]},
        "fusedrl: lse shape [2, 2] must equal labels shape [2, 3]",
    ),
    (
        "cuda_fused_token_loss",
        lambda a: {"grad": a["grad"][:, :2]},
        "fusedrl: grad must match logits in shape and dtype",
    ),
    (
        "cuda_fused_token_loss",
        lambda a: {"loss": "gspo"},
        "fusedrl: loss 'gspo' has no token-level CUDA kernel",
    ),
    ("cuda_fused_token_loss", lambda a: {"kl": "k9"}, "fusedrl: unknown kl estimator 'k9'"),
    (
        "cuda_fused_token_loss",
        lambda a: {"ref_logp": None},
        "fusedrl: ref_logp is required when beta > 0",
    ),
]


@pytest.mark.parametrize("op, change, message", _CUDA_BAD_ARGUMENTS)
def test_cuda_op_bad_argument_message(op, change, message):
    """The bindings' checks, with the message that names the argument (they cannot be reached
    without a CUDA build of torch, so they are tested here and not on the CPU)."""
    import re

    from fusedrl.kernels import cuda

    cuda.load()
    args = _cuda_op_arguments(op, "cuda:0")
    args.update(change(args))
    with pytest.raises(RuntimeError, match=re.escape(message)):
        getattr(torch.ops.fusedrl, op)(**args)


def test_cuda_cluster_kernel_info_checks_its_arguments():
    from fusedrl.kernels import cuda

    cuda.load()
    with pytest.raises(RuntimeError, match="fusedrl: device must be a CUDA device, got cpu"):
        torch.ops.fusedrl.cuda_cluster_kernel_info(torch.device("cpu"), torch.bfloat16)
    with pytest.raises(RuntimeError, match="fusedrl: dtype must be float32, float16 or bfloat16"):
        torch.ops.fusedrl.cuda_cluster_kernel_info(torch.device("cuda:0"), torch.int32)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("op", list(_CUDA_OP_TENSORS))
def test_cuda_ops_launch_on_the_logits_device_and_its_current_stream(op):
    """Inputs on cuda:1 while cuda:0 is current, and a side stream current on cuda:1: each op
    launches on device 1 (device-0 launches with device-1 pointers are an illegal address), on
    that stream (its inputs are written there behind a sleep: another stream would read them
    too early), gives the results of the same call on cuda:0 bit for bit, and leaves device 0
    current."""
    from fusedrl.kernels import cuda

    cuda.load()
    fn = getattr(torch.ops.fusedrl, op)

    def outputs(device):
        args = _cuda_op_arguments(op, device)
        result = fn(**args)
        written = [args[k] for k in ("grad", "out") if k in args]
        return [*(result if isinstance(result, tuple | list) else ()), *written]

    expected = [t.cpu() for t in outputs("cuda:0")]
    side = torch.cuda.Stream(device=1)
    side.wait_stream(torch.cuda.current_stream(1))
    with torch.cuda.stream(side):  # side becomes device 1's current stream (and 1 current)
        # The inputs are written behind a ~10 ms sleep on the side stream: a launch on any
        # other stream of device 1 would read them before they exist.
        torch.cuda._sleep(1 << 24)
        with torch.cuda.device(0):  # device 0 current; device 1 keeps side as its stream
            got = outputs("cuda:1")
            assert torch.cuda.current_device() == 0
    side.synchronize()
    for a, b in zip(expected, got, strict=True):
        assert b.device == torch.device("cuda", 1) and torch.equal(a, b.cpu())


def test_cuda_fused_loss_captures_in_a_cuda_graph():
    """torch.cuda.graph captures on its own stream: an op that launched on any other stream (the
    legacy default one, say) fails the capture, or leaves the replay without its kernel. Replayed
    on new inputs, the captured op gives what a direct call gives."""
    from fusedrl.kernels import cuda

    cuda.load()
    fn = torch.ops.fusedrl.cuda_fused_token_loss
    args = _cuda_op_arguments("cuda_fused_token_loss", "cuda:0", vocab=151936)
    fn(**args)  # the first call sets the cluster kernel's attribute: outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn(**args)
    fresh = _cuda_op_arguments("cuda_fused_token_loss", "cuda:0", vocab=151936)
    fresh["logits"].mul_(1.5)
    fresh["advantages"].neg_()
    for key in ("logits", "advantages"):
        args[key].copy_(fresh[key])
    graph.replay()
    torch.cuda.synchronize()
    expected = fn(**fresh)
    for a, b in zip(captured, expected, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(args["grad"], fresh["grad"])


def _extension_library():
    """The shared library the process loaded the CUDA ops from: fusedrl._C when prebuilt, else
    the JIT build (fusedrl.kernels.cuda._jit_build)."""
    import sys
    from pathlib import Path

    from fusedrl.kernels import cuda

    if "fusedrl._C" in sys.modules:
        return Path(sys.modules["fusedrl._C"].__file__)
    return cuda.cache_dir() / "fusedrl_cuda.so"


def _ran_kernels(fn) -> set[str]:
    """Names of the CUDA kernels `fn()` launched (the profiler's CUPTI trace)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {event.name for event in prof.events()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_cluster_kernel_choice_matches_the_loaded_code(dtype):
    """What cuda_cluster_kernel_info reports, and the kernel that runs, against the images of
    the loaded library (cuobjdump) and the image a driver loads on this GPU
    (tests/cuda_images.loaded_image): the one-read cluster kernel iff that image's cluster kernel
    has its body (compiled for compute_90+) on a GPU with clusters (sm_90+); the versions are
    those of that image; the shared-memory attribute is set once, at the opt-in maximum less the
    kernel's static shared memory, however many launches follow; rows too long for shared memory
    take the two-sweep kernel."""
    from fusedrl.kernels import cuda

    from .cuda_images import find_cuobjdump, images, loaded_image

    cuda.load()
    dump = find_cuobjdump()
    if dump is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton) to read the loaded library")
    major, minor = torch.cuda.get_device_capability()
    loaded = loaded_image(images(_extension_library(), dump), 10 * major + minor)
    assert loaded is not None, "the loaded library has no image for this GPU"
    cluster = major >= 9 and loaded.image.cluster_body
    fn = torch.ops.fusedrl.cuda_fused_token_loss
    small = _cuda_op_arguments("cuda_fused_token_loss", "cuda:0", vocab=151936)
    small = {k: (v.to(dtype) if k in ("logits", "grad") else v) for k, v in small.items()}
    names = set()
    for _ in range(3):
        names |= _ran_kernels(lambda: fn(**small))
    info = cuda.cluster_kernel_info("cuda:0", dtype)
    print(f"{_extension_library()}: {loaded}; {info}")
    assert info["available"] == cluster, info
    assert (info["ptx_version"], info["binary_version"]) == (
        loaded.ptx_version,
        loaded.binary_version,
    ), info
    ran_cluster = any("fused_token_loss_cluster_kernel" in n for n in names)
    ran_two_sweep = any("fused_token_loss_kernel" in n for n in names)
    assert (ran_cluster, ran_two_sweep) == (cluster, not cluster), names
    optin = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    if cluster:
        assert info["attribute_sets"] == 1  # after 3 launches
        assert 0 < optin - info["max_dynamic_smem"] <= 4096, (optin, info)
        huge = _cuda_op_arguments("cuda_fused_token_loss", "cuda:0", vocab=optin * 8)
        huge = {k: (v.to(dtype) if k in ("logits", "grad") else v) for k, v in huge.items()}
        huge_names = _ran_kernels(lambda: fn(**huge))
        assert not any("fused_token_loss_cluster_kernel" in n for n in huge_names), huge_names
        assert cuda.cluster_kernel_info("cuda:0", dtype)["attribute_sets"] == 1
    else:
        assert info["attribute_sets"] == 0 and info["max_dynamic_smem"] == 0, info


_PTX_ONLY_BUILD = """
import json, sys
import torch
import fusedrl
from fusedrl import LossConfig
from fusedrl.kernels import cuda
from tests.conftest import make_batch

cuda._jit_build(verbose=False)  # this build, not a prebuilt fusedrl._C
info = cuda.cluster_kernel_info("cuda:0", torch.bfloat16)
data = make_batch(batch=4, time=9, vocab=151936, dtype=torch.bfloat16, seed=4)
data = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in data.items()}
cfg = LossConfig.preset("dapo")
results = {}
for backend in ("cuda", "torch"):
    logits = data["logits"].detach().requires_grad_(True)
    args = {k: v for k, v in data.items() if k != "logits"}
    out = fusedrl.policy_loss(logits, config=cfg, backend=backend, **args)
    (grad,) = torch.autograd.grad(out.loss, logits)
    torch.cuda.synchronize()  # a trap surfaces here at the latest
    results[backend] = (out.loss.float(), grad.float())
loss_error = (results["cuda"][0] - results["torch"][0]).abs().item()
grad_error = (results["cuda"][1] - results["torch"][1]).abs().max().item()
print(json.dumps({**info, "loss_error": loss_error, "grad_error": grad_error}))
"""


@pytest.mark.slow
def test_cuda_extension_built_for_8_0_ptx_runs_the_two_sweep_kernel(tmp_path):
    """The issue's case: the extension built for `8.0+PTX` (no sm_90 cubin; the driver JITs the
    compute_80 PTX, whose cluster kernel is the trap) on an sm_90+ GPU. Before the fix the device's
    compute capability chose the cluster kernel and the trap lost the CUDA context; now the
    loaded code's ptxVersion (80) rules it out and the two-sweep kernel gives the torch backend's
    loss and gradient. A fresh process: the ops of one build register once per process."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the hazard needs an sm_90+ GPU (before, the device's arch chose the kernel)")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": "8.0+PTX", "FUSEDRL_CUDA_CACHE": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", _PTX_ONLY_BUILD],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    major, minor = torch.cuda.get_device_capability()
    assert report["ptx_version"] == 80 and report["binary_version"] == 10 * major + minor, report
    assert not report["available"] and report["attribute_sets"] == 0, report
    assert report["loss_error"] <= 1e-4 and report["grad_error"] <= 1e-3, report


# --- issue 29 item 9 ---


@pytest.mark.parametrize("top_p", [0.5, 0.75])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@FUSED
def test_top_p_exact_bound_compiled(dtype, top_p, backend):
    """tests/test_exact_bounds.py's rows (every cumulative mass exact in binary, one of them
    exactly 1 - top_p) through the compiled select kernel, which the CUDA backend replays with
    too. Its weights are exp2 of the integers -k (ex2.approx, exact for integers) and its target
    top_p x a power of two: the kept set is vLLM's to the token, as on the CPU."""
    from .test_exact_bounds import top_p_rows, vllm_kept

    logits, labels, temperature = top_p_rows(dtype)
    expected = vllm_kept(logits, temperature, top_p)  # vLLM's rule on the CPU, exact
    processed = torch.where(expected, logits.float() / temperature, -float("inf"))
    processed = processed.log_softmax(-1)
    expected_logp = processed.gather(-1, labels[..., None])[..., 0]
    logits, labels = logits.cuda(), labels.cuda()
    logp, _ = fusedrl.token_logprobs(logits, labels, temperature, backend=backend, top_p=top_p)
    torch.testing.assert_close(logp.cpu(), expected_logp, atol=1e-6, rtol=1e-6)
    if backend == "triton":
        from fusedrl.kernels import sampling

        out = torch.empty_like(logits)
        sampling.write_sampled_set(logits, labels, out, temperature, None, top_p, None)
        assert torch.equal((out != -float("inf")).cpu(), expected)


@pytest.mark.parametrize("option", ["token_k1", "seq_sum_k1", "seq_mean_k1"])
@FUSED
def test_rejection_lower_bound_on_gpu(option, backend):
    """A k1 statistic equal to the lower bound (tests/test_exact_bounds.py) is kept on CUDA
    tensors as on the CPU (fp32 compares with the bound rounded to fp32)."""
    from .test_exact_bounds import rejection_batch

    data, cfg, keep = rejection_batch(option)
    data = _on_gpu(data)
    kept = data["mask"] & keep.cuda().bool()
    ours, grad = run_loss(_impl(backend), data, cfg)
    plain = dict(data, mask=kept, rollout_logp=None)
    by_mask, mask_grad = run_loss(_impl(backend), plain, LossConfig())
    torch.testing.assert_close(ours.loss, by_mask.loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, mask_grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("vocab", [32003, 151936])
@pytest.mark.parametrize("kind", ["reverse_kl", "forward_kl", "jsd"])
@pytest.mark.parametrize("inplace", [False, True])
def test_distill_two_row_kernels_at_real_vocab(vocab, kind, inplace):
    """kernels/two_rows.py compiled (ex2.approx, 2048-element tiles, odd and real vocabularies)
    against the torch backend on the same bf16 logits: the loss, the student's logp, the
    gradient."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    student = (2.0 * torch.randn(3, 41, vocab, generator=gen, device="cuda")).bfloat16()
    noise = torch.randn(student.shape, generator=gen, device="cuda")
    teacher = (student.float() + noise).bfloat16()
    labels = torch.randint(0, vocab, (3, 41), generator=gen, device="cuda")
    mask = torch.rand(3, 41, generator=gen, device="cuda") > 0.2
    mask[1] = False
    outs = {}
    for backend in ("torch", "triton"):
        x = student.clone().requires_grad_(True)
        work = x.clone() if inplace and backend == "triton" else x
        out = fusedrl.distill_loss(
            work,
            teacher,
            labels,
            mask,
            kind=kind,
            beta=0.3,
            temperature=0.9,
            backend=backend,
            inplace=inplace and backend == "triton",
        )
        (grad,) = torch.autograd.grad(out.loss, x)
        outs[backend] = (out, grad)
    (ref, ref_grad), (ours, grad) = outs["torch"], outs["triton"]
    torch.testing.assert_close(ours.loss, ref.loss, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours.logp, ref.logp, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=1e-6, rtol=2**-7)
    assert (grad[~mask] == 0).all()


def _torch_and(backend: str, data: dict, inplace: bool = False, **kwargs) -> list:
    """policy_loss(**kwargs) on the torch backend, then on `backend` (in place on a copy with
    `inplace`), each from a fresh leaf copy of data's logits: [(out, grad) of torch, of backend]."""
    args = {k: v for k, v in data.items() if k != "logits"}
    results = []
    for impl in ("torch", backend):
        logits = data["logits"].clone().requires_grad_(True)
        in_place = inplace and impl != "torch"
        work = logits.clone() if in_place else logits
        out = fusedrl.policy_loss(work, **args, backend=impl, inplace=in_place, **kwargs)
        (grad,) = torch.autograd.grad(out.loss, logits)
        results.append((out, grad))
    return results


@pytest.mark.parametrize("kind", ["full", "full_reverse"])
@pytest.mark.parametrize("preset", ["dapo", "gspo"])
@pytest.mark.parametrize("inplace", [False, True])
@FUSED
def test_exact_kl_two_row_kernels_at_real_vocab(kind, preset, inplace, backend):
    """policy_loss with kl="full" on the compiled two-row kernels (the policy's terms and the
    KL's in one gradient write; backend="cuda" takes Triton's) against the torch backend on the
    same bf16 logits."""
    data = _on_gpu(make_batch(batch=4, time=33, vocab=151936, dtype=torch.bfloat16, seed=2))
    gen = torch.Generator(device="cuda").manual_seed(4)
    noise = torch.randn(data["logits"].shape, generator=gen, device="cuda")
    data["ref_logits"] = (data["logits"].float() + 0.5 * noise).bfloat16()
    del data["ref_logp"]
    cfg = LossConfig.preset(preset, entropy_coef=0.01).replace(kl=kind, beta=0.1)
    (ref, ref_grad), (ours, grad) = _torch_and(
        backend, data, inplace=inplace, config=cfg, return_entropy=True
    )
    torch.testing.assert_close(ours.loss, ref.loss, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours.metrics["kl"], ref.metrics["kl"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours.entropy, ref.entropy, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=1e-6, rtol=2**-7)


@pytest.mark.parametrize("filters", [{}, {"top_k": 50, "min_p": 0.05}])
@pytest.mark.parametrize("preset", ["dapo", "gspo"])
@FUSED
def test_per_token_temperatures_compiled(preset, filters, backend):
    """temperature= a [B, T] tensor on the compiled kernels (Triton's ROW_TEMPERATURE: the fused
    kernel, the two-pass kernels, with filters the select kernel too; the CUDA extension's
    RowRead.temperatures in all four of its kernels) against the torch backend on the same bf16
    logits; the CUDA fused kernel in place too, and its two passes (entropy_coef as a tensor)."""
    data = _on_gpu(make_batch(batch=4, time=33, vocab=151936, dtype=torch.bfloat16, seed=5))
    temps = 0.4 + 1.2 * torch.rand(data["labels"].shape, device="cuda")
    cfg = LossConfig.preset(preset, entropy_coef=0.01, **filters)
    calls = [{}, {"inplace": True}] if backend == "cuda" else [{}]
    for call in calls:
        (ref, ref_grad), (ours, grad) = _torch_and(
            backend, data, config=cfg, temperature=temps, **call
        )
        torch.testing.assert_close(ours.loss, ref.loss, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours.logp, ref.logp, atol=1e-3, rtol=1e-4)
        torch.testing.assert_close(grad.float(), ref_grad.float(), atol=1e-6, rtol=2**-7)
    # the log-prob and gradient kernels (the two passes), against the torch backend
    results = []
    for impl in ("torch", backend):
        x = data["logits"].clone().requires_grad_(True)
        logp, entropy = fusedrl.token_logprobs(x, data["labels"], temps, True, impl, **filters)
        (grad,) = torch.autograd.grad(logp.sum() + 0.1 * entropy.sum(), x)
        results.append((logp, entropy, grad))
    for want, got in zip(*results):
        torch.testing.assert_close(got.float(), want.float(), atol=1e-3, rtol=2**-7)
    # and they act: far from the call at the mean temperature
    plain = fusedrl.token_logprobs(data["logits"], data["labels"], 1.0, False, backend)[0]
    assert (results[1][0] - plain).abs().max() > 0.1


@pytest.mark.parametrize(
    "case", ["dapo", "dapo-inplace", "gspo-top-k-min-p", "dapo-exact-kl", "logprobs"]
)
@FUSED
def test_soft_cap_in_the_compiled_row_kernels(case, backend):
    """policy_loss / token_logprobs(softcap=) on the compiled kernels (Triton's SOFTCAP, the CUDA
    extension's kCap: tanh(a x) at each load, rcp.approx and ex2.approx, 4 a r (1 - r) at each
    gradient store; the fused kernel in place too, the two passes, the two-row kernels) against
    the torch backend on the same bf16 logits of V = 151936, a share of them past the cap, and
    some banned (-inf and bf16's lowest, as masks write them)."""
    data = _on_gpu(make_batch(batch=4, time=33, vocab=151936, dtype=torch.bfloat16, seed=8))
    data["logits"] = data["logits"] * 8  # |x| up to ~60 against the cap of 30
    data["logits"][0, :, 7] = float("-inf")
    data["logits"][2, :, 11] = torch.finfo(torch.bfloat16).min
    cap = 30.0
    if case == "logprobs":
        results = []
        for impl in ("torch", backend):
            x = data["logits"].clone().requires_grad_(True)
            logp, entropy, sum_sq = fusedrl.token_logprobs(
                x, data["labels"], 0.7, True, impl, softcap=cap, return_sum_pi_squared=True
            )
            (grad,) = torch.autograd.grad(logp.sum() + entropy.sum(), x)
            results.append((logp, entropy, sum_sq, grad))
        for want, got in zip(*results):
            torch.testing.assert_close(got.float(), want.float(), atol=1e-3, rtol=2**-7)
        plain = fusedrl.token_logprobs(data["logits"], data["labels"], 0.7, False, backend)[0]
        assert (results[1][0] - plain).abs().max() > 0.1  # the cap acted
        return
    preset = case.split("-")[0]
    kwargs = {"config": LossConfig.preset(preset, entropy_coef=0.01), "softcap": cap}
    if case == "gspo-top-k-min-p":
        kwargs["config"] = LossConfig.preset("gspo", top_k=50, min_p=0.05)
    if case == "dapo-exact-kl":
        gen = torch.Generator(device="cuda").manual_seed(4)
        noise = torch.randn(data["logits"].shape, generator=gen, device="cuda")
        kwargs["ref_logits"] = (data["logits"] + noise).bfloat16()
        kwargs["config"] = LossConfig.preset("dapo", kl="full", beta=0.1)
        data.pop("ref_logp")
    (ref, ref_grad), (ours, grad) = _torch_and(
        backend, data, inplace=case.endswith("inplace"), **kwargs
    )
    torch.testing.assert_close(ours.loss, ref.loss, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours.logp, ref.logp, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=1e-6, rtol=2**-7)
    assert torch.isfinite(grad).all() and (grad[0, :, 7] == 0).all()  # banned: no gradient


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_tensor_entropy_coefficient_compiled(backend):
    """entropy_coef= a device scalar on the compiled fused kernel (Triton's ENTROPY_COEF_FROM_PTR,
    the CUDA extension's TokenLossInputs.entropy_coef) against the torch backend, and under
    inductor one graph for every value of the coefficient (adaptive entropy control moves it
    between steps)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    data = _on_gpu(make_batch(batch=4, time=33, vocab=151936, dtype=torch.bfloat16, seed=8))
    args = {k: v for k, v in data.items() if k != "logits"}
    cfg = LossConfig.preset("dapo")
    coef = torch.tensor(0.2, device="cuda")
    (ref, ref_grad), (ours, grad) = _torch_and(backend, data, config=cfg, entropy_coef=coef)
    torch.testing.assert_close(ours.loss, ref.loss, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=1e-6, rtol=2**-7)
    counter = CompileCounterWithBackend("inductor")

    def loss_fn(logits, value):
        return fusedrl.policy_loss(
            logits, **args, config=cfg, entropy_coef=value, backend=backend
        ).loss

    compiled = torch.compile(loss_fn, fullgraph=True, backend=counter)
    for value in (0.0, 0.05, 0.2):
        value = torch.tensor(value, device="cuda")
        results = []
        for fn in (
            compiled,
            lambda x, v: (
                fusedrl.policy_loss(x, **args, config=cfg, entropy_coef=v, backend="torch").loss
            ),
        ):
            logits = data["logits"].clone().requires_grad_(True)  # the fused kernel's path
            loss = fn(logits, value)
            results.append((loss, torch.autograd.grad(loss, logits)[0]))
        (loss, grad), (want, want_grad) = results
        torch.testing.assert_close(loss, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(grad.float(), want_grad.float(), atol=1e-6, rtol=2**-7)
    assert counter.frame_count == 1


def test_soft_capped_lm_head_and_distillation_on_the_gemm_design():
    """linear_policy_loss(softcap=) and linear_distill_loss with per-token temperatures and a
    teacher on cuBLAS chunks + the compiled kernels, against the torch backend."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    hidden = torch.randn(4, 33, 256, device="cuda", generator=gen).bfloat16()
    weight = (0.1 * torch.randn(32003, 256, device="cuda", generator=gen)).bfloat16()
    teacher = (0.1 * torch.randn(32003, 256, device="cuda", generator=gen)).bfloat16()
    data = _on_gpu(make_batch(batch=4, time=33, vocab=32003, seed=6))
    rows = {k: v for k, v in data.items() if k != "logits"}
    temps = 0.5 + torch.rand(data["labels"].shape, device="cuda")
    results = {}
    for impl in ("torch", "triton"):
        leaves = [hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
        loss = fusedrl.linear_policy_loss(
            *leaves, **rows, config=LossConfig.preset("dapo"), softcap=5.0, backend=impl
        ).loss
        loss = (
            loss
            + fusedrl.linear_distill_loss(
                *leaves,
                hidden,
                teacher,
                data["labels"],
                data["mask"],
                kind="jsd",
                beta=0.3,
                temperature=temps,
                backend=impl,
            ).loss
        )
        results[impl] = (loss, torch.autograd.grad(loss, leaves))
    (ref, ref_grads), (ours, grads) = results["torch"], results["triton"]
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-3)
    for got, want in zip(grads, ref_grads):
        err = (got.float() - want.float()).norm() / want.float().norm()
        assert err < 2e-2, err


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("vocab", [32000, 151936, 262144])
@pytest.mark.parametrize("preset", ["dapo", "grpo", "cispo"])
def test_split_row_kernel_with_its_exchange(preset, vocab, inplace, monkeypatch):
    """The split-row kernel as a GPU runs it (kernels/split_rows.py: the group barrier, the
    ring of partials over many rows per group, the cooperative launch) against the reference:
    masked rows, a label far below the row's max (the exact second round), the entropy bonus.
    The CPU tests cannot run the barrier (the interpreter runs programs one by one)."""
    from fusedrl.kernels import split_rows

    monkeypatch.setattr(split_rows, "POLICY", "on")
    ran = []
    launch = split_rows.split_row_loss

    def spy(*args, **kwargs):
        out = launch(*args, **kwargs)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(split_rows, "split_row_loss", spy)
    data = _on_gpu(make_batch(batch=8, time=130, vocab=vocab, dtype=torch.bfloat16, seed=11))
    data["logits"][0, 0, data["labels"][0, 0]] = -120.0  # sums relative to the label overflow
    cfg = LossConfig.preset(preset).replace(entropy_coef=0.01)
    ref, ref_grad = run_loss(reference.policy_loss, data, cfg, return_entropy=True)
    logits = (data["logits"].clone() if inplace else data["logits"]).detach().requires_grad_(True)
    args = {k: v for k, v in data.items() if k != "logits"}
    out = fusedrl.policy_loss(
        logits, config=cfg, inplace=inplace, backend="triton", return_entropy=True, **args
    )
    (grad,) = torch.autograd.grad(out.loss, logits)
    assert ran == [True], split_rows._NOT_CO_RESIDENT
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.logp, ref.logp, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out.entropy, ref.entropy, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=1e-6, rtol=2e-2)
    for key, value in ref.metrics.items():
        torch.testing.assert_close(out.metrics[key], value, atol=1e-5, rtol=1e-4, msg=key)


def test_split_row_kernel_falls_back_when_not_co_resident(monkeypatch):
    """A grid that cannot be co-resident (here: the occupancy says none fit) runs the two-sweep
    kernel instead of spinning: the same loss."""
    from fusedrl.kernels import split_rows

    monkeypatch.setattr(split_rows, "POLICY", "on")
    monkeypatch.setattr(split_rows, "resident_per_sm", lambda *a, **k: 0)
    monkeypatch.setattr(split_rows, "_NOT_CO_RESIDENT", {})
    monkeypatch.setattr(split_rows, "_RESOURCES", {})
    data = _on_gpu(make_batch(batch=2, time=33, vocab=151936, dtype=torch.bfloat16, seed=12))
    cfg = LossConfig.preset("dapo")
    ours, grad = run_loss(_impl("triton"), data, cfg)
    ref, ref_grad = run_loss(reference.policy_loss, data, cfg)
    assert split_rows._NOT_CO_RESIDENT, "the split kernel should have declined"
    torch.testing.assert_close(ours.loss, ref.loss, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=1e-6, rtol=2e-2)


@pytest.mark.parametrize("case", ["dapo", "gspo", "grpo", "sequence IS"])
@FUSED
def test_packed_sequences_compiled(case, backend):
    """policy_loss(cu_seqlens=) on CUDA equals the padded call (tests/test_packed.py's batch,
    the compiled kernels), and with max_seqlen given it reads nothing on the host."""
    from .test_packed import CASES, LENGTHS, _batch

    cfg, options = CASES[case]
    rollout = options.get("rollout", False)
    data = _batch(seed=options.get("seed", 4))
    padded, packed = _on_gpu(data["padded"]), _on_gpu(data["packed"])
    if not rollout:
        del padded["rollout_logp"], packed["rollout_logp"]
    cu_seqlens, inside = data["cu_seqlens"].cuda(), data["inside"].cuda()
    want, want_grad = run_loss(_impl(backend), padded, cfg, return_entropy=True)
    keywords = dict(cu_seqlens=cu_seqlens, max_seqlen=max(LENGTHS), return_entropy=True)
    got, grad = run_loss(_impl(backend), packed, cfg, **keywords)  # (compiles, warms up)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad[inside], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.logp, want.logp[inside], atol=1e-5, rtol=1e-5)
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_loss(_impl(backend), packed, cfg, **keywords)
    finally:
        torch.cuda.set_sync_debug_mode("default")
