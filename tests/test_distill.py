"""`fusedrl.distill_loss`: the student-teacher divergence over the vocabulary, in one pass.

Against the peers on the same inputs (Liger's `LigerFusedLinearJSDLoss` through its CPU path
here; TRL's `GKDTrainer.generalized_jsd_loss` in tests/test_trl_integration.py, beside the rest of
TRL's imports), against the oracle (`fusedrl.reference`, written
from the probabilities: it never forms log-softmax mixtures) on every aggregation, in place,
[N, V] input, NaN padding and bf16 against the float64 truth; then the contracts.
"""

from __future__ import annotations

import math

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, reference

from .conftest import BACKENDS

KINDS = ("reverse_kl", "forward_kl", "jsd")
# The torch backend's row blocks, and the two-row Triton kernels (interpreted: tiles of 128, so
# the test vocabulary of 131 takes a full and a partial one).


def _inputs(seed=0, batch=3, time=7, vocab=131, dtype=torch.float32, nan_padding=False):
    gen = torch.Generator().manual_seed(seed)
    student = 2.0 * torch.randn(batch, time, vocab, generator=gen)
    teacher = student + 1.5 * torch.randn(batch, time, vocab, generator=gen)
    labels = torch.randint(0, vocab, (batch, time), generator=gen)
    lengths = torch.randint(1, time + 1, (batch,), generator=gen)
    mask = torch.arange(time)[None, :] < lengths[:, None]
    mask[1] = False  # an empty sequence
    if nan_padding:
        student[~mask] = float("nan")
        teacher[~mask] = float("nan")
        labels[~mask] = -100
    return student.to(dtype), teacher.to(dtype), labels, mask


def _run(fn, student, *args, **kwargs):
    x = student.clone().requires_grad_(True)
    out = fn(x, *args, **kwargs)
    (grad,) = torch.autograd.grad(out.loss, x)
    return out, grad


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_equals_liger_fused_linear_jsd(beta):
    """Liger's LM-head JSD (soft loss only, its CPU path) on the same hidden states and heads:
    the logits made by the same matmuls, the loss and the gradients to hidden and weight."""
    chunked = pytest.importorskip("liger_kernel.chunked_loss")
    gen = torch.Generator().manual_seed(5)
    tokens, hidden, vocab = 13, 16, 37
    h_student = torch.randn(tokens, hidden, generator=gen)
    w_student = torch.randn(vocab, hidden, generator=gen) / 2
    h_teacher = torch.randn(tokens, hidden, generator=gen)
    w_teacher = torch.randn(vocab, hidden, generator=gen) / 2
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    mask = torch.rand(tokens, generator=gen) > 0.3
    temperature = 0.9
    liger = chunked.LigerFusedLinearJSDLoss(
        weight_hard_loss=0.0,
        weight_soft_loss=1.0,
        beta=beta,
        temperature=temperature,
        compiled=False,
    )
    theirs_h, theirs_w = h_student.clone().requires_grad_(), w_student.clone().requires_grad_()
    theirs = liger(theirs_h, theirs_w, h_teacher, w_teacher, torch.where(mask, labels, -100))
    their_grads = torch.autograd.grad(theirs, (theirs_h, theirs_w))
    ours_h, ours_w = h_student.clone().requires_grad_(), w_student.clone().requires_grad_()
    ours = fusedrl.distill_loss(
        ours_h @ ours_w.T,
        h_teacher @ w_teacher.T,
        labels,
        mask,
        kind="jsd",
        beta=beta,
        temperature=temperature,
    )
    our_grads = torch.autograd.grad(ours.loss, (ours_h, ours_w))
    torch.testing.assert_close(ours.loss, theirs, atol=1e-6, rtol=1e-5)
    for got, want in zip(our_grads, their_grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_oracle_is_the_definition_on_one_row():
    student = torch.tensor([[[1.0, 0.0, -2.0]]], dtype=torch.float64)
    teacher = torch.tensor([[[0.0, 2.0, 0.5]]], dtype=torch.float64)
    s = torch.softmax(student[0, 0], -1).tolist()
    q = torch.softmax(teacher[0, 0], -1).tolist()

    def kl(a, b):
        return sum(x * math.log(x / y) for x, y in zip(a, b))

    m = [0.25 * y + 0.75 * x for x, y in zip(s, q)]
    jsd = 0.25 * kl(q, m) + 0.75 * kl(s, m)
    want = {"reverse_kl": kl(s, q), "forward_kl": kl(q, s), "jsd": jsd}
    for kind, value in want.items():
        got = reference.distill_divergence(student, teacher, kind, 0.25, 1.0)
        assert got.item() == pytest.approx(value, rel=1e-12), kind


AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("agg", AGGS)
def test_backend_equals_the_oracle(kind, agg, backend):
    student, teacher, labels, mask = _inputs(seed=AGGS.index(agg))
    cfg = LossConfig(agg=agg)
    kwargs = dict(kind=kind, beta=0.4, temperature=0.8, config=cfg)
    ref, ref_grad = _run(reference.distill_loss, student, teacher, labels, mask, **kwargs)
    ours, grad = _run(
        fusedrl.distill_loss, student, teacher, labels, mask, backend=backend, **kwargs
    )
    torch.testing.assert_close(ours.loss, ref.loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(ours.logp, ref.logp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(
        ours.metrics["distill"], ref.metrics["distill"], atol=1e-6, rtol=1e-5
    )
    assert ours.metrics["distill"] > 0.05  # the divergence acted
    assert (grad[~mask] == 0).all() and (grad[mask] != 0).any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_in_place_flat_nan_padding_and_blocks(kind, backend, monkeypatch):
    from fusedrl import row_blocks

    monkeypatch.setattr(row_blocks, "BLOCK_ELEMENTS", 4 * 131)  # blocks split sequences
    student, teacher, labels, mask = _inputs(seed=3, nan_padding=True)
    kwargs = dict(kind=kind, beta=0.6, temperature=1.2, backend=backend)
    ref, ref_grad = _run(reference.distill_loss, student, teacher, labels, mask, **kwargs)
    x = student.clone().requires_grad_(True)
    work = x.clone()
    out = fusedrl.distill_loss(work, teacher, labels, mask, inplace=True, **kwargs)
    (grad,) = torch.autograd.grad(out.loss, x)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-7, rtol=1e-5)
    assert torch.isfinite(grad).all() and torch.isfinite(out.loss)

    ones = torch.ones(int(mask.sum()), dtype=torch.bool)
    flat = (student[mask], teacher[mask], labels[mask], ones)
    ours_flat, flat_grad = _run(fusedrl.distill_loss, *flat, **kwargs)
    ref_flat, ref_flat_grad = _run(reference.distill_loss, *flat, **kwargs)
    torch.testing.assert_close(ours_flat.loss, ref.loss, atol=1e-6, rtol=1e-5)  # token-mean
    torch.testing.assert_close(flat_grad, ref_flat_grad, atol=1e-7, rtol=1e-5)
    assert ours_flat.logp.shape == (int(mask.sum()),)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_against_the_float64_truth(kind, backend):
    student, teacher, labels, mask = _inputs(seed=9, dtype=torch.bfloat16)
    kwargs = dict(kind=kind, beta=0.5)
    exact, exact_grad = _run(
        reference.distill_loss, student.double(), teacher.double(), labels, mask, **kwargs
    )
    ours, grad = _run(
        fusedrl.distill_loss, student, teacher, labels, mask, backend=backend, **kwargs
    )
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(ours.loss.double(), exact.loss, atol=2e-5, rtol=2e-5)
    # one bf16 rounding of the gradient (the interpreter rounds toward zero: a whole ulp)
    ulp = 2**-8 if backend == "torch" else 2**-7
    torch.testing.assert_close(grad.double(), exact_grad, atol=1e-6, rtol=ulp)


# Banned columns (-inf) each kind takes with a finite divergence: in the student, the teacher,
# or both (a reverse KL over a token the teacher bans, or a forward one over a token the student
# bans, is infinite).
BANS = {"reverse_kl": ("student", "both"), "forward_kl": ("teacher", "both"), "jsd": None}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_banned_tokens(kind, backend):
    """-inf logits in the student, the teacher or both: finite, the oracle's loss and gradient
    (its 0 log 0 terms with finite derivatives), and 0 at a column the student bans."""
    student, teacher, labels, mask = _inputs(seed=11)
    columns = {"student": 3, "teacher": 7, "both": 0}
    bans = BANS[kind] or tuple(columns)
    for side in bans:
        if side in ("student", "both"):
            student[..., columns[side]] = -float("inf")
        if side in ("teacher", "both"):
            teacher[..., columns[side]] = -float("inf")
    labels[labels == columns["student"]] = 1  # a label the student bans is another test's
    kwargs = dict(kind=kind, beta=0.4)
    ref, ref_grad = _run(reference.distill_loss, student, teacher, labels, mask, **kwargs)
    ours, grad = _run(
        fusedrl.distill_loss, student, teacher, labels, mask, backend=backend, **kwargs
    )
    assert torch.isfinite(ref.loss) and torch.isfinite(ref_grad).all()
    torch.testing.assert_close(ours.loss, ref.loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-7, rtol=1e-5)
    for side in bans:
        if side in ("student", "both"):
            assert (grad[..., columns[side]] == 0).all()


def test_oracle_gradcheck():
    gen = torch.Generator().manual_seed(1)
    student = torch.randn(1, 2, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    teacher = torch.randn(1, 2, 5, dtype=torch.float64, generator=gen)
    for kind in KINDS:
        assert torch.autograd.gradcheck(
            lambda x, k=kind: reference.distill_divergence(x, teacher, k, 0.3, 1.1), (student,)
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_masked_is_zero_and_the_teacher_gets_no_gradient(backend):
    student, teacher, labels, mask = _inputs(seed=2)
    teacher = teacher.requires_grad_(True)
    out, grad = _run(
        fusedrl.distill_loss, student, teacher, labels, torch.zeros_like(mask), backend=backend
    )
    assert out.loss.item() == 0.0 and out.metrics["distill"].item() == 0.0
    assert (grad == 0).all()
    out, _ = _run(fusedrl.distill_loss, student, teacher, labels, mask)
    assert not out.loss.requires_grad or teacher.grad is None
    with pytest.raises(RuntimeError):  # the teacher is not in the graph
        torch.autograd.grad(out.loss, teacher)


def test_a_teacher_equal_to_the_student_gives_zero():
    student, _, labels, mask = _inputs(seed=4)
    for kind in KINDS:
        out, grad = _run(fusedrl.distill_loss, student, student.clone(), labels, mask, kind=kind)
        assert abs(out.loss.item()) < 1e-6 and grad.abs().max() < 1e-6


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(kind="kl"), ValueError, "kind='kl' is not one of"),
        (dict(kind="jsd", beta=1.5), ValueError, "beta must be in \\[0, 1\\]"),
        (dict(beta=float("nan")), ValueError, "beta must be a finite number"),
        (dict(temperature=0.0), ValueError, "temperature must be a finite number > 0"),
        (dict(backend="cuda"), ValueError, "backend='cuda' is not one of"),
        (dict(config=LossConfig(temperature=0.7)), ValueError, "takes its temperature as an"),
        (dict(teacher_shape=(3, 7, 130)), ValueError, "teacher_logits shape .* must equal"),
        (dict(teacher_dtype=torch.int32), TypeError, "teacher_logits must be a floating"),
        (dict(labels_shape=(3, 6)), ValueError, "labels shape"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, message):
    student, teacher, labels, mask = _inputs(seed=1)
    if "teacher_shape" in kwargs:
        teacher = torch.zeros(kwargs.pop("teacher_shape"))
    if "teacher_dtype" in kwargs:
        teacher = teacher.to(kwargs.pop("teacher_dtype"))
    if "labels_shape" in kwargs:
        labels = torch.zeros(kwargs.pop("labels_shape"), dtype=torch.long)
    with pytest.raises(error, match=message):
        fusedrl.distill_loss(student, teacher, labels, mask, **kwargs)


# ------------------------------------------------------------------ kind="sampled_reverse_kl"
def _sampled_inputs(seed=5):
    student, teacher, labels, mask = _inputs(seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        logp = torch.log_softmax(student, -1).gather(-1, labels[..., None]).squeeze(-1)
    old = logp + 0.3 * torch.randn(logp.shape, generator=gen)
    advantages = torch.randn(labels.shape[0], generator=gen)
    return student, teacher, labels, mask, old, advantages


@pytest.mark.parametrize("backend", BACKENDS)
def test_soft_capped_student_and_teacher(backend):
    """distill_loss(softcap=c, logit_scale=s): both models' raw logits capped as the kernels
    read them (the two-row kernels' SOFTCAP; torch's blocks), per-token temperatures, NaN
    padding; reverse KL, jsd and the sampled reverse KL, against the oracle
    (whose cap is the formula, checked here) and far from the uncapped loss."""
    student, teacher, labels, mask = _inputs(seed=41, nan_padding=True)
    student, teacher = 2.0 * student, 2.0 * teacher  # |s x| well past the cap of 3
    temps = 0.6 + torch.rand(labels.shape, generator=torch.Generator().manual_seed(2))
    cap = dict(softcap=3.0, logit_scale=1.3)
    capped = [reference._model_logits(t, 1.3, 3.0) for t in (student, teacher)]
    direct = reference.distill_loss(*capped, labels, mask, temperature=temps).loss
    torch.testing.assert_close(  # the oracle's own cap is the formula
        reference.distill_loss(student, teacher, labels, mask, temperature=temps, **cap).loss,
        direct,
    )
    old = reference.distill_loss(student, teacher, labels, mask, temperature=temps, **cap).logp
    cases = (
        dict(kind="reverse_kl", temperature=temps),
        dict(kind="jsd", beta=0.3, temperature=0.8),
        dict(
            kind="sampled_reverse_kl",
            beta=0.7,
            config=LossConfig.preset("dapo"),
            old_logp=old + 0.1,
        ),
    )
    for kwargs in cases:
        ref, ref_grad = _run(
            reference.distill_loss, student, teacher, labels, mask, **kwargs, **cap
        )
        ours, grad = _run(
            fusedrl.distill_loss, student, teacher, labels, mask, **kwargs, **cap, backend=backend
        )
        torch.testing.assert_close(ours.loss, ref.loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad, ref_grad, atol=1e-7, rtol=1e-5)
        assert ref_grad.abs().max() > 1e-4 and (grad[~mask] == 0).all()
        plain = fusedrl.distill_loss(student, teacher, labels, mask, **kwargs, backend=backend)
        assert (plain.loss - ours.loss).abs() > 1e-2  # the cap acted


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset", ["dapo", "gspo", "pg"])
def test_sampled_reverse_kl_equals_the_oracle(preset, backend):
    """The teacher's log-ratio on the sampled tokens as a negative advantage, with the RL
    advantages and the preset's policy loss, against the oracle's composition."""
    student, teacher, labels, mask, old, advantages = _sampled_inputs()
    cfg = LossConfig(loss="pg") if preset == "pg" else LossConfig.preset(preset)
    kwargs = dict(
        kind="sampled_reverse_kl",
        beta=0.7,
        config=cfg,
        advantages=advantages,
        old_logp=None if preset == "pg" else old,
    )
    ref, ref_grad = _run(reference.distill_loss, student, teacher, labels, mask, **kwargs)
    ours, grad = _run(
        fusedrl.distill_loss, student, teacher, labels, mask, backend=backend, **kwargs
    )
    torch.testing.assert_close(ours.loss, ref.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(ours.metrics["distill"], ref.metrics["distill"])
    # the teacher term acted: the gradient differs from the RL loss alone
    _, rl_grad = _run(
        fusedrl.distill_loss, student, teacher, labels, mask, **{**kwargs, "beta": 0.0}
    )
    assert (grad - rl_grad).abs().max() > 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampled_reverse_kl_takes_the_samplers_log_probs_over_its_sampled_sets(backend):
    """On-policy with top_k: the sampler's log-probs (the gap's first term) are the engine's,
    over the sampled set, as the reused batch's old_logp would be; the teacher's are its own."""
    student, teacher, labels, mask, _, advantages = _sampled_inputs()
    gen = torch.Generator().manual_seed(21)
    top = student.topk(20, dim=-1).indices  # labels the engine could have sampled
    labels = top.gather(-1, torch.randint(0, 20, (*labels.shape, 1), generator=gen))[..., 0]
    cfg = LossConfig.preset("dapo", top_k=20)
    kwargs = dict(kind="sampled_reverse_kl", beta=0.7, config=cfg, advantages=advantages)
    ref, ref_grad = _run(reference.distill_loss, student, teacher, labels, mask, **kwargs)
    ours, grad = _run(
        fusedrl.distill_loss, student, teacher, labels, mask, backend=backend, **kwargs
    )
    torch.testing.assert_close(ours.metrics["distill"], ref.metrics["distill"])
    torch.testing.assert_close(grad, ref_grad, atol=1e-7, rtol=1e-5)
    with torch.no_grad():  # the filter acted: the unfiltered gap is another number
        full = torch.log_softmax(student, -1).gather(-1, labels[..., None])[..., 0]
        taught = torch.log_softmax(teacher, -1).gather(-1, labels[..., None])[..., 0]
        unfiltered = ((full - taught) * mask).sum() / mask.sum()
    assert (ours.metrics["distill"] - unfiltered).abs() > 1e-3


def test_sampled_reverse_kl_is_the_policy_loss_with_shifted_advantages():
    """Written out: A'_t = A_t - beta (old_t - log softmax(teacher)[y_t]) in policy_loss."""
    student, teacher, labels, mask, old, advantages = _sampled_inputs(seed=7)
    cfg = LossConfig.preset("dapo")
    teacher_logp = torch.log_softmax(teacher / 0.9, -1).gather(-1, labels[..., None])[..., 0]
    shifted = advantages[:, None] - 0.4 * torch.where(mask, old - teacher_logp, 0.0)
    want, want_grad = _run(
        fusedrl.policy_loss,
        student,
        labels,
        shifted,
        mask,
        old_logp=old,
        config=cfg.replace(temperature=0.9),
        backend="torch",
    )
    got, grad = _run(
        fusedrl.distill_loss,
        student,
        teacher,
        labels,
        mask,
        kind="sampled_reverse_kl",
        beta=0.4,
        temperature=0.9,
        config=cfg,
        advantages=advantages,
        old_logp=old,
        backend="torch",
    )
    torch.testing.assert_close(got.loss, want.loss)
    torch.testing.assert_close(grad, want_grad)
    gap = torch.where(mask, old - teacher_logp, 0.0)
    torch.testing.assert_close(got.metrics["distill"], gap.sum() / mask.sum())


def test_pure_on_policy_distillation_pulls_the_student_toward_the_teacher():
    """No RL advantages and no old_logp (on-policy): one plain gradient step on the student's
    logits lowers the sampled reverse KL to the teacher."""
    student, teacher, labels, mask, _, _ = _sampled_inputs(seed=9)
    logits = student.clone().requires_grad_(True)
    out = fusedrl.distill_loss(
        logits,
        teacher,
        labels,
        mask,
        kind="sampled_reverse_kl",
        beta=1.0,
        config=LossConfig(loss="pg"),
        backend="torch",
    )
    (grad,) = torch.autograd.grad(out.loss, logits)
    stepped = student - 50.0 * grad
    before = fusedrl.distill_loss(student, teacher, labels, mask, kind="sampled_reverse_kl")
    after = fusedrl.distill_loss(stepped, teacher, labels, mask, kind="sampled_reverse_kl")
    assert after.metrics["distill"] < before.metrics["distill"] - 1e-3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kind="jsd", advantages=torch.zeros(3)), "advantages is read only by"),
        (dict(kind="reverse_kl", old_logp=torch.zeros(3, 7)), "old_logp is read only by"),
        (dict(kind="sampled_reverse_kl", advantages=torch.zeros(4)), "advantages shape"),
        (
            dict(kind="sampled_reverse_kl", temperature=0.8, config=LossConfig(temperature=0.7)),
            "config.temperature=0.7 differs from temperature=0.8",
        ),
    ],
)
def test_sampled_reverse_kl_arguments_are_named(kwargs, message):
    student, teacher, labels, mask = _inputs(seed=1)
    with pytest.raises(ValueError, match=message):
        fusedrl.distill_loss(student, teacher, labels, mask, **kwargs)
