"""The LM-head loss against fusedrl.reference on the materialised logits hidden @ W.T + b.

Every preset and option, its gradients w.r.t. hidden, weight and bias, float64 gradcheck, strided
and flat hidden states, masked and empty rows, bf16 against the float64 truth, and bad input. The
Triton kernels run through the interpreter (TRITON_INTERPRET=1, set in conftest).
"""

from __future__ import annotations

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, linear_torch, linear_triton, reference, row_blocks, torch_backend

from .conftest import ALL_PRESETS, needs_interpreter, numeric_gradient
from .test_backends import OPTIONS

# The Triton backend in both designs (linear_triton.DESIGNS): cuBLAS logits chunks, and tiles on
# chip.
BACKENDS = [
    "torch",
    pytest.param("triton:gemm", marks=needs_interpreter),
    pytest.param("triton:on-chip", marks=needs_interpreter),
]
ATOL = RTOL = 1e-5


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """The backend's name; every call sweeps several row blocks / chunks and a partial last one."""
    name, _, design = request.param.partition(":")
    if name == "torch":
        monkeypatch.setattr(row_blocks, "BLOCK_ELEMENTS", 5 * 1031)
    else:
        monkeypatch.setenv(linear_triton.DESIGN_ENV, design)
        monkeypatch.setattr(linear_triton, "GRAD_CHUNK_BYTES", 5 * 1031 * 4)
    return name


def make_linear_batch(
    batch=3,
    time=7,
    hidden=24,
    vocab=1031,
    dtype=torch.float32,
    seed=0,
    per_token_adv=False,
    bias=True,
    empty_rows=(1,),
    old_noise=0.3,
):
    """Random hidden states and LM head with ragged lengths and an empty sequence; old/ref/rollout
    log-probs near the current ones so that ratios straddle every clip bound."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, time, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * (2.0 / hidden**0.5)
    b = torch.randn(vocab, generator=gen) if bias else None
    labels = torch.randint(0, vocab, (batch, time), generator=gen)
    lengths = torch.randint(1, time + 1, (batch,), generator=gen)
    mask = torch.arange(time)[None, :] < lengths[:, None]
    for row in empty_rows:
        if row < batch:
            mask[row] = False
    shape = (batch, time) if per_token_adv else (batch,)
    adv = torch.randn(*shape, generator=gen)
    with torch.no_grad():
        logp, _ = reference.token_logprobs(torch.nn.functional.linear(h, w, b), labels)
    old = logp + old_noise * torch.randn(batch, time, generator=gen)
    return dict(
        hidden=h.to(dtype),
        weight=w.to(dtype),
        bias=None if b is None else b.to(dtype),
        labels=labels,
        advantages=adv,
        mask=mask,
        old_logp=old,
        ref_logp=logp + 0.2 * torch.randn(batch, time, generator=gen),
        rollout_logp=old + 0.3 * torch.randn(batch, time, generator=gen),
    )


def _leaves(data, dtype=None):
    out = []
    for key in ("hidden", "weight", "bias"):
        t = data[key]
        if t is not None:
            t = t.detach().to(dtype or t.dtype).requires_grad_(True)
        out.append(t)
    return out


def _rows(data):
    return {k: v for k, v in data.items() if k not in ("hidden", "weight", "bias")}


def run_linear(data, cfg, backend, **kwargs):
    """(out, [d hidden, d weight, d bias]) of fusedrl.linear_policy_loss."""
    h, w, b = _leaves(data)
    out = fusedrl.linear_policy_loss(
        h, w, config=cfg, bias=b, backend=backend, return_entropy=True, **_rows(data), **kwargs
    )
    leaves = [t for t in (h, w, b) if t is not None]
    grads = torch.autograd.grad(out.loss, leaves)
    return out, list(grads)


def run_reference(data, cfg, dtype=None, **kwargs):
    """The oracle on the materialised logits, differentiated through F.linear by autograd."""
    h, w, b = _leaves(data, dtype)
    logits = torch.nn.functional.linear(h, w, b)
    out = reference.policy_loss(logits, config=cfg, return_entropy=True, **_rows(data), **kwargs)
    leaves = [t for t in (h, w, b) if t is not None]
    return out, list(torch.autograd.grad(out.loss, leaves))


def assert_matches_reference(data, cfg, backend, **kwargs):
    ours, grads = run_linear(data, cfg, backend, **kwargs)
    ref, ref_grads = run_reference(data, cfg, **kwargs)
    torch.testing.assert_close(ours.loss, ref.loss, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ours.logp, ref.logp, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ours.entropy, ref.entropy, atol=ATOL, rtol=RTOL)
    for name, g, rg in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert g.dtype == rg.dtype and g.shape == rg.shape, name
        torch.testing.assert_close(g, rg, atol=ATOL, rtol=RTOL, msg=name)
    # a comparison of gradients that are all 0 (every token clipped or masked) proves nothing
    counted = bool(data["mask"].any())
    assert counted <= any(float(torch.nan_to_num(g).abs().sum()) > 0 for g in ref_grads), cfg
    assert set(ours.metrics) == set(ref.metrics)
    for key, value in ref.metrics.items():
        torch.testing.assert_close(ours.metrics[key], value, atol=ATOL, rtol=RTOL, msg=key)
    return ours, ref


@pytest.mark.parametrize("name", ALL_PRESETS)
def test_every_preset_fp32(name, backend):
    data = make_linear_batch(
        batch=4, time=9, seed=3, per_token_adv=name == "gspo_token", old_noise=0.5
    )
    ours, _ = assert_matches_reference(data, LossConfig.preset(name), backend)
    loss = LossConfig.preset(name).loss
    if loss == "vespo":  # no clip: a smooth weight of the sequence ratio, which acted
        assert 0 < ours.metrics["vespo_phi_mean"] != 1
    elif loss != "pg":  # the clip branches acted
        assert ours.metrics["clip_low"] > 0 or ours.metrics["clip_high"] > 0


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_options_fp32(name, backend):
    data = make_linear_batch(batch=4, time=6, vocab=523, seed=4, per_token_adv=True)
    assert_matches_reference(data, OPTIONS[name], backend)


@pytest.mark.parametrize("name", ["dapo", "gspo", "dcpo"])
def test_on_policy_and_normalizer(name, backend):
    data = make_linear_batch(seed=5)
    data["old_logp"] = None
    cfg = LossConfig.preset(name).replace(is_correction="token_truncate", is_cap=1.5)
    assert_matches_reference(data, cfg, backend, normalizer=17.0)


def test_precomputed_is_weights(backend):
    data = make_linear_batch(seed=6)
    weights = torch.rand(3, 7, generator=torch.Generator().manual_seed(1)) + 0.5
    assert_matches_reference(data, LossConfig.preset("dapo"), backend, is_weights=weights)


def test_without_bias_and_frozen_head(backend):
    data = make_linear_batch(seed=7, bias=False)
    assert_matches_reference(data, LossConfig.preset("grpo"), backend)
    # A frozen head: only d hidden is computed and returned.
    h = data["hidden"].clone().requires_grad_(True)
    out = fusedrl.linear_policy_loss(h, data["weight"], **_rows(data), backend=backend)
    (grad,) = torch.autograd.grad(out.loss, h)
    assert grad.shape == h.shape and grad.abs().sum() > 0


@pytest.mark.parametrize("name", ["dapo", "gspo", "gmpo", "sapo"])
def test_gradient_against_finite_differences_float64(name):
    """The torch backend keeps fp64 in fp64, so its analytic gradients of hidden, weight and bias
    can be checked against central differences of the whole loss (gradcheck itself runs backward
    twice through one graph, which the fused losses refuse)."""
    data = make_linear_batch(batch=2, time=3, hidden=5, vocab=11, seed=8, dtype=torch.float64)
    cfg = LossConfig.preset(name).replace(entropy_coef=0.05, temperature=0.7)
    rows = _rows(data)

    def loss(h, w, b):
        return fusedrl.linear_policy_loss(h, w, config=cfg, bias=b, backend="torch", **rows).loss

    leaves = _leaves(data)
    analytic = torch.autograd.grad(loss(*leaves), leaves)
    with torch.no_grad():
        numeric = numeric_gradient(loss, [t.detach().clone() for t in leaves])
    for a, n in zip(analytic, numeric):
        assert a.dtype == torch.float64 and n.abs().max() > 0
        torch.testing.assert_close(a, n, atol=1e-7, rtol=1e-5)


def test_token_logprobs_and_their_gradients(backend):
    data = make_linear_batch(seed=9)
    h, w, b = _leaves(data)
    logp, ent = fusedrl.linear_token_logprobs(
        h, w, data["labels"], temperature=0.8, return_entropy=True, bias=b, backend=backend
    )
    coef = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((coef[0] * logp + coef[1] * ent).sum(), (h, w, b))
    rh, rw, rb = _leaves(data)
    rlogp, rent = reference.token_logprobs(
        torch.nn.functional.linear(rh, rw, rb),
        data["labels"],
        temperature=0.8,
        return_entropy=True,
    )
    ref_grads = torch.autograd.grad((coef[0] * rlogp + coef[1] * rent).sum(), (rh, rw, rb))
    torch.testing.assert_close(logp, rlogp, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ent, rent, atol=ATOL, rtol=RTOL)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, atol=ATOL, rtol=RTOL)
    with torch.no_grad():
        nograd, none = fusedrl.linear_token_logprobs(h, w, data["labels"], bias=b, backend=backend)
    assert none is None and not nograd.requires_grad


def test_strided_and_flat_hidden(backend):
    """hidden[:, P - 1 : -1] of a model body is used as a view; [N, H] is one packed row."""
    data = make_linear_batch(seed=10)
    full = torch.randn(3, 11, 24)
    full[:, 2:9] = data["hidden"]
    strided = dict(data, hidden=full[:, 2:9])
    assert not strided["hidden"].is_contiguous()
    assert_matches_reference(strided, LossConfig.preset("grpo"), backend)
    flat = make_linear_batch(seed=11)
    flat.update(
        {k: flat[k].reshape(-1, *flat[k].shape[2:]) for k in ("hidden", "labels", "mask")},
        advantages=flat["advantages"][:, None].expand(3, 7).reshape(-1),
        **{k: flat[k].reshape(-1) for k in ("old_logp", "ref_logp", "rollout_logp")},
    )
    ours, _ = assert_matches_reference(flat, LossConfig.preset("dapo"), backend)
    assert ours.logp.shape == (21,)


def test_all_masked_is_zero_and_nan_padding_does_not_leak(backend):
    data = make_linear_batch(seed=12)
    data["mask"] = torch.zeros_like(data["mask"])
    out, grads = run_linear(data, LossConfig.preset("grpo"), backend)
    assert out.loss == 0 and all((g == 0).all() for g in grads)
    padded = make_linear_batch(seed=13)
    padded["hidden"][~padded["mask"]] = float("nan")
    out, grads = run_linear(padded, LossConfig.preset("dapo"), backend)
    assert torch.isfinite(out.loss) and all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][~padded["mask"]] == 0).all()


@pytest.mark.parametrize("name", ["dapo", "gspo"])
def test_bf16_against_the_float64_truth(name, backend):
    """bf16 hidden and head: loss and gradients near the float64 truth of the same bf16 values."""
    data = make_linear_batch(seed=14, dtype=torch.bfloat16)
    cfg = LossConfig.preset(name).replace(entropy_coef=0.01)
    ours, grads = run_linear(data, cfg, backend)
    truth, truth_grads = run_reference(data, cfg, dtype=torch.float64)
    # The logits are rounded to bf16 at most once (torch, gemm) or kept in fp32 (on-chip).
    torch.testing.assert_close(ours.loss.double(), truth.loss, atol=2e-2, rtol=2e-2)
    for g, tg in zip(grads, truth_grads):
        assert g.dtype == torch.bfloat16
        rel = (g.double() - tg).norm() / tg.norm()
        assert rel < 2e-2, float(rel)


def test_bad_inputs_name_the_argument():
    data = make_linear_batch(seed=15)
    rows = _rows(data)
    h, w = data["hidden"], data["weight"]
    with pytest.raises(ValueError, match="weight must be \\[V, H\\] with H = 24"):
        fusedrl.linear_policy_loss(h, w[:, :5], **rows)
    with pytest.raises(TypeError, match="weight dtype torch.bfloat16 must equal"):
        fusedrl.linear_policy_loss(h, w.bfloat16(), **rows)
    with pytest.raises(ValueError, match="bias shape \\(5,\\) must be \\(1031,\\)"):
        fusedrl.linear_policy_loss(h, w, bias=torch.zeros(5), **rows)
    with pytest.raises(ValueError, match="labels must be in \\[0, 1031\\)"):
        fusedrl.linear_policy_loss(h, w, **dict(rows, labels=rows["labels"] + 1031))
    with pytest.raises(ValueError, match="hidden must be \\[B, T, H\\] or \\[N, H\\]"):
        fusedrl.linear_policy_loss(h[0, 0], w, **rows)
    with pytest.raises(ValueError, match="backend='cuda' is not one of"):
        fusedrl.linear_policy_loss(h, w, **rows, backend="cuda")
    with pytest.raises(ValueError, match="labels shape .* does not match hidden shape"):
        fusedrl.linear_token_logprobs(h, w, rows["labels"][:, :3])
    # a transposed [H, V] head: named as the head's shape, before the labels meet its rows
    transposed = "weight must be \\[V, H\\] .* got shape \\(24, 1031\\) \\(a transposed"
    with pytest.raises(ValueError, match=transposed):
        fusedrl.linear_policy_loss(h, w.T, **rows)
    with pytest.raises(ValueError, match=transposed):
        fusedrl.linear_token_logprobs(h, w.T, rows["labels"])


def test_torch_backend_sweeps_token_level_once_and_sequence_level_twice(monkeypatch):
    """One GEMM of the logits per block for token-level losses, two for sequence-level ones."""
    calls = []
    real = linear_torch.sweep

    def counted(lin, labels, temperature, need_entropy, derivatives=None, want=(False,) * 3, **kw):
        calls.append(derivatives is not None)
        return real(lin, labels, temperature, need_entropy, derivatives, want, **kw)

    monkeypatch.setattr(linear_torch, "sweep", counted)
    data = make_linear_batch(seed=16)
    run_linear(data, LossConfig.preset("dapo"), "torch")
    assert calls == [True]
    calls.clear()
    run_linear(data, LossConfig.preset("gspo"), "torch")
    assert calls == [False, True]


@needs_interpreter
def test_triton_gemm_design_makes_the_logits_once_for_token_level_losses(monkeypatch):
    """The "gemm" design: one sweep of cuBLAS logits chunks for token-level losses (6·N·H·V
    flops), two for sequence-level ones; chunks of a few rows, so that each sweep has several."""
    monkeypatch.setenv(linear_triton.DESIGN_ENV, "gemm")
    monkeypatch.setattr(linear_triton, "GRAD_CHUNK_BYTES", 8 * 1031 * 4)
    sweeps = []
    real = linear_triton._logits_chunks

    def counted(lin, rows, temperature, *args):
        sweeps.append(0)
        for chunk in real(lin, rows, temperature, *args):
            sweeps[-1] += 1
            yield chunk

    monkeypatch.setattr(linear_triton, "_logits_chunks", counted)
    data = make_linear_batch(seed=17)  # 21 rows: chunks of 8, 8 and 5
    run_linear(data, LossConfig.preset("dapo"), "triton")
    assert sweeps == [3]
    sweeps.clear()
    run_linear(data, LossConfig.preset("gspo"), "triton")
    assert sweeps == [3, 3]
    sweeps.clear()
    with torch.no_grad():
        h, w, labels = data["hidden"], data["weight"], data["labels"]
        fusedrl.linear_token_logprobs(h, w, labels, backend="triton")
    assert sweeps == [3]


@needs_interpreter
def test_unknown_triton_design_is_named(monkeypatch):
    monkeypatch.setenv(linear_triton.DESIGN_ENV, "tiles")
    data = make_linear_batch(seed=18)
    with pytest.raises(ValueError, match="FUSEDRL_LINEAR_DESIGN='tiles' is not one of"):
        run_linear(data, LossConfig.preset("dapo"), "triton")


# ------------------------------------------------------------------------------ sampling masks
# (temperature, top_k, top_p, min_p), replayed from the config (the reference masks the whole
# logits with vLLM's rules; the backends a block / chunk of rows at a time).
SAMPLING = {
    "top_k": (1.0, 7, None, None),
    "top_p": (0.7, None, 0.8, None),
    "all": (0.8, 20, 0.9, 0.05),
}


def _sampled_batch(seed):
    """Half the labels at the top of their rows (inside every filter's set), half anywhere
    (mostly outside it: kept as the sampled label)."""
    data = make_linear_batch(seed=seed)
    with torch.no_grad():
        logits = torch.nn.functional.linear(data["hidden"], data["weight"], data["bias"])
    data["labels"][:, ::2] = logits.argmax(-1)[:, ::2]
    return data


def _on_chip() -> bool:
    import os

    return os.environ.get(linear_triton.DESIGN_ENV) == "on-chip"


@pytest.mark.parametrize("filters", sorted(SAMPLING))
@pytest.mark.parametrize("preset", ["dapo", "gspo"])
def test_sampling_mask_replay(preset, filters, backend):
    temperature, top_k, top_p, min_p = SAMPLING[filters]
    cfg = LossConfig.preset(preset).replace(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
    )
    data = _sampled_batch(seed=21)
    if preset == "gspo":  # on-policy: the batch's old log-probs are of other labels, and GSPO's
        data["old_logp"] = None  # 3e-4 / 4e-4 bounds would clip every sequence (no gradient)
    if _on_chip():
        with pytest.raises(ValueError, match="on-chip does not replay sampling masks"):
            run_linear(data, cfg, backend)
        return
    ours, _ = assert_matches_reference(data, cfg, backend)
    unmasked, _ = run_reference(data, cfg.replace(top_k=None, top_p=None, min_p=None))
    valid = data["mask"]
    assert (ours.logp[valid] > unmasked.logp[valid]).all()  # every row lost some mass


def test_token_logprobs_replay_sampling_masks(backend):
    data = _sampled_batch(seed=22)
    kwargs = dict(top_k=20, top_p=0.9, min_p=0.05)
    h, w, b = _leaves(data)
    if _on_chip():
        with pytest.raises(ValueError, match="on-chip does not replay sampling masks"):
            fusedrl.linear_token_logprobs(h, w, data["labels"], bias=b, backend=backend, **kwargs)
        return
    logp, ent = fusedrl.linear_token_logprobs(
        h, w, data["labels"], 0.8, True, bias=b, backend=backend, **kwargs
    )
    grads = torch.autograd.grad((logp + 0.3 * ent).sum(), (h, w, b))
    rh, rw, rb = _leaves(data)
    rlogp, rent = reference.token_logprobs(
        torch.nn.functional.linear(rh, rw, rb), data["labels"], 0.8, True, **kwargs
    )
    ref_grads = torch.autograd.grad((rlogp + 0.3 * rent).sum(), (rh, rw, rb))
    torch.testing.assert_close(logp, rlogp, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ent, rent, atol=ATOL, rtol=RTOL)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, atol=ATOL, rtol=RTOL)
    with torch.no_grad():
        nograd, _ = fusedrl.linear_token_logprobs(
            h, w, data["labels"], 0.8, bias=b, backend=backend, **kwargs
        )
    torch.testing.assert_close(nograd, rlogp.detach(), atol=ATOL, rtol=RTOL)
    with pytest.raises(ValueError, match="top_k must be an int >= 1"):
        fusedrl.linear_token_logprobs(h, w, data["labels"], top_k=-3, backend=backend)


def test_torch_backend_finds_each_sampling_floor_once(monkeypatch):
    """Sequence-level losses sweep twice and token_logprobs' backward sweeps again: the floors of
    the first sweep serve the second (top_p alone sorts every row)."""
    calls = []
    real = torch_backend.sampling_floor
    monkeypatch.setattr(
        torch_backend, "sampling_floor", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    monkeypatch.setattr(row_blocks, "BLOCK_ELEMENTS", 8 * 1031)  # 21 rows: 3 blocks
    data = _sampled_batch(seed=23)
    cfg = LossConfig.preset("gspo").replace(top_p=0.8)
    run_linear(data, cfg, "torch")
    assert calls == [8, 8, 5]
    calls.clear()
    h, w, b = _leaves(data)
    logp, _ = fusedrl.linear_token_logprobs(h, w, data["labels"], bias=b, top_p=0.8)
    logp.sum().backward()
    assert calls == [8, 8, 5]
