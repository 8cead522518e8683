"""Validation and normalisation of `policy_loss` / `token_logprobs` arguments.

Every backend and the reference go through here, so a bad argument fails the same way everywhere,
with a message that names it. Nothing here touches the vocab axis or copies the logits: the logits
come back as a [B, T, V] *view* (a strided slice of [B, P+T, V] stays a view).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace

import torch

from .config import LossConfig
from .logit_transform import LogitTransform, check_logit_transform

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True)
class LossInputs:
    """Arguments of `policy_loss`, checked, with every per-token tensor as [B, T] fp32. Built
    once (`prepare_loss_inputs`), never changed: a changed input is a new one
    (`dataclasses.replace`)."""

    logits: torch.Tensor  # [B, T, V] view of the caller's logits (original dtype)
    labels: torch.Tensor  # [B, T] int64; masked positions replaced by 0 so they index safely
    advantages: torch.Tensor  # [B, T] fp32 (broadcast from [B] when given per sequence)
    mask: torch.Tensor  # [B, T] fp32 weights (0/1 for a boolean mask)
    valid: torch.Tensor  # [B, T] bool, mask != 0
    old_logp: torch.Tensor | None
    ref_logp: torch.Tensor | None
    rollout_logp: torch.Tensor | None
    is_weights: torch.Tensor | None  # [B, T] precomputed train/inference IS weights
    normalizer: torch.Tensor | float | None
    flat_input: bool  # caller passed [N, V] (one packed row of tokens, B = 1)
    # [B, T, V] view of the reference policy's logits (kl="full" / "full_reverse"), no gradient
    ref_logits: torch.Tensor | None = None
    # [B, T] fp32 per-token temperatures (`temperature=` a tensor), in place of cfg.temperature
    row_temps: torch.Tensor | None = None
    # [B, T] fp32 each row's sampled-set floor on the raw logits (config.top_k / top_p / min_p,
    # found by the backend's select kernel): the kernels read the set through it, in place of
    # a masked copy of the logits. None: the logits are read whole (or already masked).
    sampled_floors: torch.Tensor | None = None
    # 0-dim fp32 entropy coefficient on the logits' device (`entropy_coef=` a tensor), in place
    # of cfg.entropy_coef: adaptive entropy control changes it without a recompile or a sync
    entropy_coef: torch.Tensor | None = None
    # the model's soft cap (and logit scale) the backends apply to the logits (`softcap=`);
    # None: the logits are the model's (a bare logit scale is folded into the temperature)
    transform: LogitTransform | None = None
    # True: every per-token tensor is 0 wherever valid is False (labels too, checked in
    # [0, V)) and `mask` is fp32, what any torch code may multiply by a mask or gather with.
    # False (`prepare_loss_inputs(mask_rows=False)`, for the kernels, which read counted tokens
    # only and check their labels' range themselves): labels, advantages, old / ref / rollout
    # log-probs and IS weights hold the caller's values there (NaN padding, -100 included), the
    # labels' range is unchecked and `mask` may be the caller's bool mask; `masked_rows` gives
    # the masked, checked form.
    rows_masked: bool = True
    # `grad_scale=`: the factor the caller multiplies the loss by before backward (gradient
    # accumulation, loss scaling), a number or a 0-dim fp32 device tensor; the gradient is
    # written already scaled by it. None: 1.
    grad_scale: float | torch.Tensor | None = None
    # [B, T] fp32 aggregation weights given by the caller, in place of those of the mask and
    # config.agg (`token_terms.aggregation_weights`): packed sequences' per-segment weights
    # (fusedrl/packed.py), whose flat [1, N] rows carry no boundaries. None: the mask's.
    agg_weights: torch.Tensor | None = None
    # What token_terms derives from the mask alone, once per call (the masked means' weights,
    # the aggregation weights): not an input, never copied by `dataclasses.replace`.
    derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)


def detached(t: torch.Tensor) -> torch.Tensor:
    """`t` out of autograd: itself when it is already (a detach() is a new tensor, a
    microsecond of the host's time on every input of every call)."""
    return t.detach() if t.requires_grad else t


def temperature_of(inp: LossInputs, cfg) -> float | torch.Tensor:
    """The temperature the backends divide the logits by: per token, or the config's."""
    return inp.row_temps if inp.row_temps is not None else cfg.temperature


def entropy_coef_of(inp: LossInputs, cfg) -> float | torch.Tensor:
    """The entropy bonus's coefficient: the call's device scalar, or the config's number."""
    return inp.entropy_coef if inp.entropy_coef is not None else cfg.entropy_coef


def has_entropy_bonus(inp: LossInputs, cfg) -> bool:
    """A coefficient given as a tensor always applies (its value may be 0 this step)."""
    return inp.entropy_coef is not None or cfg.entropy_coef != 0.0


def needs_entropy(inp: LossInputs, cfg) -> bool:
    """The loss reads each token's entropy: a bonus, or the top-entropy token selection."""
    return cfg.needs_entropy or inp.entropy_coef is not None


def check_entropy_coef(entropy_coef: object, config, device: torch.device) -> torch.Tensor | None:
    """`entropy_coef=`: a one-element float tensor on the logits' device, finite (checked
    without a host sync off the CPU), as a 0-dim fp32 tensor; None leaves config.entropy_coef."""
    if entropy_coef is None:
        return None
    if not isinstance(entropy_coef, torch.Tensor):
        raise TypeError(
            "entropy_coef must be a one-element tensor (a fixed number goes in "
            f"config.entropy_coef), got {type(entropy_coef).__name__}"
        )
    coef = _device_scalar(entropy_coef, "entropy_coef", device)
    if config.entropy_coef != 0.0:
        raise ValueError(
            f"entropy_coef (a tensor) and config.entropy_coef={config.entropy_coef} are both set: "
            "pass one"
        )
    _fail_if(~torch.isfinite(coef), "entropy_coef must be finite", coef)
    return coef


def _device_scalar(value: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    """A one-element float tensor on the logits' device (checked by name), as a 0-dim fp32."""
    if not value.dtype.is_floating_point:
        raise TypeError(f"{name} must be a float tensor, got dtype {value.dtype}")
    if value.numel() != 1:
        raise ValueError(f"{name} must hold one number, got shape {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but the logits are on {device}")
    return value.detach().float().reshape(())


def check_grad_scale(grad_scale: object, device: torch.device) -> float | torch.Tensor | None:
    """`grad_scale=`: a finite number != 0, or a one-element float tensor on the logits' device
    (checked without a host sync off the CPU), as a 0-dim fp32 tensor. 0 is refused: the
    gradient written at 0 could not be rescaled to any other upstream gradient."""
    if grad_scale is None:
        return None
    message = "grad_scale must be a finite number != 0 (the factor the loss is multiplied by)"
    if isinstance(grad_scale, torch.Tensor):
        scale = _device_scalar(grad_scale, "grad_scale", device)
        _fail_if(~torch.isfinite(scale) | (scale == 0), message, scale)
        return scale
    if isinstance(grad_scale, bool) or not isinstance(grad_scale, numbers.Real):
        raise TypeError(
            f"grad_scale must be a number or a 0-dim tensor, got {type(grad_scale).__name__}"
        )
    if not math.isfinite(grad_scale) or grad_scale == 0:
        raise ValueError(f"{message}, got {grad_scale!r}")
    return float(grad_scale)


def check_temperature_arg(
    temperature: object,
    shape: tuple[int, ...],
    device: torch.device,
    flat_input: bool,
) -> float | torch.Tensor:
    """The log-prob functions' `temperature`: a float, or per-token temperatures, checked."""
    if not isinstance(temperature, torch.Tensor):
        return check_temperature(temperature)
    return check_row_temperatures(temperature, shape, device, flat_input)


def check_row_temperatures(
    temperature: torch.Tensor,
    shape: tuple[int, ...],
    device: torch.device,
    flat_input: bool,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token temperatures: [B, T] (or [B], one per sequence, or [N] for [N, V] logits),
    finite and > 0 wherever `valid` (everywhere without it), as fp32; masked tokens get 1."""
    if temperature.is_complex() or not (
        temperature.dtype.is_floating_point or temperature.dtype in (torch.int32, torch.int64)
    ):
        raise TypeError(f"temperature must be a float tensor, got dtype {temperature.dtype}")
    if temperature.device != device:
        raise ValueError(f"temperature is on {temperature.device} but the logits are on {device}")
    values = temperature.float()
    if values.dim() == 0:  # one for every token, kept on the device
        values = values.expand(shape)
    elif not flat_input and values.dim() == 1 and values.shape[0] == shape[0]:
        values = values[:, None].expand(shape)  # one per sequence
    if tuple(values.shape) != tuple(shape):
        per_sequence = "" if flat_input else f" (or one per sequence, [{shape[0]}])"
        raise ValueError(
            f"temperature shape {tuple(temperature.shape)} must be the tokens' {tuple(shape)}"
            + per_sequence
        )
    if valid is not None:
        values = torch.where(valid, values, 1.0)
    bad = ~(torch.isfinite(values) & (values > 0))
    if device.type == "cpu" and not torch.compiler.is_compiling():
        if bool(bad.any()):
            raise ValueError(
                f"temperature must be finite and > 0 on every token, found {values[bad][0].item()}"
            )
    elif values.numel() > 0:
        torch._assert_async(~bad.any(), "temperature must be finite and > 0 on every token")
    values = values.contiguous()
    return values.unsqueeze(0) if flat_input else values


def check_logits(logits: object, name: str = "logits") -> torch.Tensor:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a floating tensor (bf16, fp16, fp32 or fp64), got dtype {logits.dtype}"
        )
    last, axis = ("V", "vocab") if name.endswith("logits") else ("H", "hidden")
    if logits.dim() not in (2, 3):
        raise ValueError(
            f"{name} must be [B, T, {last}] or [N, {last}], got shape {tuple(logits.shape)}"
        )
    if logits.shape[-1] == 0:
        raise ValueError(f"{name} has an empty {axis} dimension: shape {tuple(logits.shape)}")
    if logits.shape[-1] > 1 and logits.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last ({axis}) dimension, got strides "
            f"{tuple(logits.stride())}; a strided view over batch/time is fine, a transposed "
            f"{axis} axis is not (call .contiguous() if you really mean it)"
        )
    return logits


def check_labels(
    labels: object,
    logits: torch.Tensor,
    valid: torch.Tensor | None,
    *,
    vocab: int | None = None,
    source: str = "logits",
    check_range: bool = True,
) -> torch.Tensor:
    """Labels must be integer token ids in [0, V) wherever they count.

    `logits` gives the row shape and device: the logits, or for the LM-head loss the hidden states
    (`source="hidden"`, with the vocab size from the head's weight passed as `vocab`).
    `check_range=False`: the labels as int64, unmasked and their range unchecked (for kernels
    that check it themselves, `check_labels_counted`; `masked_rows` checks it otherwise).

    On CPU the range check is exact and raises ValueError. On an accelerator (and inside
    torch.compile) a host-side check would sync the stream or break the graph, so the check is
    queued on the device instead (`torch._assert_async`): a bad label fails at the next sync.
    """
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
        raise TypeError(f"labels must be an integer tensor of token ids, got dtype {labels.dtype}")
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        last = "vocab" if source == "logits" else "hidden"
        raise ValueError(
            f"labels shape {tuple(labels.shape)} does not match {source} shape "
            f"{tuple(logits.shape)} without its {last} dimension ({tuple(logits.shape[:-1])})"
        )
    if labels.device != logits.device:
        raise ValueError(f"labels are on {labels.device} but {source} are on {logits.device}")
    vocab = logits.shape[-1] if vocab is None else vocab
    # int64 before the compare: an int32 tensor compared with a bound past its range (the
    # tensor-parallel local checks' 2^62) would wrap the bound instead of widening the labels.
    labels = labels.long()
    return labels_in_range(labels, valid, vocab) if check_range else labels


def labels_in_range(labels: torch.Tensor, valid: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """int64 `labels` with those where `valid` is False replaced by 0 (what the torch code
    gathers), checked to lie in [0, vocab) (`check_labels`)."""
    where = ""
    if valid is not None:
        labels = torch.where(valid, labels, 0)  # masked ones are 0: every gather is in range
        where = " where mask is set"
    if labels.numel() == 0:
        return labels
    # One reduction for both bounds (the range check is two launches, not five).
    lowest, highest = torch.aminmax(labels)
    if labels.device.type == "cpu" and not torch.compiler.is_compiling():
        lowest, highest = lowest.item(), highest.item()
        if lowest < 0 or highest >= vocab:
            bad = lowest if lowest < 0 else highest
            raise ValueError(f"labels must be in [0, {vocab}){where}, found {bad}")
    else:
        ok = (lowest >= 0) & (highest < vocab)
        torch._assert_async(ok, f"labels must be in [0, {vocab}){where}")
    return labels


def check_labels_counted(labels_ok: torch.Tensor, inp: LossInputs) -> None:
    """Raise (CPU) or queue a device assert unless `labels_ok` (a 0-dim float, the kernels' own
    check of the labels they read: 1.0 when every counted label lay in [0, V)) holds."""
    if labels_ok.device.type == "cpu" and not torch.compiler.is_compiling():
        if not bool(labels_ok):
            # The error path only: the host check names a label the kernels refused
            labels_in_range(inp.labels, inp.valid, inp.logits.shape[-1])
            raise ValueError(_labels_message(inp))
    else:
        torch._assert_async(labels_ok, _labels_message(inp))


def _labels_message(inp: LossInputs) -> str:
    return f"labels must be in [0, {inp.logits.shape[-1]}) where mask is set"


def _per_token(
    name: str, value: object, shape: tuple[int, ...], device: torch.device, required: bool = False
) -> torch.Tensor | None:
    if value is None:
        if required:
            raise ValueError(f"{name} is required")
        return None
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor, got dtype {value.dtype}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{name} shape {tuple(value.shape)} must be {shape} (the shape of labels)")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but logits are on {device}")
    return detached(value).float()


def check_mask(mask: object, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The mask checked: a bool mask as it is, any other as fp32 weights (>= 0, finite)."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} must be {shape} (the shape of labels)")
    if mask.device != device:
        raise ValueError(f"mask is on {mask.device} but logits are on {device}")
    if mask.is_complex():
        raise TypeError(f"mask must be bool or real, got dtype {mask.dtype}")
    if mask.dtype == torch.bool:  # 0 / 1: nothing to check, nothing to launch
        return detached(mask)
    weights = detached(mask).float()
    # A negative weight would flip the token's gradient, a NaN one poison the loss: neither is a
    # mask. Checked exactly on CPU; queued on the device elsewhere (no host sync).
    if mask.dtype.is_floating_point:
        bad = ~(weights >= 0) | (weights == float("inf"))
    else:  # an integer mask cannot be NaN or inf
        bad = mask < 0
    _fail_if(bad.any(), "mask must hold finite weights >= 0 (bool or 0/1 or fractional)", mask)
    return weights


def _fail_if(condition: torch.Tensor, message: str, like: torch.Tensor) -> None:
    """Raise ValueError(message) if the 0-dim bool `condition` holds: at once on CPU, as an async
    device assert on an accelerator or under torch.compile (a host check would sync)."""
    if like.device.type == "cpu" and not torch.compiler.is_compiling():
        if bool(condition):
            raise ValueError(message)
    elif like.numel() > 0:
        torch._assert_async(~condition, message)


def check_advantages(
    advantages: object,
    shape: tuple[int, ...],
    device: torch.device,
    flat_input: bool,
    name: str = "advantages",
) -> torch.Tensor:
    """[B] (one per sequence, broadcast) or [B, T] floats; also used for per-token weights."""
    if not isinstance(advantages, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(advantages).__name__}")
    if not advantages.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor, got dtype {advantages.dtype}")
    if advantages.device != device:
        raise ValueError(f"{name} are on {advantages.device} but logits are on {device}")
    batch = shape[0]
    if not flat_input and advantages.dim() == 1 and advantages.shape[0] == batch:
        return detached(advantages).float()[:, None].expand(shape)
    if tuple(advantages.shape) == shape:
        return detached(advantages).float()
    expected = f"{shape}" if flat_input else f"[{batch}] (one per sequence) or {list(shape)}"
    raise ValueError(f"{name} shape {tuple(advantages.shape)} must be {expected}")


def check_normalizer(normalizer: object, device: torch.device) -> torch.Tensor | float | None:
    if normalizer is None:
        return None
    if isinstance(normalizer, torch.Tensor):
        if normalizer.numel() != 1:
            raise ValueError(f"normalizer must be a scalar, got shape {tuple(normalizer.shape)}")
        if not (normalizer.dtype.is_floating_point or normalizer.dtype in _INT_DTYPES):
            raise TypeError(
                f"normalizer must be a real number tensor (a token or sequence count), got "
                f"dtype {normalizer.dtype}"
            )
        value = normalizer.detach().to(device=device, dtype=torch.float32).reshape(())
        bad = ~(value > 0) | (value == float("inf"))
        _fail_if(bad, "normalizer must be a finite number > 0", value)
        return value
    if isinstance(normalizer, numbers.Real) and not isinstance(normalizer, bool):
        if not normalizer > 0 or normalizer == float("inf"):
            raise ValueError(f"normalizer must be a finite number > 0, got {normalizer!r}")
        return float(normalizer)
    raise TypeError(
        f"normalizer must be a number or a 0-dim tensor, got {type(normalizer).__name__}"
    )


def prepare_loss_inputs(
    logits: object,
    labels: object,
    advantages: object,
    mask: object,
    old_logp: object,
    ref_logp: object,
    rollout_logp: object,
    config: LossConfig,
    normalizer: object,
    is_weights: object = None,
    *,
    vocab: int | None = None,
    source: str = "logits",
    ref_logits: object = None,
    ref_head: bool = False,
    temperature: torch.Tensor | None = None,
    prox_logp: object = None,
    entropy_coef: object = None,
    transform: LogitTransform | None = None,
    mask_rows: bool = True,
    grad_scale: object = None,
    agg_weights: torch.Tensor | None = None,
) -> LossInputs:
    """Checked inputs; `source="hidden"` (with `vocab`) checks the LM-head loss's hidden states
    [B, T, H] / [N, H] in place of the logits, which then never exist. `ref_logits`: the
    reference policy's logits of config.kl="full" / "full_reverse", the logits' shape;
    `ref_head`: the LM-head loss has the reference's head instead (checked by its caller).
    `temperature`: per-token temperatures, in place of config.temperature (which must be 1).
    `prox_logp`: decoupled PPO (`decoupled_inputs`): the ratio is taken against it, and the
    behaviour weight pi_prox / pi_behav (old_logp's) joins the IS weights. `entropy_coef`: the
    entropy bonus's coefficient as a device scalar (`check_entropy_coef`). `transform`: the model's
    soft cap the backends apply (`capping_transform`), or None. `mask_rows=False`: the per-token
    tensors as the caller gave them (`LossInputs.rows_masked`), for a backend whose kernels read
    counted tokens only. `grad_scale`: the factor the caller multiplies the loss by before
    backward (`check_grad_scale`). `agg_weights`: per-token aggregation weights in place of
    the mask's (`LossInputs.agg_weights`)."""
    logits, flat_input = _checked_source(logits, config, source)
    shape, device = tuple(logits.shape[:-1]), logits.device
    checked_mask = check_mask(mask, shape, device)
    valid = checked_mask if checked_mask.dtype == torch.bool else checked_mask != 0
    ids = check_labels(labels, logits, valid, vocab=vocab, source=source, check_range=mask_rows)
    adv = check_advantages(advantages, shape, device, flat_input)
    old = _per_token("old_logp", old_logp, shape, device)
    ref = _per_token("ref_logp", ref_logp, shape, device)
    rollout = _per_token("rollout_logp", rollout_logp, shape, device)
    ref_logits3 = _check_ref_logits(ref_logits, logits, ref, config, ref_head)
    _check_required_inputs(config, ref, rollout)
    weights = _checked_is_weights(is_weights, config, shape, device, flat_input)
    if prox_logp is not None:
        old, weights = decoupled_inputs(prox_logp, old, weights, valid, shape, device, config)
    row_temps = _checked_row_temperatures(temperature, config, shape, device, flat_input, valid)
    agg = _per_token("agg_weights", agg_weights, shape, device)

    def rows(t: torch.Tensor | None, masked: bool = mask_rows) -> torch.Tensor | None:
        # Masked positions may hold anything (NaN padding): zero them once here so that no
        # torch code can leak them through a multiply-by-mask (`mask_rows`; the kernels read
        # counted tokens alone and take them as they are).
        if t is None:
            return None
        t = torch.where(valid, t, 0.0) if masked else t
        return t.unsqueeze(0) if flat_input else t

    return LossInputs(
        logits=logits.unsqueeze(0) if flat_input else logits,
        labels=rows(ids, masked=False),
        advantages=rows(adv),
        # 0 wherever valid is False; fp32, or the caller's bool for the kernels
        mask=rows(checked_mask.float() if mask_rows else checked_mask, masked=False),
        valid=rows(valid, masked=False),
        old_logp=rows(old),
        ref_logp=rows(ref),
        rollout_logp=rows(rollout),
        is_weights=rows(weights),
        normalizer=check_normalizer(normalizer, device),
        flat_input=flat_input,
        ref_logits=ref_logits3,
        row_temps=row_temps,
        entropy_coef=check_entropy_coef(entropy_coef, config, device),
        transform=transform,
        rows_masked=mask_rows,
        grad_scale=check_grad_scale(grad_scale, device),
        agg_weights=rows(None if agg is None else agg.float()),
    )


def masked_rows(inp: LossInputs) -> LossInputs:
    """`inp` with its per-token tensors 0 wherever valid is False, its counted labels checked
    in [0, V) and an fp32 mask (the form every torch consumer takes; `LossInputs.rows_masked`)."""
    if inp.rows_masked:
        return inp

    def masked(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.where(inp.valid, t, 0.0)

    return replace(
        inp,
        labels=labels_in_range(inp.labels, inp.valid, inp.logits.shape[-1]),
        advantages=masked(inp.advantages),
        mask=inp.mask.float(),
        old_logp=masked(inp.old_logp),
        ref_logp=masked(inp.ref_logp),
        rollout_logp=masked(inp.rollout_logp),
        is_weights=masked(inp.is_weights),
        rows_masked=True,
    )


def check_config(config: object) -> LossConfig:
    if not isinstance(config, LossConfig):
        raise TypeError(f"config must be a fusedrl.LossConfig, got {type(config).__name__}")
    return config


def _checked_source(logits: object, config: object, source: str) -> tuple[torch.Tensor, bool]:
    """(the logits or hidden states checked, whether they are [N, V] / [N, H] without
    sequence boundaries, which the config must not need)."""
    check_config(config)
    logits = check_logits(logits, name=source)
    flat_input = logits.dim() == 2
    if flat_input and config.needs_sequences:
        last = "V" if source == "logits" else "H"
        raise ValueError(
            f"{source} of shape [N, {last}] carry no sequence boundaries, but config needs them "
            f"(agg={config.agg!r}, loss={config.loss!r}, ratio_level={config.ratio_level!r}, "
            f"is_correction={config.is_correction!r}): pass {source} as [B, T, {last}]"
        )
    return logits, flat_input


def _check_required_inputs(config: LossConfig, ref, rollout) -> None:
    """The inputs the config reads: ref_logp for a KL estimate, rollout_logp for the
    train/inference corrections."""
    if config.beta > 0 and ref is None and not config.full_kl:
        raise ValueError(
            f"ref_logp is required when config.beta > 0 (beta={config.beta}, kl={config.kl!r})"
        )
    if config.is_correction is not None and rollout is None:
        raise ValueError(
            f"rollout_logp is required when config.is_correction={config.is_correction!r}"
        )
    if config.rejection is not None and rollout is None:
        raise ValueError(f"rollout_logp is required when config.rejection={config.rejection!r}")
    if config.trust_region_delta is not None and rollout is None:
        raise ValueError(
            "rollout_logp is required when config.trust_region_delta="
            f"{config.trust_region_delta!r} (the sequences' log-ratios to the rollout)"
        )


def _checked_is_weights(is_weights, config, shape, device, flat_input) -> torch.Tensor | None:
    """Precomputed IS weights ([B, T], [B, 1] or [B]) as [B, T] fp32, or None."""
    if is_weights is None:
        return None
    if config.is_correction is not None:
        raise ValueError(
            "is_weights and config.is_correction are exclusive: pass precomputed weights "
            f"with is_correction=None, or rollout_logp with is_correction (got "
            f"{config.is_correction!r})"
        )
    per_column = isinstance(is_weights, torch.Tensor) and is_weights.dim() == 2
    if config.loss == "gmpo" and per_column and is_weights.shape[-1] != 1:
        raise ValueError(
            f"is_weights shape {tuple(is_weights.shape)}: loss='gmpo' weights whole "
            "sequences, pass one weight per sequence ([B] or [B, 1])"
        )
    if per_column and not flat_input and tuple(is_weights.shape) == (shape[0], 1):
        is_weights = is_weights.expand(shape)  # per-sequence weights, as TRL keeps them
    return check_advantages(is_weights, shape, device, flat_input, name="is_weights")


def temperature_in_config(config: object, temperature: object) -> tuple[object, object]:
    """The loss functions' `temperature=` set one way: a number takes config.temperature's
    place (which must then be 1: one temperature, not two), a tensor stays per-token
    temperatures. Returns (config, temperature); a bad config is left as it is, for
    `prepare_loss_inputs` to name."""
    if temperature is None or isinstance(temperature, torch.Tensor):
        return config, temperature
    value = check_temperature(temperature)
    if config is None or isinstance(config, LossConfig):
        cfg = config if config is not None else LossConfig()
        if cfg.temperature != 1.0:
            raise ValueError(
                f"temperature={temperature!r} and config.temperature={cfg.temperature} are both "
                "set: pass one"
            )
        return cfg.replace(temperature=value), None
    return config, temperature


def _checked_row_temperatures(temperature, config, shape, device, flat_input, valid):
    """`temperature=` per-token temperatures (in place of config.temperature), or None."""
    if temperature is None:
        return None
    if not isinstance(temperature, torch.Tensor):
        raise TypeError(
            f"temperature must be a number or a tensor of per-token temperatures, got "
            f"{type(temperature).__name__}"
        )
    if config.temperature != 1.0:
        raise ValueError(
            f"temperature (per token) and config.temperature={config.temperature} are both "
            "set: pass one"
        )
    return check_row_temperatures(temperature, shape, device, flat_input, valid)


def decoupled_inputs(prox_logp, old, weights, valid, shape, device, config):
    """Decoupled PPO (AReaL, asynchronous RL): the proximal policy's log-probs take the old
    log-probs' place in the ratio and its clip, and each token's loss is weighted by
    pi_prox / pi_behav (the behaviour policy: old_logp, the sampler's), 0 where that exceeds
    config.decoupled_is_cap. log(pi_prox / pi_behav) is clamped at +-20 before the exp (as verl
    clamps its log-ratios: w <= e^20 ~ 4.9e8, never inf). Returns (the ratio's old log-probs,
    the IS weights)."""
    prox = _per_token("prox_logp", prox_logp, shape, device)
    if old is None:
        raise ValueError(
            "prox_logp (the proximal policy's log-probs of decoupled PPO) needs old_logp: the "
            "behaviour policy's (the sampler's), whose ratio to it weights each token"
        )
    if config.is_correction is not None:
        raise ValueError(
            f"prox_logp and config.is_correction={config.is_correction!r} both weight the "
            "tokens by an off-policy ratio: decoupled PPO's pi_prox / pi_behav is one; pass one"
        )
    if config.loss == "gmpo":
        raise ValueError(
            "prox_logp: loss='gmpo' weights whole sequences; decoupled PPO weights tokens"
        )
    log_w = torch.where(valid, prox - old, 0.0).clamp(-20.0, 20.0)
    behaviour = log_w.exp()
    if config.decoupled_is_cap is not None:
        behaviour = torch.where(behaviour <= config.decoupled_is_cap, behaviour, 0.0)
    return prox, behaviour if weights is None else weights * behaviour


def _check_ref_logits(
    ref_logits: object,
    logits: torch.Tensor,
    ref_logp: torch.Tensor | None,
    config: LossConfig,
    ref_head: bool = False,
) -> torch.Tensor | None:
    """The reference logits of the exact KL: required by it, refused without it (a tensor that
    would be read by nothing is a caller's mistake), [B, T, V] like the logits, no gradient."""
    if not config.full_kl:
        if ref_logits is not None:
            raise ValueError(
                f"ref_logits is read only by config.kl='full' or 'full_reverse', got "
                f"kl={config.kl!r}: set the KL, or pass ref_logp for a per-token estimator"
            )
        return None
    if ref_head:  # the LM-head loss: ref_weight (checked by linear_policy_loss) makes them
        ref_logits = None
    elif ref_logits is None:
        raise ValueError(
            f"ref_logits (the reference policy's logits, shaped like logits) is required when "
            f"config.kl={config.kl!r}"
        )
    if ref_logp is not None:
        raise ValueError(
            f"ref_logp is not read when config.kl={config.kl!r} (the exact KL takes ref_logits): "
            "pass one of them"
        )
    if ref_logits is None:
        return None
    ref_logits = check_logits(ref_logits, name="ref_logits")
    if tuple(ref_logits.shape) != tuple(logits.shape):
        raise ValueError(
            f"ref_logits shape {tuple(ref_logits.shape)} must equal logits shape "
            f"{tuple(logits.shape)}"
        )
    if ref_logits.device != logits.device:
        raise ValueError(f"ref_logits is on {ref_logits.device} but logits are on {logits.device}")
    ref_logits = ref_logits.detach()
    return ref_logits.unsqueeze(0) if ref_logits.dim() == 2 else ref_logits


def check_temperature(temperature: object) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a number, got {type(temperature).__name__}")
    if not (0 < temperature < float("inf")):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return float(temperature)


def check_lm_head(
    weight: object,
    bias: object,
    hidden: torch.Tensor,
    names: tuple[str, str, str] = ("weight", "bias", "hidden"),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head of `linear_policy_loss`: weight [V, H] and bias [V] (or None), on the hidden
    states' device and in their dtype (as F.linear requires). `names`: the arguments' names in
    the messages (a teacher's or reference's head has its own)."""
    weight_name, bias_name, hidden_name = names
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{weight_name} must be a torch.Tensor, got {type(weight).__name__}")
    hidden_size = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != hidden_size:
        transposed = weight.dim() == 2 and weight.shape[0] == hidden_size
        hint = f" (a transposed [H, V] head? pass {weight_name}.T)" if transposed else ""
        raise ValueError(
            f"{weight_name} must be [V, H] with H = {hidden_size} (the last dimension of "
            f"{hidden_name}), got shape {tuple(weight.shape)}{hint}"
        )
    if weight.shape[0] == 0:
        raise ValueError(f"{weight_name} has an empty vocab dimension: shape {tuple(weight.shape)}")
    for name, tensor in ((weight_name, weight), (bias_name, bias)):
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(tensor).__name__}")
        if tensor.dtype != hidden.dtype:
            raise TypeError(
                f"{name} dtype {tensor.dtype} must equal the dtype of {hidden_name} "
                f"({hidden.dtype})"
            )
        if tensor.device != hidden.device:
            raise ValueError(
                f"{name} is on {tensor.device} but {hidden_name} is on {hidden.device}"
            )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"{bias_name} shape {tuple(bias.shape)} must be ({weight.shape[0]},) (the rows of "
            f"{weight_name})"
        )
    return weight, bias


def capping_transform(softcap, logit_scale) -> LogitTransform | None:
    """The transform the backends apply for `softcap=` (with `logit_scale`, which a cap does not
    let fold into the temperature); None without a cap (the arguments checked by name)."""
    if softcap is None:
        return None
    return check_logit_transform(softcap, logit_scale)


def scaled_temperature(temperature, logit_scale):
    """The temperature with the model's logit scale s folded in: (s x) / T = x / (T / s), the
    softmax, its sampled sets and the gradient w.r.t. x alike. None: `temperature` as given."""
    if logit_scale is None:
        return temperature
    transform = check_logit_transform(None, logit_scale)  # the argument checked by name
    scale = 1.0 if transform is None else transform.scale
    if isinstance(temperature, torch.Tensor):
        if temperature.dtype == torch.bool or temperature.is_complex():
            return temperature  # refused by name where temperatures are checked
        return temperature / scale
    return check_temperature(temperature) / scale


def check_sum_pi_squared(sampling_active: bool) -> None:
    if sampling_active:
        raise NotImplementedError(
            "return_sum_pi_squared with top_k / top_p / min_p is not supported yet: the sampled "
            "set at half the temperature is not the engine's"
        )


def check_skip_masked_rows(skip: object, live_rows: object) -> bool:
    """Whether the LM-head loss walks the live rows alone (`skip_masked_rows` / `live_rows`)."""
    if not isinstance(skip, bool):
        raise TypeError(f"skip_masked_rows must be a bool, got {type(skip).__name__}")
    if live_rows is not None:
        if isinstance(live_rows, bool) or not isinstance(live_rows, int) or live_rows < 0:
            raise ValueError(
                f"live_rows must be a count of rows (an int >= 0) or None, got {live_rows!r}"
            )
        skip = True
    return skip
