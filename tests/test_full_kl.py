"""The exact KL over the vocabulary (LossConfig.kl="full" / "full_reverse", `ref_logits=`).

The oracle (`fusedrl.reference.exact_kl`) is checked against the definition on a hand-sized row
and by float64 gradcheck; the backends (torch; Triton's two-row kernels, interpreted) against the
oracle on branch-triggering batches (ragged and
empty sequences, NaN padding, every aggregation, temperatures, in place, [N, V] input, bf16
against the float64 truth); then the contracts: beta = 0 is a metric only, an all-masked batch
gives 0, and every misuse raises naming the argument.
"""

from __future__ import annotations

import math

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, reference

from .conftest import BACKENDS, make_batch, needs_interpreter

KINDS = ("full", "full_reverse")


def _batch(seed=0, batch=3, time=7, vocab=131, dtype=torch.float32, **kwargs):
    data = make_batch(batch=batch, time=time, vocab=vocab, dtype=dtype, seed=seed, **kwargs)
    gen = torch.Generator().manual_seed(seed + 100)
    # The reference policy: the policy's logits moved by noise, so that the KL is neither ~0
    # nor dominated by a few tokens.
    noise = torch.randn(data["logits"].shape, generator=gen)
    data["ref_logits"] = (data["logits"].float() + 0.8 * noise).to(dtype)
    del data["ref_logp"]
    return data


def _run(fn, data, cfg, **kwargs):
    logits = data["logits"].clone().requires_grad_(True)
    args = {k: v for k, v in data.items() if k != "logits"}
    out = fn(logits, **args, config=cfg, **kwargs)
    (grad,) = torch.autograd.grad(out.loss, logits)
    return out, grad


def test_oracle_is_the_definition_on_one_row():
    logits = torch.tensor([[[2.0, 0.0, -1.0, 0.5]]], dtype=torch.float64)
    ref_logits = torch.tensor([[[0.0, 1.0, -1.0, 3.0]]], dtype=torch.float64)
    temperature = 0.8
    p = torch.softmax(logits[0, 0] / temperature, -1).tolist()
    q = torch.softmax(ref_logits[0, 0] / temperature, -1).tolist()
    forward = sum(a * math.log(a / b) for a, b in zip(p, q))
    backward = sum(b * math.log(b / a) for a, b in zip(p, q))
    got = reference.exact_kl(logits, ref_logits, temperature, "full")
    assert got.item() == pytest.approx(forward, rel=1e-12)
    got = reference.exact_kl(logits, ref_logits, temperature, "full_reverse")
    assert got.item() == pytest.approx(backward, rel=1e-12)
    assert forward != pytest.approx(backward, rel=1e-3)  # the two directions differ here
    # The form trainers that have a "full" KL write: kl_div(input=log q, target=log p).
    log_p = torch.log_softmax(logits / temperature, -1)
    log_q = torch.log_softmax(ref_logits / temperature, -1)
    kl_div = torch.nn.functional.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)
    assert kl_div.item() == pytest.approx(forward, rel=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_oracle_gradcheck_and_closed_form(kind):
    """float64 gradcheck, and its gradient equal to the closed form the backends implement:
    p (log p - log q - KL) / T (forward), (p - q) / T (reverse)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 11, dtype=torch.float64, generator=gen, requires_grad=True)
    ref_logits = torch.randn(2, 3, 11, dtype=torch.float64, generator=gen)
    temperature = 1.3

    def kl(x):
        return reference.exact_kl(x, ref_logits, temperature, kind)

    assert torch.autograd.gradcheck(kl, (logits,))
    weights = torch.randn(2, 3, dtype=torch.float64, generator=gen)
    (grad,) = torch.autograd.grad((kl(logits) * weights).sum(), logits)
    log_p = torch.log_softmax(logits.detach() / temperature, -1)
    log_q = torch.log_softmax(ref_logits / temperature, -1)
    if kind == "full":
        value = (log_p.exp() * (log_p - log_q)).sum(-1, keepdim=True)
        closed = log_p.exp() * (log_p - log_q - value)
    else:
        closed = log_p.exp() - log_q.exp()
    torch.testing.assert_close(grad, weights[..., None] * closed / temperature)


def test_oracle_zero_probabilities_add_nothing():
    """A token the policy cannot emit (-inf logit) adds 0 log 0 = 0 to KL(pi || ref), not NaN;
    the reverse direction is then infinite (the reference puts mass where the policy has none)."""
    logits = torch.tensor([[[1.0, -math.inf, 0.0]]])
    ref_logits = torch.tensor([[[0.0, 0.5, 0.0]]])
    assert torch.isfinite(reference.exact_kl(logits, ref_logits, 1.0, "full")).all()
    assert reference.exact_kl(logits, ref_logits, 1.0, "full_reverse").item() == math.inf


CASES = {
    # (preset, overrides): token-level and sequence-level losses, every aggregation, temperatures
    "dapo": ("dapo", dict(temperature=0.7)),
    "grpo": ("grpo", dict(agg="seq-mean-token-sum")),
    "gspo": ("gspo", dict(entropy_coef=0.01)),
    "dr_grpo": ("dr_grpo", dict(temperature=1.3)),
    "seq-mean-token-mean": ("dapo", dict(agg="seq-mean-token-mean")),
}


# The torch backend's blocks; the two-row Triton kernels (interpreted, tiles of 128: the test
# vocabulary of 131 takes a full and a partial one).


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_backend_equals_the_oracle(case, kind, backend):
    preset, overrides = CASES[case]
    cfg = LossConfig.preset(preset, **overrides).replace(kl=kind, beta=0.25)
    data = _batch(seed=len(case))
    ref, ref_grad = _run(reference.policy_loss, data, cfg, return_entropy=True)
    ours, grad = _run(fusedrl.policy_loss, data, cfg, backend=backend, return_entropy=True)
    torch.testing.assert_close(ours.logp, ref.logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.entropy, ref.entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.loss, ref.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours.metrics["kl"], ref.metrics["kl"], atol=1e-6, rtol=1e-5)
    # The term acted: a positive KL, and a gradient that differs from the loss without it.
    assert ours.metrics["kl"] > 0.05
    _, plain_grad = _run(reference.policy_loss, data, cfg.replace(beta=0.0))
    assert (grad - plain_grad).abs().max() > 1e-4
    # Masked tokens (the empty sequence, ragged tails) get no gradient.
    assert (grad[~data["mask"]] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_in_place_flat_input_and_nan_padding(kind, backend, monkeypatch):
    """In place (the gradient written over the logits, the reference's logits read beside them),
    [N, V] input, NaN in masked positions of both logits, and blocks of a few rows (a block
    boundary inside a sequence)."""
    from fusedrl import row_blocks

    monkeypatch.setattr(row_blocks, "BLOCK_ELEMENTS", 4 * 131)
    cfg = LossConfig.preset("dapo").replace(kl=kind, beta=0.5)
    data = _batch(seed=7, with_nan_padding=True)
    data["ref_logits"][~data["mask"]] = float("nan")
    ref, ref_grad = _run(reference.policy_loss, data, cfg)
    logits = data["logits"].clone().requires_grad_(True)
    work = logits.clone()
    args = {k: v for k, v in data.items() if k != "logits"}
    out = fusedrl.policy_loss(work, **args, config=cfg, backend=backend, inplace=True)
    (grad,) = torch.autograd.grad(out.loss, logits)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-5)
    assert torch.isfinite(grad).all()

    valid = data["mask"]
    flat = {
        "logits": data["logits"][valid],
        "labels": data["labels"][valid],
        "advantages": data["advantages"][:, None].expand(valid.shape)[valid],
        "mask": torch.ones(int(valid.sum()), dtype=torch.bool),
        "old_logp": data["old_logp"][valid],
        "ref_logits": data["ref_logits"][valid],
    }
    ref_flat, ref_flat_grad = _run(reference.policy_loss, flat, cfg)
    ours_flat, flat_grad = _run(fusedrl.policy_loss, flat, cfg, backend=backend)
    torch.testing.assert_close(ours_flat.loss, ref_flat.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flat_grad, ref_flat_grad, atol=1e-6, rtol=1e-5)
    # token-mean over the same tokens: the packed call is the padded one
    torch.testing.assert_close(ours_flat.loss, ref.loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_against_the_float64_truth(kind, backend):
    cfg = LossConfig.preset("dapo").replace(kl=kind, beta=0.5)
    data = _batch(seed=11, dtype=torch.bfloat16)
    truth = {k: (v.double() if v.is_floating_point() else v) for k, v in data.items()}
    exact, exact_grad = _run(reference.policy_loss, truth, cfg)
    ours, grad = _run(fusedrl.policy_loss, data, cfg, backend=backend)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(ours.loss.double(), exact.loss, atol=2e-5, rtol=2e-5)
    # one bf16 rounding of the gradient (the interpreter rounds toward zero: a whole ulp)
    ulp = 2**-8 if backend == "torch" else 2**-7
    torch.testing.assert_close(grad.double(), exact_grad, atol=1e-6, rtol=ulp)


def test_beta_zero_is_a_metric_and_auto_picks_the_torch_backend():
    cfg = LossConfig.preset("dapo").replace(kl="full")
    data = _batch(seed=5)
    with_metric, grad = _run(fusedrl.policy_loss, data, cfg)  # backend="auto" on CPU
    no_kl = {k: v for k, v in data.items() if k != "ref_logits"}
    plain, plain_grad = _run(fusedrl.policy_loss, no_kl, LossConfig.preset("dapo"))
    torch.testing.assert_close(with_metric.loss, plain.loss, rtol=0, atol=0)
    torch.testing.assert_close(grad, plain_grad, rtol=0, atol=0)
    ref, _ = _run(reference.policy_loss, data, cfg)
    torch.testing.assert_close(with_metric.metrics["kl"], ref.metrics["kl"], atol=1e-6, rtol=1e-5)
    assert with_metric.metrics["kl"] > 0.05


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_all_masked_batch_is_zero_with_zero_gradient(kind, backend):
    cfg = LossConfig.preset("grpo").replace(kl=kind, beta=0.1)
    data = _batch(seed=2)
    data["mask"] = torch.zeros_like(data["mask"])
    out, grad = _run(fusedrl.policy_loss, data, cfg, backend=backend)
    assert out.loss.item() == 0.0 and out.metrics["kl"].item() == 0.0
    assert (grad == 0).all()


def test_the_kl_is_zero_against_itself():
    cfg = LossConfig.preset("dapo").replace(kl="full", beta=1.0)
    data = _batch(seed=4)
    data["ref_logits"] = data["logits"].clone()
    out, _ = _run(fusedrl.policy_loss, data, cfg, backend="torch")
    assert abs(out.metrics["kl"].item()) < 1e-6


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(drop="ref_logits"), ValueError, "ref_logits .* is required when config.kl='full'"),
        (dict(add="ref_logp"), ValueError, "ref_logp is not read when config.kl='full'"),
        (dict(ref_shape=(3, 7, 130)), ValueError, "ref_logits shape .* must equal logits shape"),
        (dict(ref_dtype=torch.int64), TypeError, "ref_logits must be a floating tensor"),
        (dict(kl="k3"), ValueError, "ref_logits is read only by config.kl='full'"),
    ],
)
def test_misuse_is_named(change, error, message):
    data = _batch(seed=1)
    cfg = LossConfig.preset("dapo").replace(kl=change.get("kl", "full"), beta=0.1)
    if "drop" in change:
        del data[change["drop"]]
    if "add" in change:
        data["ref_logp"] = data["old_logp"].clone()
    if "ref_shape" in change:
        data["ref_logits"] = torch.zeros(change["ref_shape"])
    if "ref_dtype" in change:
        data["ref_logits"] = data["ref_logits"].to(change["ref_dtype"])
    if change.get("kl") == "k3":
        data["ref_logp"] = data["old_logp"].clone()
    args = {k: v for k, v in data.items() if k != "logits"}
    with pytest.raises(error, match=message):
        fusedrl.policy_loss(data["logits"], **args, config=cfg, backend="torch")


@needs_interpreter
def test_a_fused_backend_without_the_kernel_refuses_rather_than_drops_the_kl():
    """The CUDA extension has no two-row kernel: its driver says so (run here with the Triton
    ops minus that kernel, as the CUDA backend's ops are)."""
    from dataclasses import replace

    from fusedrl import fused_backend, triton_backend
    from fusedrl._inputs import prepare_loss_inputs

    data = _batch(seed=1)
    cfg = LossConfig.preset("dapo").replace(kl="full", beta=0.1)
    inp = prepare_loss_inputs(
        data["logits"],
        data["labels"],
        data["advantages"],
        data["mask"],
        data["old_logp"],
        None,
        None,
        cfg,
        None,
        ref_logits=data["ref_logits"],
    )
    ops = replace(triton_backend.OPS, two_rows=None)
    with pytest.raises(ValueError, match="has no kernel in this backend"):
        fused_backend.policy_loss(ops, inp, cfg, False, None)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kl="full", beta=0.1, kl_bias_correction=True), "kl_bias_correction"),
        (dict(kl="full_reverse", top_p=0.9), "top_k / top_p / min_p"),
    ],
)
def test_config_refuses_what_the_exact_kl_does_not_mean(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossConfig(**kwargs)


def test_unsupported_paths_say_so():
    """Vocab-sharded logits (tensor parallelism) refuse the exact KL by name (the LM-head form,
    linear_policy_loss(ref_weight=), is tests/test_linear_distill.py's)."""
    data = _batch(seed=1, batch=2, time=3, vocab=17)
    cfg = LossConfig.preset("dapo").replace(kl="full", beta=0.1)
    with pytest.raises(NotImplementedError, match="under tensor parallelism is not supported"):
        fusedrl.policy_loss(**data, config=cfg, vocab_start=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_with_only_an_entropy_gradient(backend):
    """beta = 0 (the KL a metric) and clipped tokens: a row whose only gradient is the entropy
    bonus's must still be written (a kernel that skips rows without a policy or KL gradient
    would leave it zero)."""
    cfg = LossConfig.preset("dapo", entropy_coef=0.05).replace(kl="full")
    data = _batch(seed=8)
    data["old_logp"] = data["old_logp"] - 2.0  # ratios e^2 > 1 + eps_high: clipped where A > 0
    data["advantages"] = data["advantages"].abs()
    ref, ref_grad = _run(reference.policy_loss, data, cfg)
    ours, grad = _run(fusedrl.policy_loss, data, cfg, backend=backend)
    assert ref.metrics["clipfrac"] > 0.5  # the clip acted: those tokens have dlogp = 0
    torch.testing.assert_close(ours.loss, ref.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-7, rtol=1e-5)
    assert grad[data["mask"]].abs().amax(-1).min() > 0  # every counted row has a gradient


# ------------------------------------------------------------------ an infinite KL, one behaviour
def _banning_batch(dtype: torch.dtype, ban: str) -> dict:
    """Row (0, 0): the reference bans a token the policy emits (KL(pi || ref) = +inf); row (0, 1):
    the policy bans a token the reference emits (KL(ref || pi) = +inf); row (2, 0): both at
    once, on a masked token (never counted); the rest finite. `ban`: "-inf", or "lowest" (-finfo.max
    of the dtype, as attention-style masks write it)."""
    data = _batch(seed=6, vocab=67, dtype=dtype)
    value = float("-inf") if ban == "-inf" else -torch.finfo(dtype).max
    logits, ref = data["logits"].clone(), data["ref_logits"].clone()
    ref[0, 0, 5] = value
    logits[0, 1, 9] = value
    data["labels"][0, 1] = 3  # a token the policy emits
    logits[2, 0, 4] = ref[2, 0, 7] = value
    data["mask"][0, :2] = True
    data["mask"][2, 0] = False
    data.update(logits=logits, ref_logits=ref)
    return data


def _distill(logits, labels, mask, ref_logits, config, kind, distill_fn, **kwargs):
    """distill_loss in policy_loss's calling form (the KL direction by `kind`)."""
    return distill_fn(logits, ref_logits, labels, mask, kind=kind, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ban", ["-inf", "lowest"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "form, differentiated_weights",
    [("full", True), ("full_reverse", False), ("reverse_kl", True), ("forward_kl", False)],
)
def test_an_infinite_kl_is_inf_on_every_backend(form, differentiated_weights, dtype, ban, backend):
    """KL = +inf where the weighting distribution emits a token the other bans (-inf or
    -finfo.max alike), on every backend and the oracle: the loss and the metric are +inf. When
    the weighting side is the one differentiated (KL(pi || ref), distillation's reverse KL), the
    row's gradient is NaN (undefined), every element; otherwise it is the exact, finite
    (p - q) / T. Every other row's gradient equals the oracle's, finite."""
    data = _banning_batch(dtype, ban)
    if form.startswith("full"):
        cfg = LossConfig.preset("grpo").replace(kl=form, beta=0.1)
        ours, grad = _run(fusedrl.policy_loss, data, cfg, backend=backend)
        truth, truth_grad = _run(reference.policy_loss, data, cfg)
        metric = "kl"
    else:
        data = {k: data[k] for k in ("logits", "labels", "mask", "ref_logits")}
        ours, grad = _run(
            _distill, data, None, kind=form, distill_fn=fusedrl.distill_loss, backend=backend
        )
        truth, truth_grad = _run(_distill, data, None, kind=form, distill_fn=reference.distill_loss)
        metric = "distill"
    assert ours.loss.item() == truth.loss.item() == math.inf
    assert ours.metrics[metric].item() == truth.metrics[metric].item() == math.inf
    infinite_row = (0, 0) if form in ("full", "reverse_kl") else (0, 1)
    nan_rows = grad.isnan().any(-1)
    assert torch.equal(nan_rows, truth_grad.isnan().any(-1))
    if differentiated_weights:
        assert grad[infinite_row].isnan().all() and nan_rows.sum() == 1
    else:
        assert not nan_rows.any()
        assert torch.isfinite(grad).all()
    keep = ~nan_rows[..., None].expand_as(grad)
    assert (grad[~keep].isnan()).all()
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grad.float()[keep], truth_grad.float()[keep], **tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_infinite_kl_with_beta_zero_is_a_metric_only(backend):
    """beta = 0: the +inf KL is reported, the loss and the gradient stay finite."""
    data = _banning_batch(torch.float32, "-inf")
    cfg = LossConfig.preset("grpo").replace(kl="full", beta=0.0)
    ours, grad = _run(fusedrl.policy_loss, data, cfg, backend=backend)
    assert math.isfinite(ours.loss.item()) and torch.isfinite(grad).all()
    assert ours.metrics["kl"].item() == math.inf
