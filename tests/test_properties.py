"""Property tests: random configs and shapes, each backend == reference (hypothesis).

The torch backend at 150 examples; the Triton backend (interpreted on CPU, so slower) at fewer,
smaller ones, with inplace and a [B, P+T, V] slice drawn too, and tiles small enough that rows
span several tiles and a remainder.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import fusedrl
from fusedrl import LossConfig, reference
from fusedrl.config import AGGS, KL_ESTIMATORS

from .conftest import make_batch, needs_interpreter, run_loss


@st.composite
def configs(draw):
    loss = draw(st.sampled_from(["ppo", "cispo", "sapo", "gmpo", "dcpo", "pg"]))
    ratio_level = "sequence" if loss == "ppo" and draw(st.booleans()) else "token"
    kwargs = dict(loss=loss, ratio_level=ratio_level)
    if loss != "gmpo":
        kwargs["agg"] = draw(st.sampled_from(AGGS))
    if loss in ("ppo", "cispo", "dcpo", "gmpo"):
        kwargs["eps_low"] = draw(st.floats(0.01, 0.5))
        kwargs["eps_high"] = draw(st.floats(0.01, 0.5))
    if loss == "ppo" and draw(st.booleans()):
        kwargs["dual_clip_c"] = draw(st.floats(1.1, 4.0))
    if draw(st.booleans()):
        kwargs["kl"] = draw(st.sampled_from(KL_ESTIMATORS))  # kl="full": test_full_kl.py
        kwargs["beta"] = draw(st.floats(0.0, 0.5))
    if draw(st.booleans()):
        kwargs["entropy_coef"] = draw(st.floats(-0.1, 0.1))
    kwargs["temperature"] = draw(st.sampled_from([1.0, 0.7, 1.3]))
    modes = ["sequence_truncate", "sequence_mask"]
    if loss != "gmpo":
        modes += ["token_truncate", "token_mask"]
    if draw(st.booleans()):
        kwargs["is_correction"] = draw(st.sampled_from(modes))
        kwargs["is_cap"] = draw(st.floats(1.05, 3.0))
    return LossConfig(**kwargs)


def _metric_atol(key: str) -> float:
    # chi-square means exp(2 log rho) - 1 over tokens: logp's last-bit differences (~1e-6) come
    # back multiplied by 2 rho^2 (up to ~e^2 on these inputs) in a value that can be near 0.
    return 2e-5 if key.startswith("mismatch_chi2") else 1e-6


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cfg=configs(),
    batch=st.integers(1, 4),
    time=st.integers(1, 6),
    vocab=st.sampled_from([2, 3, 17, 131]),
    seed=st.integers(0, 2**16),
    per_token_adv=st.booleans(),
    normalize=st.booleans(),
)
def test_torch_backend_equals_reference(cfg, batch, time, vocab, seed, per_token_adv, normalize):
    data = make_batch(
        batch=batch,
        time=time,
        vocab=vocab,
        seed=seed,
        per_token_adv=per_token_adv,
        empty_rows=(seed % 3,),
    )
    extra = {"normalizer": 5.0} if normalize else {}
    ours, grad = run_loss(fusedrl.policy_loss, data, cfg, **extra)
    ref, ref_grad = run_loss(reference.policy_loss, data, cfg, **extra)
    # The loss sums up to 24 terms of size |A logp| ~ 10 whose signs cancel: fp32 rounding of each
    # (6e-8 relative) leaves up to ~1e-5 in absolute terms, whatever the loss's own size.
    torch.testing.assert_close(ours.loss, ref.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-5)
    for key in ref.metrics:
        torch.testing.assert_close(
            ours.metrics[key], ref.metrics[key], atol=_metric_atol(key), rtol=1e-5, msg=key
        )


@needs_interpreter
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cfg=configs(),
    batch=st.integers(1, 3),
    time=st.integers(1, 5),
    vocab=st.sampled_from([2, 17, 131, 257]),
    seed=st.integers(0, 2**16),
    per_token_adv=st.booleans(),
    normalize=st.booleans(),
    inplace=st.booleans(),
    prompt=st.integers(0, 3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
# Found by hypothesis (2026-11-26): a coefficient below fp32's normal range made Triton type the
# scalar fp64, and the bf16 gradient came out 0 (fused_backend.kernel_float).
@example(
    cfg=LossConfig(loss="ppo", eps_low=0.5, eps_high=0.5, entropy_coef=2.2250738585072014e-308),
    batch=1,
    time=1,
    vocab=2,
    seed=1,
    per_token_adv=False,
    normalize=False,
    inplace=False,
    prompt=0,
    dtype=torch.bfloat16,
)
# Found by hypothesis (2026-11-28): the same coefficient on the two-pass path, where the terms
# kernel (which takes it as 0) wrote no d(loss)/d(H) and the driver handed an empty one on.
@example(
    cfg=LossConfig(loss="ppo", ratio_level="sequence", entropy_coef=2.2250738585072014e-308),
    batch=2,
    time=3,
    vocab=17,
    seed=1,
    per_token_adv=False,
    normalize=False,
    inplace=False,
    prompt=0,
    dtype=torch.float32,
)
def test_triton_backend_equals_reference(
    cfg, batch, time, vocab, seed, per_token_adv, normalize, inplace, prompt, dtype
):
    from fusedrl.kernels import launch

    data = make_batch(
        batch=batch,
        time=time,
        vocab=vocab,
        seed=seed,
        per_token_adv=per_token_adv,
        empty_rows=(seed % 3,),
        dtype=dtype,
    )
    if prompt:  # the completion slice of [B, P + T, V] logits, as a trainer passes them
        full = torch.randn(batch, prompt + time, vocab).to(dtype)
        full[:, prompt:] = data["logits"]
        data["logits"] = full[:, prompt:]
    extra = {"normalizer": 5.0} if normalize else {}
    args = {k: v for k, v in data.items() if k != "logits"}
    ref_logits = data["logits"].detach().double().requires_grad_(True)
    ref = reference.policy_loss(ref_logits, config=cfg, **args, **extra)
    (ref_grad,) = torch.autograd.grad(ref.loss, ref_logits)
    logits = (data["logits"].clone() if inplace else data["logits"]).detach().requires_grad_(True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launch, "MAX_BLOCK_V_INTERPRETED", 64)
        ours = fusedrl.policy_loss(
            logits, config=cfg, backend="triton", inplace=inplace, **args, **extra
        )
        (grad,) = torch.autograd.grad(ours.loss, logits)
    torch.testing.assert_close(ours.loss.double(), ref.loss, atol=1e-5, rtol=1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(grad.double(), ref_grad, atol=1e-6, rtol=1e-5)
    else:  # one bf16 rounding per element (truncation under the interpreter), plus fp32 noise
        tolerance = torch.finfo(torch.bfloat16).eps * ref_grad.abs() + 1e-6
        assert ((grad.double() - ref_grad).abs() <= tolerance).all()
    for key in ref.metrics:
        torch.testing.assert_close(
            ours.metrics[key].double(), ref.metrics[key].double(), atol=1e-5, rtol=1e-5, msg=key
        )
