"""Two distributions per token in one pass: the divergence of a student's (policy's) row from a
teacher's (reference's) row, and its gradient to the student's logits, as two Triton kernels.

Per row, with s = softmax(x / T) and q = softmax(r / T) (x the student's logits, r the teacher's):

    KIND 0 (kl)      D = KL(s || q) = sum s (log s - log q)      dD/dx = s (log s - log q - D) / T
    KIND 1 (kl_rev)  D = KL(q || s) = sum q (log q - log s)      dD/dx = (s - q) / T
    KIND 2 (jsd)     D = beta KL(q || m) + (1 - beta) KL(s || m),  m = beta q + (1 - beta) s
                     dD/dx = s (g - sum s g) / T,  g = (1 - beta) (log s - log m)

- `two_rows_forward` (one program per row): sweep 1 reads both rows once and keeps, per element
  slot, each row's running (max, sum 2^(y - max)) and the expectations E_s[y_s], E_s[y_q],
  E_q[y_q - y_s], all in base 2 (y = x log2(e) / T): lse of both rows, the student's entropy
  and the KLs come out of the one read. jsd needs both lse's before it can form log m, so a
  second sweep (the row pair again, from L2) sums D and sum s g. Outputs per row: the
  student's logp of its label, both lse's, D, sum s g and the student's entropy.
- `two_rows_backward` (one program per row): reads both rows once and writes w (dD/dx) where w is
  the row's d(loss)/dD; with WITH_POLICY (a policy loss with the exact KL to its reference,
  kl="full" / "full_reverse") also the policy's own terms, dlogp (onehot - s) / T and the
  entropy bonus's dH dH/dx, so that the whole gradient is one write. Rows with nothing to write
  get zeros without a read. The output may be the student's logits (in place): each thread reads
  its elements before it writes them, and the label's one-hot is added where its element is,
  with no gather of the label's logit that another thread could have overwritten.

Floors: 2R + 1W of [N, V] for the forward + backward (3R + 1W for jsd when the rows in flight
overflow L2). Their SASS budgets are not the row sweeps' (two loads per element, more state per
slot); they are compiled for every target like the others, and timed on the GPU by
bench_loss.py's two-logit rows once the GPU issue runs them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .device import launches_on
from .launch import MAX_REGISTERS_PER_THREAD, REGISTERS_PER_SM, fast_exp2, next_power_of_2
from .rows import (
    LN2,
    LOG2E,
    accumulate_weighted,
    banned,
    cap_arg,
    capped,
    exp2,
    row_offset,
    row_temperature,
    row_temperature_arg,
    scaled,
)

KIND_CODES = {"kl": 0, "kl_rev": 1, "jsd": 2}
KIND_KL = tl.constexpr(KIND_CODES["kl"])  # KL(s || q), weighted by the student's row
KIND_KL_REV = tl.constexpr(KIND_CODES["kl_rev"])  # KL(q || s), weighted by the teacher's row
KIND_JSD = tl.constexpr(KIND_CODES["jsd"])
# Two rows per element and up to six running sums per slot: a tile of 2048 elements (8 warps, 8
# bf16 per thread, one 16-byte load of each row) keeps the state within 128 registers, two
# programs per SM. Interpreted: small tiles, so that test vocabularies take several.
GPU_BLOCK_V = 2048
WARPS = 8
PROGRAMS_PER_SM = 2
INTERPRETED_BLOCK_V = 128
# Its loops read two rows: the row sweeps' per-element budgets do not describe them.
KERNEL_FAMILY = "two_rows"


def block_size(vocab: int, device: torch.device, elem_bytes: int = 2) -> int:
    cap = GPU_BLOCK_V if device.type == "cuda" else INTERPRETED_BLOCK_V
    return min(next_power_of_2(vocab), cap)


def max_registers(warps: int) -> int:
    return min(MAX_REGISTERS_PER_THREAD, REGISTERS_PER_SM // (PROGRAMS_PER_SM * 32 * warps))


def launch_options(block: int, elem_bytes: int = 2) -> dict[str, int]:
    return {"num_warps": WARPS, "maxnreg": max_registers(WARPS)}


@triton.jit
def _load_pair(
    s_row,
    q_row,
    start,
    vocab,
    scale2,
    cap2,
    KIND: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FAST_EXP2: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """(y_s, y_q, in_row, r_s, unbounded) of one tile of both rows: y = x log2(e) / T in fp32,
    clamped below at FLOOR (a -inf logit weighs 0 without a NaN; off the row: FLOOR too). With
    SOFTCAP both rows are read as tanh(a x) (`rows.capped`) and r_s is the student's r
    (d tanh(a x) / dx = 4 a r (1 - r)); else r_s is 0. `unbounded`: the elements where the KL's
    weighting row can emit a token (a logit that is not `banned`: its probability is > 0,
    however small it rounds) that the other row bans, which make the KL +inf (FLOOR would make
    it a large finite number instead); none for jsd (its mixture bans nothing either row
    emits)."""
    offs = start + tl.arange(0, BLOCK_V)
    in_row = offs < vocab
    xs = tl.load(s_row + offs, mask=in_row, other=-float("inf"))
    xq = tl.load(q_row + offs, mask=in_row, other=-float("inf"))
    r_s = 0.0
    if SOFTCAP:
        xs, r_s = capped(xs, cap2, FAST_EXP2)
        xq, _ = capped(xq, cap2, FAST_EXP2)
    if KIND == KIND_KL:
        unbounded = banned(xq) & ~banned(xs)
    elif KIND == KIND_KL_REV:
        unbounded = banned(xs) & ~banned(xq)
    else:
        unbounded = in_row & False
    return scaled(xs, scale2), scaled(xq, scale2), in_row, r_s, unbounded


@triton.jit
def _accumulate_two(run_max, total, sum_a, sum_b, y, a, FAST_EXP2: tl.constexpr):
    """`accumulate_weighted` with two running sums off one exp2: 2^(y - max) y and
    2^(y - max) a."""
    diff = y - run_max
    new_max = diff > 0
    t = exp2(-tl.abs(diff), FAST_EXP2)
    total = tl.where(new_max, total * t + 1.0, total + t)
    sum_a = tl.where(new_max, sum_a * t + y, sum_a + t * y)
    sum_b = tl.where(new_max, sum_b * t + a, sum_b + t * a)
    return tl.maximum(run_max, y), total, sum_a, sum_b


@triton.jit
def _merge(run_max, total, weighted, FAST_EXP2: tl.constexpr):
    """(lse2, E[w]) of a row from its slots (slots that saw nothing weigh 0)."""
    row_max = tl.max(run_max, axis=0)
    scale = tl.where(run_max == -float("inf"), 0.0, exp2(run_max - row_max, FAST_EXP2))
    sum_total = tl.sum(total * scale, axis=0)
    return row_max + tl.log2(sum_total), tl.sum(weighted * scale, axis=0) / sum_total


@triton.jit
def _log2_mixture(ls2, lq2, log2_beta, log2_rest):
    """log2(beta q + (1 - beta) s) from base-2 log-probs, shifted by their max."""
    a = lq2 + log2_beta
    b = ls2 + log2_rest
    top = tl.maximum(a, b)
    return top + tl.log2(tl.exp2(a - top) + tl.exp2(b - top))


@triton.jit
def _two_rows_fwd_kernel(
    s_ptr,
    q_ptr,
    labels_ptr,
    valid_ptr,
    logp_ptr,
    lse_s_ptr,
    lse_q_ptr,
    value_ptr,
    aux_ptr,
    entropy_ptr,
    temperature_ptr,
    time,
    vocab,
    s_stride_b,
    s_stride_t,
    q_stride_b,
    q_stride_t,
    scale2,
    beta,
    log2_beta,
    log2_rest,
    cap2,
    KIND: tl.constexpr,
    HAS_VALID: tl.constexpr,
    ROW_TEMPERATURE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FAST_EXP2: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    valid = 1
    if HAS_VALID:
        valid = tl.load(valid_ptr + row)
    if valid != 0:
        # (the 1 / T it also returns is not needed here)
        unused_inv_t, row_scale2 = row_temperature(
            temperature_ptr, row, scale2, scale2, ROW_TEMPERATURE
        )
        s_row = s_ptr + row_offset(row, time, s_stride_b, s_stride_t)
        q_row = q_ptr + row_offset(row, time, q_stride_b, q_stride_t)
        max_s = tl.full([BLOCK_V], -float("inf"), tl.float32)
        max_q = tl.full([BLOCK_V], -float("inf"), tl.float32)
        total_s = tl.zeros([BLOCK_V], tl.float32)
        total_q = tl.zeros([BLOCK_V], tl.float32)
        own_s = tl.zeros([BLOCK_V], tl.float32)  # sum 2^(y_s - max) y_s: E_s[y_s], the entropy
        other_s = tl.zeros([BLOCK_V], tl.float32)  # sum 2^(y_s - max) y_q: E_s[y_q]
        cross_q = tl.zeros([BLOCK_V], tl.float32)  # sum 2^(y_q - max) (y_q - y_s): E_q
        unbounded_seen = tl.zeros([BLOCK_V], tl.int32)
        for start in range(0, vocab, BLOCK_V):
            ys, yq, unused_in_row, unused_r, unbounded = _load_pair(
                s_row, q_row, start, vocab, row_scale2, cap2, KIND, SOFTCAP, FAST_EXP2, BLOCK_V
            )
            unbounded_seen |= unbounded.to(tl.int32)
            max_s, total_s, own_s, other_s = _accumulate_two(
                max_s, total_s, own_s, other_s, ys, yq, FAST_EXP2
            )
            max_q, total_q, cross_q = accumulate_weighted(
                max_q, total_q, cross_q, yq, yq - ys, FAST_EXP2
            )
        lse2_s, mean_ys = _merge(max_s, total_s, own_s, FAST_EXP2)
        _, mean_yq = _merge(max_s, total_s, other_s, FAST_EXP2)
        lse2_q, mean_q = _merge(max_q, total_q, cross_q, FAST_EXP2)
        aux = 0.0
        if KIND == KIND_KL:
            value = (mean_ys - mean_yq - lse2_s + lse2_q) * LN2
        elif KIND == KIND_KL_REV:
            value = (mean_q - lse2_q + lse2_s) * LN2
        if KIND != KIND_JSD:
            value = tl.where(tl.max(unbounded_seen, axis=0) > 0, float("inf"), value)
        else:
            # log m needs both lse's: a second sweep over the pair
            sum_d = tl.zeros([BLOCK_V], tl.float32)
            sum_sg = tl.zeros([BLOCK_V], tl.float32)
            for start in range(0, vocab, BLOCK_V):
                ys, yq, in_row, unused_r, unused_unbounded = _load_pair(
                    s_row,
                    q_row,
                    start,
                    vocab,
                    row_scale2,
                    cap2,
                    KIND,
                    SOFTCAP,
                    FAST_EXP2,
                    BLOCK_V,
                )
                ls2 = ys - lse2_s
                lq2 = yq - lse2_q
                lm2 = _log2_mixture(ls2, lq2, log2_beta, log2_rest)
                ps = tl.where(in_row, tl.exp2(ls2), 0.0)
                pq = tl.where(in_row, tl.exp2(lq2), 0.0)
                sum_d += beta * pq * (lq2 - lm2) + (1.0 - beta) * ps * (ls2 - lm2)
                sum_sg += ps * (1.0 - beta) * (ls2 - lm2)
            value = tl.sum(sum_d, axis=0) * LN2
            aux = tl.sum(sum_sg, axis=0) * LN2
        label_x = tl.load(s_row + tl.load(labels_ptr + row))
        if SOFTCAP:
            label_x, _ = capped(label_x, cap2, FAST_EXP2)
        label_y = scaled(label_x, row_scale2)
        tl.store(logp_ptr + row, (label_y - lse2_s) * LN2)
        tl.store(lse_s_ptr + row, lse2_s * LN2)
        tl.store(lse_q_ptr + row, lse2_q * LN2)
        tl.store(value_ptr + row, value)
        tl.store(aux_ptr + row, aux)
        tl.store(entropy_ptr + row, (lse2_s - mean_ys) * LN2)
    else:
        tl.store(logp_ptr + row, 0.0)
        tl.store(lse_s_ptr + row, 0.0)
        tl.store(lse_q_ptr + row, 0.0)
        tl.store(value_ptr + row, 0.0)
        tl.store(aux_ptr + row, 0.0)
        tl.store(entropy_ptr + row, 0.0)


@triton.jit
def _two_rows_grad_kernel(
    s_ptr,
    q_ptr,
    out_ptr,
    lse_s_ptr,
    lse_q_ptr,
    value_ptr,
    aux_ptr,
    weight_ptr,
    labels_ptr,
    entropy_ptr,
    dlogp_ptr,
    dentropy_ptr,
    temperature_ptr,
    time,
    vocab,
    s_stride_b,
    s_stride_t,
    q_stride_b,
    q_stride_t,
    out_stride_b,
    out_stride_t,
    scale2,
    inv_temperature,
    log2_beta,
    log2_rest,
    one_minus_beta,
    cap2,
    KIND: tl.constexpr,
    WITH_POLICY: tl.constexpr,
    ROW_TEMPERATURE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    out_row = out_ptr + row_offset(row, time, out_stride_b, out_stride_t)
    weight = tl.load(weight_ptr + row)
    offs = tl.arange(0, BLOCK_V)
    dlogp = 0.0
    dentropy = 0.0
    if WITH_POLICY:
        dlogp = tl.load(dlogp_ptr + row)
        dentropy = tl.load(dentropy_ptr + row)
    if (weight != 0) | (dlogp != 0) | (dentropy != 0):
        row_inv_t, row_scale2 = row_temperature(
            temperature_ptr, row, inv_temperature, scale2, ROW_TEMPERATURE
        )
        s_row = s_ptr + row_offset(row, time, s_stride_b, s_stride_t)
        q_row = q_ptr + row_offset(row, time, q_stride_b, q_stride_t)
        lse2_s = tl.load(lse_s_ptr + row) * LOG2E
        lse2_q = tl.load(lse_q_ptr + row) * LOG2E
        value = tl.load(value_ptr + row)
        aux = tl.load(aux_ptr + row)
        factor = weight * row_inv_t
        label = 0
        entropy = 0.0
        if WITH_POLICY:
            # The label's one-hot is added where its element is: no gather of the label's logit,
            # so in place no thread reads an element another one has overwritten.
            label = tl.load(labels_ptr + row)
            entropy = tl.load(entropy_ptr + row)
        # KL(s || q) = +inf has no derivative in x: its rows get NaN where the loss weighs them
        # (KL(q || s)'s (s - q) / T stays the exact, finite derivative of its +inf)
        undefined = (KIND == KIND_KL) & (value == float("inf")) & (weight != 0)
        value = tl.where(value == float("inf"), 0.0, value)
        for start in range(0, vocab, BLOCK_V):
            ys, yq, in_row, r_s, unused_unbounded = _load_pair(
                s_row, q_row, start, vocab, row_scale2, cap2, KIND, SOFTCAP, False, BLOCK_V
            )
            ls2 = ys - lse2_s
            lq2 = yq - lse2_q
            ps = tl.exp2(ls2)
            if KIND == KIND_KL:
                grad = ps * ((ls2 - lq2) * LN2 - value)
            elif KIND == KIND_KL_REV:
                grad = ps - tl.exp2(lq2)
            else:
                lm2 = _log2_mixture(ls2, lq2, log2_beta, log2_rest)
                grad = ps * (one_minus_beta * (ls2 - lm2) * LN2 - aux)
            grad = tl.where(undefined, float("nan"), factor * grad)
            if WITH_POLICY:
                # d logp / dx = (onehot - s) / T; d H / dx = -s (log s + H) / T
                onehot = tl.where(start + offs == label, 1.0, 0.0)
                policy = dlogp * (onehot - ps) - dentropy * ps * (ls2 * LN2 + entropy)
                grad += policy * row_inv_t
            if SOFTCAP:  # d/dx = d/dv 4 a r (1 - r), 4 a = cap2 2 ln(2)
                grad = grad * ((r_s - r_s * r_s) * (cap2 * (2.0 * LN2)))
            tl.store(out_row + start + offs, grad.to(out_ptr.dtype.element_ty), mask=in_row)
    else:
        zeros = tl.zeros([BLOCK_V], out_ptr.dtype.element_ty)
        for start in range(0, vocab, BLOCK_V):
            tl.store(out_row + start + offs, zeros, mask=start + offs < vocab)


def _mixture_args(kind: str, beta: float) -> tuple[float, float, float]:
    """(beta, log2 beta, log2 (1 - beta)) of jsd; placeholders (never read) otherwise."""
    if kind != "jsd":
        return 0.0, 0.0, 0.0
    return beta, math.log2(beta), math.log2(1.0 - beta)


@launches_on("student")
def two_rows_forward(
    student: torch.Tensor,
    teacher: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor | None,
    temperature: float,
    kind: str,
    beta: float = 0.5,
    row_temps: torch.Tensor | None = None,
    cap: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """[B, T, V] student and teacher logits (vocab contiguous, any batch/time strides) ->
    (student logp of labels, lse of student, lse of teacher, D, sum s g, student entropy), each
    [B, T] fp32. `kind`: "kl", "kl_rev" or "jsd" (0 < beta < 1). Masked rows (valid == 0) get
    zeros. `row_temps`: [B, T] per-token temperatures, in place of `temperature`. `cap`: a soft
    cap's a = s / c: both rows read as tanh(a x) (`rows.capped`) at `temperature` T / c."""
    batch, time, vocab = student.shape
    outs = tuple(
        torch.empty(batch, time, dtype=torch.float32, device=student.device) for _ in range(6)
    )
    if batch * time == 0:
        return outs
    block = block_size(vocab, student.device, student.element_size())
    labels = labels.contiguous()
    valid_arg = valid.to(torch.int8).contiguous() if valid is not None else labels
    beta, log2_beta, log2_rest = _mixture_args(kind, beta)
    _two_rows_fwd_kernel[(batch * time,)](
        student,
        teacher,
        labels,
        valid_arg,
        *outs,
        row_temperature_arg(row_temps, outs[0]),
        time,
        vocab,
        student.stride(0),
        student.stride(1),
        teacher.stride(0),
        teacher.stride(1),
        LOG2E.value / temperature,
        beta,
        log2_beta,
        log2_rest,
        cap_arg(cap),
        KIND=KIND_CODES[kind],
        HAS_VALID=valid is not None,
        ROW_TEMPERATURE=row_temps is not None,
        SOFTCAP=cap is not None,
        FAST_EXP2=fast_exp2(student.device),
        BLOCK_V=block,
        **launch_options(block, student.element_size()),
    )
    return outs


@launches_on("student")
def two_rows_backward(
    student: torch.Tensor,
    teacher: torch.Tensor,
    lse_s: torch.Tensor,
    lse_q: torch.Tensor,
    value: torch.Tensor,
    aux: torch.Tensor,
    weight: torch.Tensor,
    temperature: float,
    kind: str,
    beta: float,
    out: torch.Tensor,
    labels: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    dlogp: torch.Tensor | None = None,
    dentropy: torch.Tensor | None = None,
    row_temps: torch.Tensor | None = None,
    cap: float | None = None,
) -> None:
    """out[b, t] = weight[b, t] dD/d(student[b, t]) ([B, T, V]; out may be `student`). With
    `dlogp` (and labels, the forward's entropy, and dentropy or None), plus the policy loss's own
    terms dlogp (onehot - s) / T + dentropy dH/dx: the whole gradient of a policy loss with the
    exact KL in one pass over both rows. `row_temps`: per-token temperatures, `cap`: a soft
    cap, as forward."""
    batch, time, vocab = student.shape
    if batch * time == 0:
        return
    block = block_size(vocab, student.device, student.element_size())
    beta, log2_beta, log2_rest = _mixture_args(kind, beta)
    with_policy = dlogp is not None
    if with_policy:
        dlogp = dlogp.float().contiguous()
        dentropy = torch.zeros_like(dlogp) if dentropy is None else dentropy.float().contiguous()
        labels, entropy = labels.contiguous(), entropy.contiguous()
    else:  # placeholders, never read
        labels = entropy = dlogp = dentropy = weight
    _two_rows_grad_kernel[(batch * time,)](
        student,
        teacher,
        out,
        lse_s.contiguous(),
        lse_q.contiguous(),
        value.contiguous(),
        aux.contiguous(),
        weight.float().contiguous(),
        labels,
        entropy,
        dlogp,
        dentropy,
        row_temperature_arg(row_temps, weight),
        time,
        vocab,
        student.stride(0),
        student.stride(1),
        teacher.stride(0),
        teacher.stride(1),
        out.stride(0),
        out.stride(1),
        LOG2E.value / temperature,
        1.0 / temperature,
        log2_beta,
        log2_rest,
        1.0 - beta,
        cap_arg(cap),
        KIND=KIND_CODES[kind],
        WITH_POLICY=with_policy,
        ROW_TEMPERATURE=row_temps is not None,
        SOFTCAP=cap is not None,
        BLOCK_V=block,
        **launch_options(block, student.element_size()),
    )
