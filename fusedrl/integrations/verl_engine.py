"""verl, fully fused: the actor's policy loss from the logits in one fusedrl call (verl 0.9.1).

verl's engine turns the model's logits into log-probs and entropy (`prepare_model_outputs`)
before its loss (`ppo_loss`) sees them, so a registry loss (fusedrl.integrations.verl, piece 1)
runs only the [B, R] scalar half and the logits are read again in backward. This engine hands
the logits themselves, the rolled labels and the layout (the packed rows' `cu_seqlens` with
`use_remove_padding=True`, verl's recommended setting, or the padded rows) to one
`fusedrl.policy_loss` call: loss, gradient and metrics from the fused kernels, no [N] log-prob
tensor, no re-padding loop, no separate entropy pass, no logits copy divided by the temperature.

Switched on by importing this module in every worker (verl's `external_lib`):

    actor_rollout_ref.model.external_lib=fusedrl.integrations.verl_engine

It registers `FusedPolicyLossEngine` with verl's `EngineRegistry` for ("cuda", "nvidia"), a key
verl looks up before the plain "cuda" under which it registers its own FSDP engine (which stays
as it is). The engine is verl's `FSDPEngineWithLMHead` except on a training micro-batch whose
loss is verl's own `ppo_loss` in a case fusedrl reproduces (`fused_loss_for`); every other call
(the old / reference log-prob passes, the critic, SFT and distillation losses, Ulysses sequence
parallelism, verl's fused-kernel forward, a case below) is verl's code, unchanged.
tests/test_verl_engine.py runs verl's own `TrainingWorker.train_mini_batch` on CPU with both
engines and compares the gradients and metrics.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from verl.trainer.ppo.core_algos import agg_loss, kl_penalty
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.utils.losses import ppo_loss

import fusedrl
from fusedrl.packed import reads_logits_once

from .verl import BACKEND, LOSS_MODES, _get, loss_config_from_verl, policy_metrics, verl_normalizer

# verl's kl_loss_type -> fusedrl's estimator (the same formulas and clamps: docs/losses.md).
KL_ESTIMATORS = {
    "kl": "k1",
    "k1": "k1",
    "abs": "abs",
    "mse": "k2",
    "k2": "k2",
    "low_var_kl": "k3",
    "k3": "k3",
    "k1+": "k1+",
    "k3+": "k3+",
    "low_var_kl+": "k3+",
}
# sapo's policy term is aggregated per sequence whatever loss_agg_mode says, while ppo_loss's
# entropy and KL terms follow loss_agg_mode: one fusedrl config cannot hold both, so sapo with
# either term stays verl's. geo_mean (one IS weight per sequence, a mean over all rows) and
# clip_cov (its own draw of tokens) stay verl's too.
_OWN_AGGREGATION = ("sapo",)
_VERLS_OWN = ("geo_mean", "clip_cov")


class FusedPolicyLossEngine(FSDPEngineWithLMHead):
    """verl's FSDP engine whose PPO training step computes the loss with fusedrl from the logits
    (the module docstring says when)."""

    def forward_step(self, micro_batch, loss_function, forward_only):
        fused = fused_loss_for(self, micro_batch, loss_function, forward_only)
        return super().forward_step(micro_batch, fused or loss_function, forward_only)

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        if isinstance(logits_processor_func, FusedPPOLoss):
            # The logits as the model made them (not divided by the temperature, no log-probs).
            return {"logits": output.logits, "output_args": output_args}
        return super().prepare_model_outputs(
            output, output_args, micro_batch, logits_processor_func
        )


def fused_loss_for(engine, micro_batch, loss_function, forward_only) -> FusedPPOLoss | None:
    """The fused loss for this micro-batch, or None where verl's own path runs."""
    if forward_only or not isinstance(loss_function, functools.partial):
        return None
    if loss_function.func is not ppo_loss or "config" not in loss_function.keywords:
        return None
    config = loss_function.keywords["config"]
    flags = ("use_fused_kernels", "calculate_sum_pi_squared", "return_model_output")
    flags += ("distillation_use_topk",)
    if any(tu.get_non_tensor_data(data=micro_batch, key=f, default=False) for f in flags):
        return None
    if getattr(engine, "use_ulysses_sp", False):  # each rank holds a slice of every sequence
        return None
    return FusedPPOLoss(config) if reproduces(config) else None


def reproduces(config: Any) -> bool:
    """Whether fusedrl reproduces verl's ppo_loss for this actor config: a mode it covers (the
    registry's `fusedrl_` names too) with settings it takes; else verl's own loss runs (a
    setting fusedrl refuses must not fail a run that verl would train)."""
    mode = _get(_get(config, "policy_loss"), "loss_mode", "vanilla").removeprefix("fusedrl_")
    if mode not in LOSS_MODES or mode in _VERLS_OWN:
        return False
    use_kl = bool(_get(config, "use_kl_loss", False))
    if use_kl and _get(config, "kl_loss_type", "low_var_kl") not in KL_ESTIMATORS:
        return False
    entropy = float(_get(config, "entropy_coeff", 0.0) or 0.0)
    if mode in _OWN_AGGREGATION and (entropy != 0.0 or use_kl):
        return False
    try:
        loss_config_from_verl(config, loss_mode=mode)
    except ValueError:
        return False
    return True


class FusedPPOLoss:
    """verl's `ppo_loss(config, model_output, data)` from the logits: the engine's
    `prepare_model_outputs` hands them over (with `output_args`) in place of log-probs."""

    def __init__(self, config: Any):
        self.config = config

    def __call__(self, model_output: dict, data, dp_group=None):
        logits, output_args = model_output.pop("logits"), model_output.pop("output_args")
        return fused_ppo_loss(self.config, logits, output_args, data)


def fused_ppo_loss(config: Any, logits: torch.Tensor, output_args: dict, data):
    """(loss, metrics) as verl's ppo_loss gives them, by one fusedrl.policy_loss call."""
    packed = tu.get_non_tensor_data(data=data, key="use_remove_padding", default=True)
    fields = ["response_mask", "old_log_probs", "advantages"]
    fields += [name for name in ("rollout_is_weights", "ref_log_prob") if name in data]
    rows = data.select(*fields).to_padded_tensor()  # [B, R], as ppo_loss reads them
    response_mask = rows["response_mask"].bool()
    layout = _ResponseRows(data, logits, packed, response_mask.shape[-1])
    batch_info = {
        "dp_size": data["dp_size"],
        "batch_num_tokens": data["batch_num_tokens"],
        "global_batch_size": data["global_batch_size"],
        "loss_scale_factor": _get(config, "loss_scale_factor"),
    }
    config.global_batch_info.update(batch_info)  # (as ppo_loss leaves it)
    cfg, normalizer = _loss_config(config, response_mask, batch_info)
    calculate_entropy = tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False)
    use_kl = bool(_get(config, "use_kl_loss", False))
    is_weights = rows.get("rollout_is_weights", None)
    # The logits are dead after the loss (the engine's own log-prob and entropy pass is the one
    # this replaces): the gradient goes into their buffer wherever fusedrl takes it, i.e. on
    # padded rows always, on packed rows where the loss reads them once (token-level ratios).
    inplace = not packed or reads_logits_once(cfg, None, is_weights)
    out = fusedrl.policy_loss(
        layout.logits,
        layout.labels(output_args),
        layout.scatter(rows["advantages"], response_mask),
        layout.scatter(response_mask, response_mask),
        old_logp=layout.scatter(rows["old_log_probs"], response_mask),
        ref_logp=layout.scatter(rows["ref_log_prob"], response_mask) if use_kl else None,
        config=cfg,
        normalizer=normalizer,
        backend=BACKEND,
        return_entropy=calculate_entropy,
        is_weights=None if is_weights is None else layout.scatter(is_weights, response_mask),
        temperature=data["temperature"],
        cu_seqlens=layout.cu_seqlens,
        inplace=inplace,
    )
    logp = layout.gather(out.logp, response_mask)
    entropy = None if out.entropy is None else layout.gather(out.entropy, response_mask)
    old = torch.where(response_mask, rows["old_log_probs"].float(), 0.0)
    advantages = torch.where(response_mask, rows["advantages"].float(), 0.0)
    mode = _get(_get(config, "policy_loss"), "loss_mode", "vanilla")
    found = policy_metrics(mode, cfg, logp, old, advantages, response_mask, out.metrics)
    aggregation = _metric_aggregation(data, config)
    metrics = Metric.from_dict(found, aggregation=AggregationType.MEAN)
    loss_agg_mode = _get(config, "loss_agg_mode", "token-mean")
    pg_loss = out.loss.detach()
    if entropy is not None:
        entropy_loss = agg_loss(entropy, response_mask, loss_agg_mode, **batch_info)
        pg_loss = pg_loss + cfg.entropy_coef * entropy_loss
        metrics["actor/entropy_loss"] = Metric(value=entropy_loss, aggregation=aggregation)
    if use_kl:
        ref = rows["ref_log_prob"].float()
        kld = kl_penalty(logprob=logp, ref_logprob=ref, kl_penalty=config.kl_loss_type)
        kl_loss = agg_loss(kld, response_mask, loss_agg_mode, **batch_info)
        pg_loss = pg_loss - cfg.beta * kl_loss
        metrics["kl_loss"] = Metric(value=kl_loss, aggregation=aggregation)
        metrics["kl_coef"] = config.kl_loss_coef
    metrics["actor/pg_loss"] = Metric(value=pg_loss, aggregation=aggregation)
    return out.loss, metrics


def _loss_config(config, response_mask: torch.Tensor, batch_info: dict):
    """fusedrl's config and normalizer for verl's ppo_loss: the policy loss's
    (`loss_config_from_verl`), with ppo_loss's entropy bonus and KL loss in it."""
    loss_agg_mode = _get(config, "loss_agg_mode", "token-mean")
    mode = _get(_get(config, "policy_loss"), "loss_mode", "vanilla")
    cfg = loss_config_from_verl(config, mode, loss_agg_mode, batch_info)
    changes = {"entropy_coef": float(_get(config, "entropy_coeff", 0.0) or 0.0)}
    if bool(_get(config, "use_kl_loss", False)):
        changes.update(beta=float(config.kl_loss_coef), kl=KL_ESTIMATORS[config.kl_loss_type])
    if cfg.agg == "seq-mean-token-sum-norm" and cfg.norm_constant is None:
        # verl's agg_loss divides by the padded response length; fusedrl's rows are whole
        # sequences here, so it is passed.
        changes["norm_constant"] = float(response_mask.shape[-1])
    agg_mode = "seq-mean-token-mean" if mode == "sapo" else loss_agg_mode
    return cfg.replace(**changes), verl_normalizer(response_mask, agg_mode, batch_info)


def _metric_aggregation(data, config) -> AggregationType:
    """ppo_loss's: a sum where the loss is normalised by global counts, else a mean."""
    global_counts = (
        data["dp_size"] > 1
        or data["batch_num_tokens"] is not None
        or data["global_batch_size"] is not None
        or _get(config, "loss_scale_factor") is not None
    )
    return AggregationType.SUM if global_counts else AggregationType.MEAN


class _ResponseRows:
    """Where each response token's logits row lies: token j of sequence b (prompt p_b) is
    predicted by the row at p_b - 1 + j of its sequence, in the packed rows (sequence b from
    `cu_seqlens[b]`) or in row b of the padded logits. Per-token tensors of the responses
    ([B, R]) are scattered to every row (0 off the responses) and gathered back."""

    def __init__(self, data, logits: torch.Tensor, packed: bool, width: int):
        input_ids = data["input_ids"]
        prompt_lens, response_lens = _prompt_and_response_lengths(data)
        self.packed = packed
        self.input_ids = input_ids
        if packed:
            tokens = input_ids.values().shape[0]
            self.cu_seqlens = input_ids.offsets()
            self.logits = logits.squeeze(0)[:tokens]  # (a static pad's rows dropped)
            starts = self.cu_seqlens[:-1]
        else:
            batch, longest = logits.shape[:2]
            self.cu_seqlens = None
            self.logits = logits
            tokens = batch * longest
            starts = torch.arange(batch, device=logits.device) * longest
        self.tokens = tokens
        j = torch.arange(width, device=logits.device)  # (R: the [B, R] tensors' width)
        self.inside = j < response_lens[:, None]
        first = (starts + prompt_lens - 1)[:, None]
        self.rows = torch.where(self.inside, first + j, tokens)

    def labels(self, output_args: dict) -> torch.Tensor:
        """Each row's next token: verl's rolled ids (packed), or each padded row's rolled."""
        if self.packed:
            return output_args["input_ids_rmpad_rolled"][: self.tokens]
        batch, longest = self.logits.shape[:2]
        ids = torch.nested.to_padded_tensor(self.input_ids, 0, output_size=(batch, longest))
        return torch.roll(ids, shifts=-1, dims=1)

    def scatter(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, R] response values on every row ([N], or [B, T] padded), 0 elsewhere."""
        flat = values.new_zeros(self.tokens + 1)
        kept = torch.where(self.inside & mask, values, flat[-1])
        flat.scatter_(0, self.rows.reshape(-1), kept.reshape(-1))
        flat = flat[: self.tokens]
        return flat if self.packed else flat.reshape(self.logits.shape[:2])

    def gather(self, per_row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The response tokens' values of a per-row tensor, [B, R] (0 off the mask)."""
        flat = per_row.reshape(-1)
        picked = flat[torch.where(self.inside, self.rows, 0)]
        return torch.where(mask, picked.float(), 0.0)


def _prompt_and_response_lengths(data) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's prompt and response lengths, as verl's `no_padding_2_padding` reads them:
    from the nested prompts / responses (the v1 trainer's), or from the attention mask of the
    padded ones (the classic trainer's)."""
    prompts, responses = data["prompts"], data["responses"]
    if prompts.is_nested:
        return prompts.offsets().diff(), responses.offsets().diff()
    attention_mask = data["attention_mask"]
    width = prompts.shape[1]
    return attention_mask[:, :width].sum(dim=1), attention_mask[:, width:].sum(dim=1)


def register() -> None:
    """Register FusedPolicyLossEngine for FSDP on NVIDIA GPUs (once)."""
    engines = EngineRegistry._engines.get("language_model", {})
    if any(engines.get(b, {}).get(("cuda", "nvidia")) for b in ("fsdp", "fsdp2")):
        return
    EngineRegistry.register(
        model_type="language_model", backend=["fsdp", "fsdp2"], device="cuda", vendor="nvidia"
    )(FusedPolicyLossEngine)


register()
