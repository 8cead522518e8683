"""fusedrl.linear_policy_loss against Liger-Kernel's LigerFusedLinearGRPOLoss (the real package).

Both compute a GRPO-family loss from the hidden states and the LM head without keeping the
[B, T, V] logits. Liger runs on CPU with compiled=False; fusedrl with its torch backend. The
LossConfig for each Liger loss_type comes from fusedrl's TRL mapping (`loss_config_from_trl`):
Liger's grpo_loss.py reproduces TRL's `GRPOTrainer._compute_loss`, and its constructor arguments
carry TRL's names (epsilon_low = TRL's epsilon). Compared: the loss, d hidden, d weight, d bias,
and Liger's two metrics (k3 KL mean, clipped-token fraction) where fusedrl has the same quantity.

Liger loss_type -> LossConfig (single process):
  grpo     ppo, seq-mean-token-mean, normalizer=B (Liger divides by all B rows, see below)
  bnpo     ppo, token-mean
  dapo     ppo, token-mean (Liger: the mask sum, or num_items_in_batch -> normalizer)
  dr_grpo  ppo, seq-mean-token-sum-norm, norm_constant=max_completion_length
  cispo    cispo, eps_high = epsilon_high - 1 (Liger's epsilon_high is an absolute cap), eps_low
           just below 1 (Liger has no lower bound), token-mean
  sapo     sapo, seq-mean-token-mean, normalizer=B
  grpo with importance_sampling_level="sequence" (GSPO): ppo, ratio_level="sequence"

Differences found (none of them exercised by these inputs, where |logp - old| and |logp - ref| are
a few units at most):
  - Liger's ratio is exp(logp - old) with no clamp; fusedrl clamps the log-ratio at +-20 (and a
    GSPO sequence log-ratio at 10).
  - Liger's k3 is exp(ref - logp) - (ref - logp) - 1 unclamped; fusedrl clamps ref - logp at
    +-20 and the k3 value at +-10 (verl's low_var_kl).
  - grpo / sapo: Liger (like TRL) divides the sum of per-sequence means by all B rows, empty ones
    included; fusedrl's seq-mean-token-mean divides by the non-empty rows unless `normalizer` is
    given. The parity tests pass normalizer=B, as FusedGRPOTrainer does; test_grpo_empty_row_...
    pins the default's difference.
  - Not compared: Liger's luspo and vespo (no fusedrl equivalent), use_bias_correction_kl (fusedrl
    has none), the sapo clip metric (Liger reports 0, fusedrl counts out-of-range tokens), and
    vllm_is_ratio (fusedrl's is_correction caps the weight; Liger multiplies by it as given).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("liger_kernel")
trl_integration = pytest.importorskip("fusedrl.integrations.trl")

from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss  # noqa: E402

import fusedrl  # noqa: E402

# fp32 on both sides: the logits and the loss are the same fp32 operations in another order.
ATOL = RTOL = 1e-5
B, T, H, V = 4, 7, 24, 1031
MAX_COMPLETION_LENGTH = 9  # != T, so that dr_grpo's constant is seen
EPS_LOW, EPS_HIGH = 0.2, 0.28  # asymmetric: a swapped pair would not pass
CISPO_CAP = 1.25  # Liger's epsilon_high for cispo: an absolute cap on the ratio
GSPO_EPS_LOW, GSPO_EPS_HIGH = 3e-4, 4e-4
BETA = 0.04


def make_inputs(temperature, seed=0, bias=True):
    """Ragged mask with one fully masked row, advantages of both signs, old = logp + 0.3 noise,
    ref = logp + 0.2 noise, all at `temperature`."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * (2.0 / H**0.5)
    b = torch.randn(V, generator=gen) if bias else None
    labels = torch.randint(0, V, (B, T), generator=gen)
    lengths = torch.tensor([T, 0, 3, 5])  # row 1 is empty
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    advantages = torch.tensor([0.9, -0.4, -1.3, 0.7])
    with torch.no_grad():
        logits = torch.nn.functional.linear(hidden, weight, b) / temperature
        logp = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    return dict(
        hidden=hidden.requires_grad_(),
        weight=weight.requires_grad_(),
        bias=None if b is None else b.requires_grad_(),
        labels=labels,
        mask=mask,
        advantages=advantages,
        logp=logp,
        old_logp=logp + 0.3 * torch.randn(B, T, generator=gen),
        ref_logp=logp + 0.2 * torch.randn(B, T, generator=gen),
    )


def trl_args(loss_type, beta, temperature, level="token", delta=None):
    """The GRPOConfig fields that both Liger's constructor and `loss_config_from_trl` read."""
    if loss_type == "cispo":
        eps_low, eps_high = EPS_LOW, CISPO_CAP
    elif level == "sequence":
        eps_low, eps_high = GSPO_EPS_LOW, GSPO_EPS_HIGH
    else:
        eps_low, eps_high = EPS_LOW, EPS_HIGH
    return SimpleNamespace(
        loss_type=loss_type,
        beta=beta,
        epsilon=eps_low,
        epsilon_high=eps_high,
        temperature=temperature,
        max_completion_length=MAX_COMPLETION_LENGTH,
        importance_sampling_level=level,
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05,
        delta=delta,
        use_bias_correction_kl=False,
    )


def grads_of(loss, inp):
    params = [inp["hidden"], inp["weight"]] + ([inp["bias"]] if inp["bias"] is not None else [])
    return torch.autograd.grad(loss, params)


def run_liger(inp, args, old=True, num_items_in_batch=None):
    liger = LigerFusedLinearGRPOLoss(
        beta=args.beta,
        compiled=False,
        use_ref_model=args.beta != 0.0,
        epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high,
        loss_type=args.loss_type,
        max_completion_length=args.max_completion_length,
        importance_sampling_level=args.importance_sampling_level,
        sapo_temperature_pos=args.sapo_temperature_pos,
        sapo_temperature_neg=args.sapo_temperature_neg,
        temperature=args.temperature,
        delta=args.delta,
    )
    loss, metrics = liger(
        inp["hidden"],
        inp["weight"],
        inp["labels"],
        inp["mask"],
        inp["advantages"],
        bias=inp["bias"],
        ref_per_token_logps=inp["ref_logp"] if args.beta != 0.0 else None,
        old_per_token_logps=inp["old_logp"] if old else None,
        num_items_in_batch=num_items_in_batch,
    )
    return loss, metrics, grads_of(loss, inp)


def run_fused(inp, args, old=True, normalizer=None):
    cfg = trl_integration.loss_config_from_trl(args)
    if normalizer is None and args.loss_type in ("grpo", "sapo"):
        normalizer = float(B)  # Liger (as TRL) averages over all B rows, the empty one included
    out = fusedrl.linear_policy_loss(
        inp["hidden"],
        inp["weight"],
        inp["labels"],
        inp["advantages"],
        inp["mask"],
        old_logp=inp["old_logp"] if old else None,
        ref_logp=inp["ref_logp"] if args.beta != 0.0 else None,
        config=cfg,
        normalizer=normalizer,
        bias=inp["bias"],
        backend="torch",
    )
    return out.loss, out.metrics, grads_of(out.loss, inp)


def assert_parity(liger, fused, args, compare_clip_metric=True):
    (l_loss, l_metrics, l_grads), (f_loss, f_metrics, f_grads) = liger, fused
    torch.testing.assert_close(f_loss, l_loss, atol=ATOL, rtol=RTOL)
    for name, f_grad, l_grad in zip(("hidden", "weight", "bias"), f_grads, l_grads):
        torch.testing.assert_close(f_grad, l_grad, atol=ATOL, rtol=RTOL, msg=f"d {name}")
    # Liger's metrics: [k3 KL masked mean (beta != 0 only), clipped-token fraction].
    if args.beta != 0.0:
        torch.testing.assert_close(f_metrics["kl"], l_metrics[0], atol=ATOL, rtol=RTOL)
    if compare_clip_metric:
        clipped = f_metrics["clip_low"] + f_metrics["clip_high"]
        torch.testing.assert_close(clipped, l_metrics[-1], atol=ATOL, rtol=RTOL)


def assert_clipping_acts(inp, args):
    """Some valid tokens take the clipped branch (or, for cispo, the cap) and some do not."""
    valid = inp["mask"].bool()
    log_ratio = inp["logp"] - inp["old_logp"]
    if args.importance_sampling_level == "sequence":
        seq = (log_ratio * inp["mask"]).sum(-1) / inp["mask"].sum(-1).clamp(min=1.0)
        log_ratio = seq[:, None].expand(B, T)
    ratio = log_ratio.exp()
    adv = inp["advantages"][:, None].expand(B, T)
    if args.loss_type == "cispo":
        clipped = ratio > args.epsilon_high
    else:
        lo, hi = 1 - args.epsilon, 1 + args.epsilon_high
        assert ((ratio < lo) | (ratio > hi))[valid].any()
        clipped = ((ratio < lo) & (adv < 0)) | ((ratio > hi) & (adv > 0))
    assert clipped[valid].any() and not clipped[valid].all()


LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("beta", [0.0, BETA])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_type_matches_liger(loss_type, beta, temperature):
    inp = make_inputs(temperature)
    args = trl_args(loss_type, beta, temperature)
    if loss_type != "sapo":
        assert_clipping_acts(inp, args)
    assert_parity(
        run_liger(inp, args), run_fused(inp, args), args, compare_clip_metric=loss_type != "sapo"
    )


@pytest.mark.parametrize("beta", [0.0, BETA])
def test_gspo_matches_liger(beta):
    """grpo with importance_sampling_level="sequence": Liger differentiates exp(mean_t lr);
    fusedrl's per-token s_it has the same value and, with one advantage per row, the same
    gradient."""
    inp = make_inputs(0.7, seed=1)
    args = trl_args("grpo", beta, 0.7, level="sequence")
    assert_clipping_acts(inp, args)
    assert_parity(run_liger(inp, args), run_fused(inp, args), args)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo"])
def test_on_policy_matches_liger(loss_type):
    """old_logp=None on both sides: the ratio is exp(logp - sg(logp)) = 1."""
    inp = make_inputs(1.0, seed=2)
    args = trl_args(loss_type, BETA, 1.0)
    assert_parity(
        run_liger(inp, args, old=False),
        run_fused(inp, args, old=False),
        args,
        compare_clip_metric=loss_type != "sapo",
    )


def test_dapo_global_normalizer_matches_liger():
    """Liger's num_items_in_batch (one process) is fusedrl's normalizer."""
    inp = make_inputs(0.7, seed=3)
    args = trl_args("dapo", 0.0, 0.7)
    num_items = 2.5 * inp["mask"].sum().item()
    liger = run_liger(inp, args, num_items_in_batch=num_items)
    fused = run_fused(inp, args, normalizer=num_items)
    # The loss is scaled; the clip metric still divides by the local token count on both sides.
    assert_parity(liger, fused, args)


def test_delta_and_no_bias_match_liger():
    """INTELLECT-2's delta (caps the unclipped ratio for A < 0), an LM head without bias."""
    inp = make_inputs(1.0, seed=13, bias=False)
    args = trl_args("bnpo", BETA, 1.0, delta=1.3)
    ratio = (inp["logp"] - inp["old_logp"]).exp()
    assert ((ratio > 1.3) & (inp["advantages"][:, None] < 0))[inp["mask"].bool()].any()
    assert_parity(run_liger(inp, args), run_fused(inp, args), args)


def test_grpo_empty_row_counts_differ_without_normalizer():
    """The one aggregation difference: with no normalizer, fusedrl's seq-mean-token-mean divides
    by the non-empty rows (3), Liger by all B rows (4)."""
    inp = make_inputs(1.0)
    args = trl_args("grpo", BETA, 1.0)
    l_loss = run_liger(inp, args)[0]
    cfg = trl_integration.loss_config_from_trl(args)
    f_loss = fusedrl.linear_policy_loss(
        inp["hidden"],
        inp["weight"],
        inp["labels"],
        inp["advantages"],
        inp["mask"],
        old_logp=inp["old_logp"],
        ref_logp=inp["ref_logp"],
        config=cfg,
        bias=inp["bias"],
        backend="torch",
    ).loss
    non_empty = (inp["mask"].sum(-1) > 0).sum().item()
    assert non_empty == B - 1
    torch.testing.assert_close(f_loss * non_empty / B, l_loss, atol=ATOL, rtol=RTOL)
