"""The Triton kernels as torch custom ops: schema / fake-implementation checks and torch.compile.

Runs on CPU through the Triton interpreter; tests/test_gpu.py repeats the compile test with
inductor on a GPU.
"""

from __future__ import annotations

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, reference

from .conftest import ALL_PRESETS, make_batch, needs_interpreter, run_loss

pytestmark = needs_interpreter
triton_backend = pytest.importorskip("fusedrl.triton_backend")


def _op_args(seed=0):
    data = make_batch(batch=2, time=3, vocab=67, seed=seed)
    valid = data["mask"]
    agg = valid.float() / valid.sum()
    return data, valid, agg


def test_opcheck_logprobs_fwd():
    data, valid, _ = _op_args()
    row_temps = 0.5 + torch.rand(2, 3)  # per-token temperatures: the ops' own keyword
    torch.library.opcheck(triton_backend.logprobs_fwd, (data["logits"], data["labels"], valid, 0.9))
    torch.library.opcheck(
        triton_backend.logprobs_fwd,
        (data["logits"], data["labels"], valid, 1.0),
        {"row_temps": row_temps},
    )
    # logprobs_squares_fwd: every row's three and sum_v pi_v^2 as a fourth output
    for temps in (None, row_temps):
        torch.library.opcheck(
            triton_backend.logprobs_squares_fwd, (data["logits"], data["labels"], 0.8, temps)
        )


def test_opcheck_logits_grad():
    data, valid, _ = _op_args()
    logp, lse, entropy = triton_backend.logprobs_fwd(data["logits"], data["labels"], valid, 1.0)
    out = torch.empty_like(data["logits"])
    torch.library.opcheck(
        triton_backend.logits_grad,
        (
            data["logits"],
            data["labels"],
            lse,
            entropy,
            torch.randn(2, 3),
            torch.randn(2, 3),
            1.0,
            out,
        ),
        {"row_temps": 0.5 + torch.rand(2, 3)},
    )


def test_opcheck_fused_token_loss():
    """The fused ops as torch.compile sees them: called with a TokenLossArgs' fields by keyword
    (`TokenLossArgs.keywords`), fakes included."""
    from fusedrl.kernels.token_args import LossVariant, TokenLossArgs

    data, valid, agg = _op_args()
    low, high = torch.full((2, 3), 0.8), torch.full((2, 3), 1.28)
    variant = LossVariant(tau_neg=1.05, kl="k3", beta=0.1, entropy_coef=0.01)
    args = TokenLossArgs(
        data["labels"],
        valid,
        data["advantages"][:, None].expand(2, 3).contiguous(),
        variant,
        agg,
        None,
        data["old_logp"],
        data["ref_logp"],
        None,
        low,
        high,
    )
    logits = data["logits"]
    opcheck = torch.library.opcheck
    opcheck(triton_backend.fused_token_loss, (logits, torch.empty_like(logits)), args.keywords())
    opcheck(triton_backend.fused_token_loss_inplace, (logits.clone(),), args.keywords())
    temps = args._replace(row_temps=0.5 + torch.rand(2, 3))
    opcheck(triton_backend.fused_token_loss_inplace, (logits.clone(),), temps.keywords())
    coef = args._replace(entropy_coef_tensor=torch.tensor(0.2), mask=valid)
    opcheck(triton_backend.fused_token_loss, (logits, torch.empty_like(logits)), coef.keywords())


def test_backend_dispatch_calls_no_importlib(monkeypatch):
    """Found on the H100 (torch 2.11): dynamo refuses to trace importlib.util.find_spec, so a
    lookup of triton inside the per-call dispatch broke torch.compile(fullgraph=True) (torch 2.13
    on this machine traces it, so the test below could not see it). The lookup happens once, at
    import: the hot path runs with find_spec gone."""
    import importlib.util

    data = make_batch(batch=2, time=3, vocab=67, seed=2)

    def call():
        return fusedrl.policy_loss(
            data["logits"],
            data["labels"],
            data["advantages"],
            data["mask"],
            old_logp=data["old_logp"],
            backend="triton",
        )

    call()  # the first call imports what torch's custom ops import lazily (dynamo looks up modules)

    def no_lookup(*args, **kwargs):
        raise AssertionError("importlib.util.find_spec called on the hot path")

    monkeypatch.setattr(importlib.util, "find_spec", no_lookup)
    assert torch.isfinite(call().loss)


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_torch_compile_fullgraph(preset):
    """policy_loss inside torch.compile(fullgraph=True), every preset (the fused kernel, the
    two passes, GMPO's and VESPO's sequence objectives, the IS-corrected ones): no graph break,
    the loss, clip fraction and gradient of the oracle."""
    data = make_batch(batch=2, time=4, vocab=67, seed=1)
    cfg = LossConfig.preset(preset)
    if cfg.ratio_level == "sequence":  # (its 3e-4 / 4e-4 bounds clip both sequences: grad 0)
        cfg = cfg.replace(eps_low=0.5, eps_high=1.0)
    rollout = data["rollout_logp"] if cfg.is_correction or cfg.rejection else None
    ref = data["ref_logp"] if cfg.beta > 0 else None
    data = dict(data, rollout_logp=rollout, ref_logp=ref)

    def loss_fn(logits, labels, advantages, mask, old_logp, ref_logp, rollout_logp):
        out = fusedrl.policy_loss(
            logits,
            labels,
            advantages,
            mask,
            old_logp=old_logp,
            ref_logp=ref_logp,
            rollout_logp=rollout_logp,
            config=cfg,
            backend="triton",
        )
        return out.loss, out.metrics["clipfrac"]

    torch.compiler.reset()  # each preset compiles anew, never against the recompile limit
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    logits = data["logits"].clone().requires_grad_(True)
    loss, clipfrac = compiled(
        logits,
        data["labels"],
        data["advantages"],
        data["mask"],
        data["old_logp"],
        data["ref_logp"],
        data["rollout_logp"],
    )
    loss.backward()
    ref, ref_grad = run_loss(reference.policy_loss, data, cfg)
    torch.testing.assert_close(loss, ref.loss)
    torch.testing.assert_close(clipfrac, ref.metrics["clipfrac"])
    torch.testing.assert_close(logits.grad, ref_grad)


@pytest.mark.parametrize("preset", ["dapo", "gspo"])
def test_torch_backend_compiles_on_a_prompt_offset_slice(preset):
    """The torch backend (CPU's default) inside torch.compile(fullgraph=True) on the slice a
    trainer passes, model(...).logits[:, P - 1 : -1]: its row blocks are decided from the
    strides (a view tried under the tracer raised there), the oracle's loss and gradient."""
    data = make_batch(batch=2, time=4, vocab=67, seed=2)
    cfg = LossConfig.preset(preset)
    if cfg.ratio_level == "sequence":
        cfg = cfg.replace(eps_low=0.5, eps_high=1.0)
    full = torch.randn(2, 3 + 4 + 1, 67, generator=torch.Generator().manual_seed(2))
    full = full.requires_grad_(True)

    def loss_fn(full, labels, advantages, mask, old_logp):
        logits = full[:, 2:-2]  # [B, P+T, V] -> the completion's rows: not flat
        out = fusedrl.policy_loss(
            logits, labels, advantages, mask, old_logp=old_logp, config=cfg, backend="torch"
        )
        return out.loss, fusedrl.token_logprobs(logits.detach(), labels, backend="torch")[0]

    torch.compiler.reset()
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    args = (data["labels"], data["advantages"], data["mask"], data["old_logp"])
    loss, logp = compiled(full, *args)
    (grad,) = torch.autograd.grad(loss, full)
    ref, ref_grad = run_loss(reference.policy_loss, {**data, "logits": full[:, 2:-2]}, cfg)
    torch.testing.assert_close(loss, ref.loss)
    torch.testing.assert_close(grad[:, 2:-2], ref_grad)
    assert not full[:, 2:-2].is_contiguous() and (grad[:, :2] == 0).all()
    want, _ = reference.token_logprobs(full[:, 2:-2].detach(), data["labels"])
    torch.testing.assert_close(logp, want)


def test_opcheck_the_ops_on_rows_of_scalars():
    """The aggregation weights (a bool mask and an fp32 one: fp32 weights either way), the
    sums' finalize and the two-pass terms: each fake gives the real op's shapes and dtypes."""
    data, valid, agg = _op_args()
    for mask in (valid, valid.float() * 0.5):
        torch.library.opcheck(
            triton_backend._aggregation_weights_op, (mask, "seq-mean-token-mean", None, None, None)
        )
    partials = torch.rand(5, triton_backend._kernels().loss_sums.SUM_WIDTH.value)
    torch.library.opcheck(triton_backend.token_loss_sums, (partials,))
    from fusedrl.kernels.token_args import LossVariant, TokenLossArgs

    logp = -torch.rand(2, 3)
    rows = torch.rand(2, 3)
    for coef in (0.0, 0.01):  # dentropy [B, T] with a bonus, [0] without
        variant = LossVariant(entropy_coef=coef, low_bound=0.8, high_bound=1.2)
        args = TokenLossArgs(data["labels"], valid, rows, variant, agg, valid, logp - 0.1)
        torch.library.opcheck(
            triton_backend.sequence_terms,
            (logp, rows),
            {**args.keywords(triton_backend.SEQUENCE_FIELDS), "sequence_ratio": True, "vocab": 67},
        )


def test_opcheck_two_rows_ops():
    """The two-row kernels (exact KL, distillation) as custom ops: schemas, fakes, mutation."""
    data = make_batch(batch=2, time=3, vocab=67, seed=4)
    student, labels, valid = data["logits"], data["labels"], data["mask"]
    teacher = student + torch.randn_like(student)
    for kind, beta in (("kl", 0.0), ("kl_rev", 0.0), ("jsd", 0.3)):
        args = (student, teacher, labels, valid, 0.9, kind, beta)
        torch.library.opcheck(triton_backend.two_rows_fwd, args)
        _, lse_s, lse_q, value, aux, entropy = triton_backend.two_rows_fwd(*args)
        rows = torch.rand(labels.shape)
        torch.library.opcheck(
            triton_backend.two_rows_grad,
            (
                student,
                teacher,
                lse_s,
                lse_q,
                value,
                aux,
                rows,
                0.9,
                kind,
                beta,
                torch.empty_like(student),
                labels,
                entropy,
                rows,
                rows,
            ),
        )
        row_temps = {"row_temps": 0.5 + torch.rand(labels.shape)}  # per-token temperatures
        torch.library.opcheck(triton_backend.two_rows_fwd, args, row_temps)
        torch.library.opcheck(
            triton_backend.two_rows_grad,
            (
                student,
                teacher,
                lse_s,
                lse_q,
                value,
                aux,
                rows,
                0.9,
                kind,
                beta,
                torch.empty_like(student),
                None,
                None,
                None,
                None,
            ),
            row_temps,
        )


@pytest.mark.parametrize("kl", ["full", "full_reverse"])
def test_torch_compile_fullgraph_with_the_exact_kl(kl):
    """kl="full" through the two-row ops inside torch.compile(fullgraph=True): no graph break."""
    data = make_batch(batch=2, time=4, vocab=67, seed=3)
    ref_logits = data["logits"] + 0.5 * torch.randn_like(data["logits"])
    cfg = LossConfig.preset("dapo").replace(kl=kl, beta=0.2)

    def loss_fn(logits, labels, advantages, mask, old_logp, ref_logits):
        out = fusedrl.policy_loss(
            logits,
            labels,
            advantages,
            mask,
            old_logp=old_logp,
            config=cfg,
            backend="triton",
            ref_logits=ref_logits,
        )
        return out.loss

    args = (data["labels"], data["advantages"], data["mask"], data["old_logp"], ref_logits)
    eager_logits = data["logits"].clone().requires_grad_(True)
    eager = loss_fn(eager_logits, *args)
    (eager_grad,) = torch.autograd.grad(eager, eager_logits)
    compiled_logits = data["logits"].clone().requires_grad_(True)
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")(compiled_logits, *args)
    (compiled_grad,) = torch.autograd.grad(compiled, compiled_logits)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(compiled_grad, eager_grad)
