"""The LM-head forms of the two-distribution losses: `linear_distill_loss` and
`linear_policy_loss(ref_weight=...)` with the exact KL (fusedrl/distill/linear.py).

Each is judged by the oracle (`fusedrl.reference`) on the logits that its heads would make,
materialised here, with gradients to the student's hidden states, head and bias; on chunks of a
few rows (the chunk boundaries cut through sequences), [N, H] input with NaN padding, bf16 against
the float64 truth and float64 gradcheck; against Liger's `LigerFusedLinearJSDLoss` (its CPU path);
then the contracts: the teacher gets no gradient, an all-masked batch gives 0, misuse is named.
"""

from __future__ import annotations

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, reference
from fusedrl.distill import heads as pair

from .conftest import BACKENDS, numeric_gradient

KINDS = ("reverse_kl", "forward_kl", "jsd")


def _heads(seed=0, batch=3, time=7, hidden=16, teacher_hidden=12, vocab=131, dtype=torch.float32):
    """Student and teacher hidden states and heads (with biases), labels and a ragged mask with
    an empty sequence. The teacher's logits are the student's plus a head of their own, so the
    divergence is neither ~0 nor dominated by a few tokens."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(dtype)

    data = {
        "student_hidden": randn(batch, time, hidden),
        "student_weight": randn(vocab, hidden, scale=0.5),
        "student_bias": randn(vocab, scale=0.3),
        "teacher_hidden": randn(batch, time, teacher_hidden),
        "teacher_weight": randn(vocab, teacher_hidden, scale=0.5),
        "teacher_bias": randn(vocab, scale=0.3),
        "labels": torch.randint(0, vocab, (batch, time), generator=gen),
    }
    lengths = torch.randint(1, time + 1, (batch,), generator=gen)
    mask = torch.arange(time)[None, :] < lengths[:, None]
    mask[1] = False
    data["mask"] = mask
    return data


def _logits(hidden, weight, bias):
    return hidden @ weight.T + bias


STUDENT = ("student_hidden", "student_weight", "student_bias")


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


def _ours_distill(data, **kwargs):
    student = [data[name].clone().requires_grad_(True) for name in STUDENT]
    teacher = {
        name: data[name].clone().requires_grad_(True)
        for name in ("teacher_hidden", "teacher_weight", "teacher_bias")
    }
    out = fusedrl.linear_distill_loss(
        student[0],
        student[1],
        teacher["teacher_hidden"],
        teacher["teacher_weight"],
        data["labels"],
        data["mask"],
        student_bias=student[2],
        teacher_bias=teacher["teacher_bias"],
        **kwargs,
    )
    grads = torch.autograd.grad(out.loss, [*student, *teacher.values()], allow_unused=True)
    return out, grads[:3], grads[3:]


def _oracle_distill(data, **kwargs):
    student = [data[name].clone().requires_grad_(True) for name in STUDENT]
    teacher_logits = _logits(data["teacher_hidden"], data["teacher_weight"], data["teacher_bias"])
    out = reference.distill_loss(
        _logits(*student), teacher_logits, data["labels"], data["mask"], **kwargs
    )
    return out, _grads(out.loss, student)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 4 rows of both heads' logits: the boundaries cut through the sequences."""
    monkeypatch.setattr(pair, "PAIR_CHUNK_BYTES", 2 * 4 * 131 * 4)


def _close(got, want, atol=1e-6, rtol=1e-5):
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_linear_distill_equals_the_oracle(kind, agg, backend, small_chunks):
    data = _heads(seed=KINDS.index(kind))
    kwargs = dict(kind=kind, beta=0.4, temperature=0.8, config=LossConfig(agg=agg))
    ours, grads, teacher_grads = _ours_distill(data, backend=backend, **kwargs)
    ref, ref_grads = _oracle_distill(data, **kwargs)
    _close(ours.loss, ref.loss)
    _close(ours.logp, ref.logp)
    _close(ours.metrics["distill"], ref.metrics["distill"])
    for got, want in zip(grads, ref_grads):
        _close(got, want, atol=1e-6, rtol=1e-4)
    assert ours.metrics["distill"] > 0.05  # the divergence acted
    assert all(g is None for g in teacher_grads)  # the teacher is a target, not trained
    mask = data["mask"]
    assert (grads[0][~mask] == 0).all() and (grads[0][mask] != 0).any()


FULL_KL_CASES = {
    # token-level: one sweep (the policy's derivatives of a chunk right after its forward)
    "dapo": ("dapo", dict(temperature=0.7, entropy_coef=0.01), 1),
    # sequence-level: a forward sweep, the terms, a gradient sweep
    "gspo": ("gspo", dict(), 2),
    # on-policy DCPO: its bounds need old = logp, known after the first sweep
    "dcpo-on-policy": ("dcpo", dict(), 2),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kl", ["full", "full_reverse"])
@pytest.mark.parametrize("case", sorted(FULL_KL_CASES))
def test_linear_policy_loss_exact_kl_equals_the_oracle(
    case, kl, backend, small_chunks, monkeypatch
):
    preset, overrides, sweeps = FULL_KL_CASES[case]
    cfg = LossConfig.preset(preset, **overrides).replace(kl=kl, beta=0.3)
    data = _heads(seed=len(case))
    gen = torch.Generator().manual_seed(7)
    advantages = torch.randn(3, generator=gen)
    old = None
    if case != "dcpo-on-policy":
        with torch.no_grad():
            logits = _logits(*(data[name] for name in STUDENT))
            old = torch.log_softmax(logits / cfg.temperature, -1).gather(
                -1, data["labels"][..., None]
            )[..., 0] + 0.3 * torch.randn(3, 7, generator=gen)
    calls = []
    real_sweep = pair.pair_sweep
    monkeypatch.setattr(pair, "pair_sweep", lambda *a, **k: calls.append(1) or real_sweep(*a, **k))
    student = [data[name].clone().requires_grad_(True) for name in STUDENT]
    ours = fusedrl.linear_policy_loss(
        student[0],
        student[1],
        data["labels"],
        advantages,
        data["mask"],
        old_logp=old,
        config=cfg,
        bias=student[2],
        backend=backend,
        return_entropy=True,
        ref_weight=data["teacher_weight"],
        ref_hidden=data["teacher_hidden"],
        ref_bias=data["teacher_bias"],
    )
    grads = _grads(ours.loss, student)
    assert len(calls) == sweeps
    oracle_inputs = [data[name].clone().requires_grad_(True) for name in STUDENT]
    ref = reference.policy_loss(
        _logits(*oracle_inputs),
        data["labels"],
        advantages,
        data["mask"],
        old_logp=old,
        config=cfg,
        return_entropy=True,
        ref_logits=_logits(data["teacher_hidden"], data["teacher_weight"], data["teacher_bias"]),
    )
    ref_grads = _grads(ref.loss, oracle_inputs)
    _close(ours.loss, ref.loss, atol=1e-5)
    _close(ours.logp, ref.logp, atol=1e-5)
    _close(ours.entropy, ref.entropy, atol=1e-5)
    _close(ours.metrics["kl"], ref.metrics["kl"])
    for got, want in zip(grads, ref_grads):
        _close(got, want, atol=1e-6, rtol=1e-4)
    assert ours.metrics["kl"] > 0.05  # the KL acted


@pytest.mark.parametrize("backend", BACKENDS)
def test_reference_head_on_the_policy_body_and_flat_nan_padded_input(backend, small_chunks):
    """ref_hidden defaults to the policy's hidden states (a reference that differs in its head);
    [N, H] input whose masked rows hold NaN; no bias."""
    data = _heads(seed=3, hidden=12)
    mask = data["mask"].reshape(-1)
    hidden = data["student_hidden"].reshape(-1, 12).clone()
    hidden[~mask] = float("nan")
    labels = torch.where(mask, data["labels"].reshape(-1), -100)
    advantages = torch.randn(labels.shape, generator=torch.Generator().manual_seed(1))
    cfg = LossConfig.preset("dapo").replace(kl="full", beta=0.5)
    x = hidden.clone().requires_grad_(True)
    w = data["student_weight"].clone().requires_grad_(True)
    ours = fusedrl.linear_policy_loss(
        x,
        w,
        labels,
        advantages,
        mask,
        config=cfg,
        backend=backend,
        ref_weight=data["teacher_weight"],
    )
    grads = _grads(ours.loss, (x, w))
    x2 = torch.where(mask[:, None], hidden, 0.0).requires_grad_(True)
    w2 = data["student_weight"].clone().requires_grad_(True)
    ref = reference.policy_loss(
        x2 @ w2.T,
        labels,
        advantages,
        mask,
        config=cfg,
        ref_logits=x2.detach() @ data["teacher_weight"].T,
    )
    ref_grads = _grads(ref.loss, (x2, w2))
    assert torch.isfinite(ours.loss) and ours.logp.shape == labels.shape
    _close(ours.loss, ref.loss, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        assert torch.isfinite(got).all()
        _close(got, want, atol=1e-6, rtol=1e-4)
    assert (grads[0][~mask] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_against_the_float64_truth(backend):
    data = _heads(seed=4, dtype=torch.bfloat16)
    truth_data = {k: v.double() if v.is_floating_point() else v for k, v in data.items()}
    kwargs = dict(kind="jsd", beta=0.3, temperature=0.9)
    ours, grads, _ = _ours_distill(data, backend=backend, **kwargs)
    truth, truth_grads = _oracle_distill(truth_data, **kwargs)
    assert ours.loss.dtype == torch.float32
    # The bf16 logits are rounded once by the GEMM (as the model's own head would round them).
    _close(ours.loss.double(), truth.loss, atol=2e-2, rtol=2e-2)
    for got, want in zip(grads, truth_grads):
        err = (got.double() - want).norm() / want.norm()
        assert err < 3e-2, err


def test_float64_gradients_against_finite_differences():
    """The torch backend keeps fp64 in fp64: the analytic gradients of the student's hidden
    states, head and bias against central differences of the whole loss (gradcheck itself runs
    backward twice through one graph, which the fused losses refuse)."""
    data = _heads(seed=5, batch=2, time=3, hidden=4, teacher_hidden=3, vocab=7, dtype=torch.float64)
    data["mask"][1, 0] = True  # both sequences count
    cfg = LossConfig.preset("gspo").replace(kl="full_reverse", beta=0.4, entropy_coef=0.1)
    advantages = torch.tensor([0.7, -1.1], dtype=torch.float64)
    # a fixed old policy (on-policy, old = logp would move with every finite difference)
    old = torch.full((2, 3), -2.0, dtype=torch.float64)

    def distill(h, w, b):
        return fusedrl.linear_distill_loss(
            h,
            w,
            data["teacher_hidden"],
            data["teacher_weight"],
            data["labels"],
            data["mask"],
            kind="jsd",
            beta=0.3,
            temperature=0.8,
            student_bias=b,
            backend="torch",
        ).loss

    def policy(h, w, b):
        return fusedrl.linear_policy_loss(
            h,
            w,
            data["labels"],
            advantages,
            data["mask"],
            old_logp=old,
            config=cfg,
            bias=b,
            backend="torch",
            ref_weight=data["teacher_weight"],
            ref_hidden=data["teacher_hidden"],
        ).loss

    for loss in (distill, policy):
        leaves = [data[name].clone().requires_grad_(True) for name in STUDENT]
        analytic = _grads(loss(*leaves), leaves)
        with torch.no_grad():
            numeric = numeric_gradient(loss, [t.detach().clone() for t in leaves])
        for got, want in zip(analytic, numeric):
            assert want.abs().max() > 1e-3  # the check has something to check
            torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_equals_liger_fused_linear_jsd(beta):
    """Liger's LM-head JSD (the soft loss; its CPU path): the loss and the gradients to the
    student's hidden states and head."""
    chunked = pytest.importorskip("liger_kernel.chunked_loss")
    data = _heads(seed=6, hidden=16, teacher_hidden=16, vocab=37)
    h, w = data["student_hidden"].reshape(-1, 16), data["student_weight"]
    th, tw = data["teacher_hidden"].reshape(-1, 16), data["teacher_weight"]
    labels, mask = data["labels"].reshape(-1), data["mask"].reshape(-1)
    liger = chunked.LigerFusedLinearJSDLoss(
        weight_hard_loss=0.0, weight_soft_loss=1.0, beta=beta, temperature=0.9, compiled=False
    )
    theirs_in = (h.clone().requires_grad_(True), w.clone().requires_grad_(True))
    theirs = liger(*theirs_in, th, tw, torch.where(mask, labels, -100))
    ours_in = (h.clone().requires_grad_(True), w.clone().requires_grad_(True))
    ours = fusedrl.linear_distill_loss(
        *ours_in, th, tw, labels, mask, kind="jsd", beta=beta, temperature=0.9
    )
    _close(ours.loss, theirs)
    for got, want in zip(_grads(ours.loss, ours_in), _grads(theirs, theirs_in)):
        _close(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_masked_is_zero_with_zero_gradient(backend):
    data = _heads(seed=8)
    data["mask"][:] = False
    ours, grads, _ = _ours_distill(data, backend=backend, kind="reverse_kl")
    assert ours.loss.item() == 0.0
    assert all((g == 0).all() for g in grads)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampled_reverse_kl_equals_the_logits_form(backend):
    """kind="sampled_reverse_kl" from the heads: the same loss and gradients as distill_loss on
    the materialised logits (itself checked against the oracle in test_distill.py)."""
    data = _heads(seed=9)
    gen = torch.Generator().manual_seed(2)
    advantages, old = torch.randn(3, generator=gen), -3.0 + 0.5 * torch.randn(3, 7, generator=gen)
    kwargs = dict(
        kind="sampled_reverse_kl",
        beta=0.7,
        temperature=0.9,
        advantages=advantages,
        old_logp=old,
        config=LossConfig.preset("dapo"),
    )
    ours, grads, teacher_grads = _ours_distill(data, backend=backend, **kwargs)
    student = [data[name].clone().requires_grad_(True) for name in STUDENT]
    teacher_logits = _logits(data["teacher_hidden"], data["teacher_weight"], data["teacher_bias"])
    ref = fusedrl.distill_loss(
        _logits(*student), teacher_logits, data["labels"], data["mask"], backend="torch", **kwargs
    )
    _close(ours.loss, ref.loss)
    _close(ours.metrics["distill"], ref.metrics["distill"])
    for got, want in zip(grads, _grads(ref.loss, student)):
        _close(got, want, atol=1e-6, rtol=1e-4)
    assert all(g is None for g in teacher_grads)
    assert ours.metrics["distill"].abs() > 0.1  # the teacher term acted


def _misuse_cases():
    cfg_full = LossConfig(kl="full", beta=0.1)
    return {
        "ref_weight without the exact KL": (
            "policy",
            dict(ref_weight="teacher"),
            ValueError,
            "ref_weight / ref_hidden",
        ),
        "exact KL without ref_weight": (
            "policy",
            dict(config=cfg_full),
            ValueError,
            r"ref_weight \(the reference",
        ),
        "ref_logp beside the head": (
            "policy",
            dict(config=cfg_full, ref_weight="teacher", ref_logp=torch.zeros(3, 7)),
            ValueError,
            "ref_logp is not read",
        ),
        "tensor parallel": (
            "policy",
            dict(config=cfg_full, ref_weight="teacher", vocab_start=0),
            NotImplementedError,
            "tensor parallelism",
        ),
        "teacher vocabulary": (
            "distill",
            dict(teacher_weight=torch.zeros(130, 12)),
            ValueError,
            "teacher_weight has 130 rows",
        ),
        "teacher tokens": (
            "distill",
            dict(teacher_hidden=torch.zeros(3, 6, 12)),
            ValueError,
            "teacher_hidden shape",
        ),
        "teacher hidden dtype": (
            "distill",
            dict(teacher_hidden=torch.zeros(3, 7, 12, dtype=torch.float64)),
            TypeError,
            "teacher_hidden dtype torch.float64 must equal",
        ),
        "teacher dtype": (
            "distill",
            dict(teacher_weight=torch.zeros(131, 12, dtype=torch.float64)),
            TypeError,
            "teacher_weight dtype",
        ),
        "student head": (
            "distill",
            dict(student_weight=torch.zeros(131, 15)),
            ValueError,
            r"student_weight must be \[V, H\]",
        ),
        "backend": ("distill", dict(backend="cuda"), ValueError, "backend='cuda'"),
        "kind": ("distill", dict(kind="kl"), ValueError, "kind='kl'"),
    }


@pytest.mark.parametrize("case", sorted(_misuse_cases()))
def test_misuse_is_named(case):
    entry, changes, error, message = _misuse_cases()[case]
    data = _heads(seed=10)
    if entry == "policy":
        kwargs = {"config": LossConfig(), **changes}
        if kwargs.get("ref_weight") == "teacher":
            kwargs["ref_weight"] = data["teacher_weight"]
        with pytest.raises(error, match=message):
            fusedrl.linear_policy_loss(
                data["student_hidden"],
                data["student_weight"],
                data["labels"],
                torch.ones(3),
                data["mask"],
                **kwargs,
            )
        return
    args = {
        name: changes.get(name, data[name])
        for name in ("student_hidden", "student_weight", "teacher_hidden", "teacher_weight")
    }
    extra = {k: v for k, v in changes.items() if k not in args}
    with pytest.raises(error, match=message):
        fusedrl.linear_distill_loss(**args, labels=data["labels"], mask=data["mask"], **extra)
