"""Packed sequences (`policy_loss(..., cu_seqlens=)`, fusedrl/packed.py): equal to the padded
call on the same sequences, for every preset and the options whose terms see the sequence
boundaries (sequence IS weights and rejection, the mismatch metrics, OPSM, an entropy bonus,
per-token temperatures, a normalizer, grad_scale), on every logits backend, with sequences of
length 0 and 1, masked tokens inside a sequence and a sequence with none counted; the oracle's
packed call (which cuts the sequences out) agrees; bf16 against the float64 truth; and what a
bad `cu_seqlens` gets."""

from __future__ import annotations

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, packed, reference, segments

from .conftest import BACKENDS, LOGITS_BACKENDS

LENGTHS = (5, 0, 1, 9, 4, 6)  # a sequence of 0 and of 1 token; the fourth as long as the pad
VOCAB = 131


def _batch(seed: int, dtype=torch.float32, per_token_adv: bool = False) -> dict:
    """A padded [S, T, V] batch and the same sequences packed [N, V]: each sequence's first
    LENGTHS[s] positions, a random mask inside them (the last sequence has no counted token),
    NaN logits and label -100 on the padding and the masked tokens."""
    gen = torch.Generator().manual_seed(seed)
    count, longest = len(LENGTHS), max(LENGTHS)
    inside = torch.arange(longest)[None] < torch.tensor(LENGTHS)[:, None]
    mask = inside & (torch.rand(count, longest, generator=gen) < 0.8)
    mask[:, 0] &= inside[:, 0]  # (a first token counted where the sequence has one: non-empty)
    mask[0, 0] = mask[3, 0] = True
    mask[-1] = False
    logits = 2.0 * torch.randn(count, longest, VOCAB, generator=gen)
    labels = torch.randint(0, VOCAB, (count, longest), generator=gen)
    with torch.no_grad():
        now = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    logits[~mask] = float("nan")
    labels[~mask] = -100
    noise = lambda scale: scale * torch.randn(count, longest, generator=gen)  # noqa: E731
    padded = dict(
        logits=logits.to(dtype),
        labels=labels,
        mask=mask,
        advantages=torch.randn((count, longest) if per_token_adv else (count,), generator=gen),
        old_logp=now + noise(0.3),
        ref_logp=now + noise(0.2),
        rollout_logp=now + noise(0.5),
    )
    flat = {k: (v[inside] if v.dim() >= 2 else v) for k, v in padded.items()}
    bounds = torch.tensor((0, *torch.tensor(LENGTHS).cumsum(0).tolist()), dtype=torch.int32)
    return {"padded": padded, "packed": flat, "inside": inside, "cu_seqlens": bounds}


CASES = {
    "dapo": (LossConfig.preset("dapo"), {}),  # no boundary seen: the plain [N, V] call
    "grpo": (LossConfig.preset("grpo", beta=0.05), {}),  # seq-mean-token-mean, k3 KL
    "dr_grpo": (LossConfig.preset("dr_grpo"), {}),
    "gspo": (LossConfig.preset("gspo"), {}),  # the sequence ratio
    "gspo_token": (LossConfig.preset("gspo_token"), {"per_token_adv": True}),
    "gmpo": (LossConfig.preset("gmpo"), {}),
    "sequence IS": (
        LossConfig.preset("dapo", is_correction="sequence_truncate", is_cap=3.0),
        {"rollout": True, "seed": 13},
    ),
    "sequence rejection": (
        LossConfig.preset("grpo", rejection="seq_mean_k3", rejection_threshold=0.1),
        {"rollout": True},
    ),
    "entropy bonus": (LossConfig.preset("grpo", entropy_coef=0.02), {}),
    "dapo rollout metrics": (LossConfig.preset("dapo"), {"rollout": True}),
}


# What shows that a case's sequence-level branch acted (on the padded call's metrics).
ACTS = {
    "sequence IS": lambda m: m["is_weight_mean"] < m["is_weight_max"] == 3.0,  # some truncated
    "sequence rejection": lambda m: 0 < m["rs_masked_seqs"] < 1,
    "dapo rollout metrics": lambda m: m["mismatch_chi2_seq"] > 0,
}


def _call(function, data, cfg, backend=None, rollout=False, **kwargs):
    args = {k: v for k, v in data.items() if k != "logits" and (rollout or k != "rollout_logp")}
    leaf = data["logits"].detach().requires_grad_(True)
    if backend is not None:
        kwargs["backend"] = backend
    out = function(leaf, **args, config=cfg, return_entropy=True, **kwargs)
    (grad,) = torch.autograd.grad(out.loss, leaf)
    return out, grad


def _assert_equal_outputs(got, got_grad, want, want_grad, inside, atol=1e-5):
    torch.testing.assert_close(got.loss, want.loss, atol=atol, rtol=1e-5)
    torch.testing.assert_close(got_grad, want_grad[inside], atol=atol, rtol=1e-5)
    torch.testing.assert_close(got.logp, want.logp[inside], atol=atol, rtol=1e-5)
    torch.testing.assert_close(got.entropy, want.entropy[inside], atol=atol, rtol=1e-5)
    assert got.metrics.keys() == want.metrics.keys()
    for name in want.metrics:
        torch.testing.assert_close(got.metrics[name], want.metrics[name], atol=atol, rtol=1e-5)


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_equals_the_padded_call(case, backend):
    cfg, options = CASES[case]
    rollout = options.get("rollout", False)
    seed = options.get("seed", len(case))
    data = _batch(seed=seed, per_token_adv=options.get("per_token_adv", False))
    want, want_grad = _call(fusedrl.policy_loss, data["padded"], cfg, backend, rollout)
    got, got_grad = _call(
        fusedrl.policy_loss,
        data["packed"],
        cfg,
        backend,
        rollout,
        cu_seqlens=data["cu_seqlens"],
    )
    _assert_equal_outputs(got, got_grad, want, want_grad, data["inside"])
    assert ACTS.get(case, lambda m: True)(want.metrics), want.metrics
    assert torch.isfinite(got_grad).all() and (got_grad[~data["packed"]["mask"]] == 0).all()
    oracle, oracle_grad = _call(
        reference.policy_loss, data["packed"], cfg, rollout=rollout, cu_seqlens=data["cu_seqlens"]
    )
    _assert_equal_outputs(oracle, oracle_grad, want, want_grad, data["inside"])


@pytest.mark.parametrize("head", [dict(softcap=3.0), dict(logit_scale=0.5)])
def test_the_oracles_packed_call_takes_the_model_head_once(head):
    """reference.policy_loss(cu_seqlens=) with a soft cap or a logit scale: the padded call's
    result (the model's transform applied once, not again on the cut-out sequences); the
    exact KL's reference logits are cut out with the logits."""
    data = _batch(seed=5)
    cfg = LossConfig.preset("grpo", kl="full")
    gen = torch.Generator().manual_seed(6)
    ref_logits = torch.randn(data["padded"]["logits"].shape, generator=gen)
    padded = {k: v for k, v in data["padded"].items() if k != "ref_logp"}
    flat = {k: v for k, v in data["packed"].items() if k != "ref_logp"}
    want, want_grad = _call(reference.policy_loss, padded, cfg, ref_logits=ref_logits, **head)
    got, got_grad = _call(
        reference.policy_loss,
        flat,
        cfg,
        ref_logits=ref_logits[data["inside"]],
        cu_seqlens=data["cu_seqlens"],
        **head,
    )
    _assert_equal_outputs(got, got_grad, want, want_grad, data["inside"])


def test_the_boundaries_act():
    """The cases are not blind to the boundaries: with the sequences cut elsewhere the loss of a
    sequence-level preset changes (and a token-level one's does not)."""
    data = _batch(seed=3, per_token_adv=True)  # (a sequence's advantage moves with it else)
    moved = data["cu_seqlens"].clone()
    moved[1] -= 2  # the second sequence (empty) takes the first's last two tokens
    losses = {}
    for name in ("dapo", "gspo", "grpo"):
        cfg = CASES[name][0]
        outs = [
            fusedrl.policy_loss(**data["packed"], config=cfg, backend="torch", cu_seqlens=cuts)
            for cuts in (data["cu_seqlens"], moved)
        ]
        losses[name] = outs[0].loss, outs[1].loss
    assert torch.equal(*losses["dapo"])
    assert not torch.allclose(*losses["gspo"]) and not torch.allclose(*losses["grpo"])


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_options_through_the_packed_path(backend):
    """Per-token temperatures (masked tokens' anything), per-sequence IS weights, a normalizer,
    grad_scale and the sum of squares, each as the padded call."""
    cfg = LossConfig.preset("gspo")
    data = _batch(seed=11)
    gen = torch.Generator().manual_seed(5)
    temps = 0.6 + torch.rand(data["padded"]["mask"].shape, generator=gen)
    weights = 0.5 + torch.rand(len(LENGTHS), generator=gen)
    common = dict(normalizer=4.0, grad_scale=0.5, is_weights=weights, return_sum_pi_squared=True)
    want, want_grad = _call(
        fusedrl.policy_loss, data["padded"], cfg, backend, temperature=temps, **common
    )
    flat_temps = torch.where(data["packed"]["mask"], temps[data["inside"]], 0.0)
    got, got_grad = _call(
        fusedrl.policy_loss,
        data["packed"],
        cfg,
        backend,
        temperature=flat_temps,
        cu_seqlens=data["cu_seqlens"],
        max_seqlen=max(LENGTHS),
        **common,
    )
    _assert_equal_outputs(got, got_grad, want, want_grad, data["inside"])
    torch.testing.assert_close(
        got.sum_pi_squared, want.sum_pi_squared[data["inside"]], atol=1e-5, rtol=1e-4
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset", ["dapo", "gspo", "grpo"])
def test_the_lm_head_form_equals_the_padded_call(preset, backend):
    """linear_policy_loss(hidden [N, H], weight, cu_seqlens=) against its padded call: the loss,
    the gradients of the hidden states and of the head, the log-probs and the metrics."""
    cfg = CASES[preset][0]
    data = _batch(seed=21)
    gen = torch.Generator().manual_seed(8)
    hidden = torch.randn(*data["padded"]["mask"].shape, 16, generator=gen)
    weight = 0.5 * torch.randn(VOCAB, 16, generator=gen)
    args = {k: v for k, v in data["padded"].items() if k not in ("logits", "rollout_logp")}
    flat = {k: v for k, v in data["packed"].items() if k not in ("logits", "rollout_logp")}
    runs = []
    for rows, extra in ((hidden, args), (hidden[data["inside"]], flat)):
        leaves = [rows.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
        packed_call = {"cu_seqlens": data["cu_seqlens"]} if rows.dim() == 2 else {}
        out = fusedrl.linear_policy_loss(
            *leaves, **extra, config=cfg, backend=backend, return_entropy=True, **packed_call
        )
        runs.append((out, torch.autograd.grad(out.loss, leaves)))
    (want, (want_hidden, want_weight)), (got, (got_hidden, got_weight)) = runs
    torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_hidden, want_hidden[data["inside"]], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_weight, want_weight, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.logp, want.logp[data["inside"]], atol=1e-5, rtol=1e-5)
    assert got.metrics.keys() == want.metrics.keys()
    for name in want.metrics:
        torch.testing.assert_close(got.metrics[name], want.metrics[name], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("preset", "kl"), [("dapo", "full"), ("grpo", "full_reverse")])
def test_the_lm_heads_exact_kl_on_packed_rows(preset, kl, backend):
    """linear_policy_loss(..., ref_weight=, ref_hidden=, cu_seqlens=): the exact KL to the
    reference head is each token's own term, so token-level ratios take it in their plain
    call: the padded call's loss, gradients and metrics, with the KL acting; a sequence ratio
    refuses it by name."""
    cfg = LossConfig.preset(preset, kl=kl, beta=0.3)
    data = _batch(seed=23)
    gen = torch.Generator().manual_seed(9)
    hidden = torch.randn(*data["padded"]["mask"].shape, 16, generator=gen)
    weight = 0.5 * torch.randn(VOCAB, 16, generator=gen)
    ref_weight = weight + 0.3 * torch.randn(VOCAB, 16, generator=gen)
    ref_hidden = hidden + 0.2 * torch.randn(hidden.shape, generator=gen)
    drop = ("logits", "rollout_logp", "ref_logp")
    args = {k: v for k, v in data["padded"].items() if k not in drop}
    flat = {k: v for k, v in data["packed"].items() if k not in drop}
    inside, cuts = data["inside"], data["cu_seqlens"]
    runs = []
    for rows, ref_rows, extra in (
        (hidden, ref_hidden, args),
        (hidden[inside], ref_hidden[inside], flat),
    ):
        leaves = [rows.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
        packed_call = {"cu_seqlens": cuts} if rows.dim() == 2 else {}
        reference_head = {"ref_weight": ref_weight, "ref_hidden": ref_rows}
        out = fusedrl.linear_policy_loss(
            *leaves, **extra, config=cfg, backend=backend, **reference_head, **packed_call
        )
        runs.append((out, torch.autograd.grad(out.loss, leaves)))
    (want, (want_hidden, want_weight)), (got, (got_hidden, got_weight)) = runs
    torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_hidden, want_hidden[inside], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_weight, want_weight, atol=1e-5, rtol=1e-5)
    assert got.metrics.keys() == want.metrics.keys()
    for name in want.metrics:
        torch.testing.assert_close(got.metrics[name], want.metrics[name], atol=1e-5, rtol=1e-5)
    assert want.metrics["kl"] > 0.05  # the exact KL acted
    with pytest.raises(NotImplementedError, match="kl='full' / 'full_reverse' .* cu_seqlens"):
        fusedrl.linear_policy_loss(
            hidden[inside],
            weight,
            **flat,
            config=LossConfig.preset("gspo", kl=kl, beta=0.3),
            backend=backend,
            ref_weight=ref_weight,
            cu_seqlens=cuts,
        )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_the_lm_heads_distillation_equals_the_padded_call(agg, backend):
    """linear_distill_loss(student [N, H], ..., cu_seqlens=) against its padded call: the loss,
    the gradients of the student's hidden states and head, the metric; the sequences enter
    through the aggregation weights (they act: the sequence means differ from token-mean)."""
    data = _batch(seed=23)
    gen = torch.Generator().manual_seed(9)
    shape = data["padded"]["mask"].shape
    hidden, teacher_hidden = torch.randn(*shape, 16, generator=gen), torch.randn(*shape, 8)
    weight, teacher_weight = 0.5 * torch.randn(VOCAB, 16, generator=gen), torch.randn(VOCAB, 8)
    labels = torch.where(data["padded"]["mask"], data["padded"]["labels"], 0)
    runs = []
    for layout in ("padded", "packed"):
        cut = (lambda t: t[data["inside"]]) if layout == "packed" else (lambda t: t)
        leaves = [cut(hidden).clone().requires_grad_(True), weight.clone().requires_grad_(True)]
        out = fusedrl.linear_distill_loss(
            *leaves,
            cut(teacher_hidden),
            teacher_weight,
            cut(labels),
            cut(data["padded"]["mask"]),
            kind="jsd",
            config=LossConfig(agg=agg),
            backend=backend,
            **({"cu_seqlens": data["cu_seqlens"]} if layout == "packed" else {}),
        )
        runs.append((out, torch.autograd.grad(out.loss, leaves)))
    (want, (want_hidden, want_weight)), (got, (got_hidden, got_weight)) = runs
    torch.testing.assert_close(got.loss, want.loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_hidden, want_hidden[data["inside"]], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_weight, want_weight, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.metrics["distill"], want.metrics["distill"])
    inside = data["inside"]
    packed_rows = (hidden[inside], weight, teacher_hidden[inside], teacher_weight, labels[inside])
    if agg != "token-mean":  # the boundaries acted
        plain = fusedrl.linear_distill_loss(
            *packed_rows, data["packed"]["mask"], kind="jsd", backend=backend
        )
        assert not torch.allclose(plain.loss, got.loss)
    with pytest.raises(NotImplementedError, match="sampled_reverse_kl"):
        fusedrl.linear_distill_loss(
            *packed_rows,
            data["packed"]["mask"],
            kind="sampled_reverse_kl",
            advantages=torch.zeros(sum(LENGTHS)),
            cu_seqlens=data["cu_seqlens"],
        )


def test_a_loss_blind_to_the_boundaries_makes_no_padded_layout(monkeypatch):
    """dapo (each term a token's own, token-mean) never makes the padded layout, so a packed
    call without max_seqlen reads no T_max on the host; grpo's weights and gspo's terms do."""

    def refused(self):
        raise AssertionError("the padded layout was made")

    monkeypatch.setattr(segments.Segments, "longest", property(refused))
    data = _batch(seed=13)
    flat = {k: v for k, v in data["packed"].items() if k != "rollout_logp"}
    fusedrl.policy_loss(**flat, config=LossConfig.preset("dapo"), cu_seqlens=data["cu_seqlens"])
    for preset in ("grpo", "gspo"):
        with pytest.raises(AssertionError, match="padded layout"):
            fusedrl.policy_loss(
                **flat, config=LossConfig.preset(preset), cu_seqlens=data["cu_seqlens"]
            )


def test_max_seqlen_spares_the_host_read_of_the_longest(monkeypatch):
    """With max_seqlen given, no call reads the longest sequence on the host (one sync on a
    GPU), Dr. GRPO's seq-mean-token-sum-norm without norm_constant too (its divisor is the
    longest: a device scalar); only GMPO under that aggregation reads it."""
    data = _batch(seed=13)
    flat = {k: v for k, v in data["packed"].items() if k != "rollout_logp"}
    reads = []
    real_int = segments.Segments.longest.func

    def counted(self):
        reads.append(self.bound)
        return real_int(self)

    monkeypatch.setattr(segments.Segments, "longest", property(counted))
    bound = 2 * max(LENGTHS)
    for preset in ("dr_grpo", "grpo", "gspo"):
        cfg = LossConfig.preset(preset)
        fusedrl.policy_loss(**flat, config=cfg, cu_seqlens=data["cu_seqlens"], max_seqlen=bound)
    assert reads and all(read == bound for read in reads), reads
    reads.clear()
    gmpo = LossConfig.preset("gmpo", agg="seq-mean-token-sum-norm")
    fusedrl.policy_loss(**flat, config=gmpo, cu_seqlens=data["cu_seqlens"], max_seqlen=bound)
    assert None in reads  # (the host read)


def test_bf16_against_the_float64_truth():
    data = _batch(seed=7, dtype=torch.bfloat16)
    cfg = CASES["gspo"][0]
    got, got_grad = _call(fusedrl.policy_loss, data["packed"], cfg, cu_seqlens=data["cu_seqlens"])
    truth = {k: (v.double() if v.is_floating_point() else v) for k, v in data["padded"].items()}
    want, want_grad = _call(reference.policy_loss, truth, cfg)
    torch.testing.assert_close(got.loss.double(), want.loss, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_grad.double(), want_grad[data["inside"]], atol=2e-3, rtol=5e-2)


def test_all_masked_gives_zero_loss_and_gradient():
    data = _batch(seed=2)
    batch = dict(data["packed"], mask=torch.zeros_like(data["packed"]["mask"]))
    for preset in ("dapo", "gspo"):
        out, grad = _call(
            fusedrl.policy_loss,
            batch,
            LossConfig.preset(preset),
            "torch",
            cu_seqlens=data["cu_seqlens"],
        )
        assert out.loss.item() == 0.0 and (grad == 0).all(), preset


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
@pytest.mark.parametrize("preset", ["dapo", "grpo"])
@pytest.mark.parametrize("kl", ["full", "full_reverse"])
def test_the_exact_kl_on_packed_rows(kl, preset, backend):
    """config.kl="full" / "full_reverse" with cu_seqlens: each token's KL over the vocabulary
    is its own, so a token-level ratio (a token or sequence mean) is the plain call on the
    packed logits and the reference's: the padded call's loss, gradient and metrics, the
    oracle's too, with the KL acting; a sequence ratio refuses it by name."""
    cfg = LossConfig.preset(preset, kl=kl, beta=0.3)
    data = _batch(seed=17)
    gen = torch.Generator().manual_seed(18)
    ref_logits = data["padded"]["logits"].nan_to_num() + torch.randn(
        data["padded"]["logits"].shape, generator=gen
    )
    padded = {k: v for k, v in data["padded"].items() if k != "ref_logp"}
    flat = {k: v for k, v in data["packed"].items() if k != "ref_logp"}
    want, want_grad = _call(fusedrl.policy_loss, padded, cfg, backend, ref_logits=ref_logits)
    packed_ref = ref_logits[data["inside"]]
    cuts = data["cu_seqlens"]
    got, got_grad = _call(
        fusedrl.policy_loss, flat, cfg, backend, ref_logits=packed_ref, cu_seqlens=cuts
    )
    _assert_equal_outputs(got, got_grad, want, want_grad, data["inside"])
    oracle, oracle_grad = _call(
        reference.policy_loss, flat, cfg, ref_logits=packed_ref, cu_seqlens=cuts
    )
    _assert_equal_outputs(oracle, oracle_grad, want, want_grad, data["inside"])
    assert want.metrics["kl"] > 0.05  # the exact KL acted
    with pytest.raises(NotImplementedError, match="kl='full' / 'full_reverse' .* cu_seqlens"):
        _call(
            fusedrl.policy_loss,
            flat,
            LossConfig.preset("gspo", kl=kl, beta=0.3),
            backend,
            ref_logits=packed_ref,
            cu_seqlens=cuts,
        )
    with pytest.raises((NotImplementedError, ValueError), match="ref_logits"):  # not ignored
        _call(
            fusedrl.policy_loss,
            flat,
            CASES["gspo"][0],
            backend,
            ref_logits=packed_ref,
            cu_seqlens=cuts,
        )


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
@pytest.mark.parametrize("case", ["dapo", "grpo", "dr_grpo"])
def test_token_level_ratios_run_in_place(case, backend):
    """inplace=True with cu_seqlens where the boundaries enter by the weights alone: the
    gradient (the padded call's) is written into the packed logits' buffer, which backward
    hands back without a copy; a loss that needs whole sequences refuses by name."""
    cfg = CASES[case][0]
    data = _batch(seed=len(case) + 3)
    want, want_grad = _call(fusedrl.policy_loss, data["padded"], cfg, backend)
    flat = data["packed"]
    args = {k: v for k, v in flat.items() if k not in ("logits", "rollout_logp")}
    logits = flat["logits"].clone().requires_grad_(True)
    seen = []
    logits.register_hook(lambda g: seen.append(g.data_ptr()))
    out = fusedrl.policy_loss(
        logits,
        **args,
        config=cfg,
        backend=backend,
        return_entropy=True,
        inplace=True,
        cu_seqlens=data["cu_seqlens"],
    )
    in_buffer = logits.detach().clone()
    out.loss.backward()
    _assert_equal_outputs(out, logits.grad, want, want_grad, data["inside"])
    torch.testing.assert_close(in_buffer, want_grad[data["inside"]], atol=1e-5, rtol=1e-5)
    assert seen == [logits.data_ptr()]
    with pytest.raises(NotImplementedError, match="inplace=True with cu_seqlens takes token-level"):
        fusedrl.policy_loss(
            flat["logits"].clone().requires_grad_(True),
            **args,
            config=LossConfig.preset("gspo"),
            backend=backend,
            inplace=True,
            cu_seqlens=data["cu_seqlens"],
        )


def test_bad_cu_seqlens_are_named():
    data = _batch(seed=1)
    flat, cuts = data["packed"], data["cu_seqlens"]
    tokens = flat["labels"].shape[0]

    def call(**kwargs):
        return fusedrl.policy_loss(**{**flat, **kwargs}, config=LossConfig.preset("gspo"))

    decreasing = cuts.clone()
    decreasing[2] = 7  # 0, 5, 7, 6, ...
    with pytest.raises(ValueError, match="never decrease"):
        call(cu_seqlens=decreasing)
    with pytest.raises(ValueError, match=f"end at the token count {tokens}"):
        call(cu_seqlens=cuts[:-1])
    with pytest.raises(TypeError, match="int32 or int64, got dtype torch.float32"):
        call(cu_seqlens=cuts.float())
    with pytest.raises(ValueError, match=r"1-D \[S \+ 1\]"):
        call(cu_seqlens=cuts[None])
    with pytest.raises(ValueError, match=r"cu_seqlens needs packed \[N, V\] logits"):
        call(cu_seqlens=cuts, logits=flat["logits"][None])
    with pytest.raises(ValueError, match="max_seqlen=3 is shorter"):
        call(cu_seqlens=cuts, max_seqlen=3)
    with pytest.raises(ValueError, match="max_seqlen .* needs cu_seqlens"):
        call(max_seqlen=3)
    with pytest.raises(NotImplementedError, match="inplace=True with cu_seqlens"):
        call(cu_seqlens=cuts, inplace=True)
    with pytest.raises(ValueError, match="advantages shape"):
        call(cu_seqlens=cuts, advantages=torch.randn(4))
    with pytest.raises(ValueError, match=rf"old_logp shape \(4,\) must be \[{tokens}\]"):
        call(cu_seqlens=cuts, old_logp=torch.randn(4))
    for preset in ("gspo", "grpo"):  # the two-pass call and the one-pass one
        with pytest.raises(ValueError, match="both set: pass one"):
            fusedrl.policy_loss(
                **flat,
                config=LossConfig.preset(preset, temperature=0.7),
                temperature=torch.ones(tokens),
                cu_seqlens=cuts,
            )
    assert packed.sees_no_boundaries(LossConfig.preset("dapo"), None, None)


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
@pytest.mark.parametrize("preset", ["dr_grpo", "gspo_sum_norm", "gmpo_sum_norm"])
def test_a_max_seqlen_bound_does_not_change_the_loss(preset, backend):
    """max_seqlen is a bound on the longest sequence (a pack's capacity will do): it sizes the
    padded layout and never the numbers. seq-mean-token-sum-norm without norm_constant divides
    by T, the longest sequence's length as in the oracle's packed call: a larger bound rescaled
    the loss and gradient by longest / max_seqlen (on the plain call's weights and on the
    two-pass terms alike)."""
    cfg = LossConfig.preset("dr_grpo")
    if preset.endswith("_sum_norm"):
        cfg = LossConfig.preset(preset.split("_")[0], agg="seq-mean-token-sum-norm")
    data = _batch(seed=21)
    flat, cuts = data["packed"], data["cu_seqlens"]
    want, want_grad = _call(reference.policy_loss, flat, cfg, cu_seqlens=cuts)
    for bound in (None, max(LENGTHS), 4 * max(LENGTHS)):
        got, got_grad = _call(
            fusedrl.policy_loss, flat, cfg, backend, cu_seqlens=cuts, max_seqlen=bound
        )
        torch.testing.assert_close(got.loss, want.loss, atol=1e-6, rtol=1e-5, msg=str(bound))
        torch.testing.assert_close(got_grad, want_grad, atol=1e-6, rtol=1e-5, msg=str(bound))


def test_a_max_seqlen_bound_does_not_change_distillation():
    """The same for distillation's packed aggregation (its weights per sequence)."""
    data = _batch(seed=22)
    flat, cuts = data["packed"], data["cu_seqlens"]
    teacher = torch.randn(flat["logits"].shape, generator=torch.Generator().manual_seed(2))
    cfg = LossConfig(agg="seq-mean-token-sum-norm")
    losses = [
        fusedrl.distill_loss(
            flat["logits"].nan_to_num(),
            teacher,
            flat["labels"],
            flat["mask"],
            config=cfg,
            cu_seqlens=cuts,
            max_seqlen=bound,
        ).loss
        for bound in (None, max(LENGTHS), 4 * max(LENGTHS))
    ]
    assert (
        losses[0] != 0 and torch.equal(losses[0], losses[1]) and torch.equal(losses[0], losses[2])
    )


def test_one_value_a_token_and_a_sequence_alike_is_refused():
    """A 1-D tensor with N == S values reads as one a token or one a sequence: the same where
    every sequence is one token long (taken), refused where some are empty (the per-token
    reading silently misread per-sequence advantages); [S, 1] says one a sequence."""
    gen = torch.Generator().manual_seed(3)
    logits, labels = torch.randn(3, VOCAB, generator=gen), torch.randint(0, VOCAB, (3,))
    mask, per_sequence = torch.ones(3, dtype=torch.bool), torch.tensor([5.0, -1.0, 7.0])
    cfg = LossConfig.preset("grpo", beta=0.0)

    def call(cuts, **kwargs):
        inputs = dict(labels=labels, advantages=per_sequence, mask=mask) | kwargs
        cuts = torch.tensor(cuts)
        return fusedrl.policy_loss(logits, **inputs, config=cfg, cu_seqlens=cuts).loss

    ones = call([0, 1, 2, 3])  # one token a sequence: the readings agree
    torch.testing.assert_close(ones, call([0, 1, 2, 3], advantages=per_sequence[:, None]))
    for name in ("advantages", "is_weights"):
        given = {"advantages": per_sequence[:, None], name: per_sequence.abs()}
        with pytest.raises(ValueError, match=rf"{name} of shape \(3,\) reads as one per token"):
            call([0, 0, 3, 3], **given)
    padded = reference.policy_loss(
        logits[None], labels[None], per_sequence[1:2], mask[None], config=cfg
    )
    got = call([0, 0, 3, 3], advantages=per_sequence[:, None])  # sequence 1 holds the tokens
    torch.testing.assert_close(got, padded.loss)


def test_a_config_that_is_not_a_loss_config_is_named():
    data = _batch(seed=1)
    for cfg in ("dapo", {"loss": "ppo"}):
        with pytest.raises(TypeError, match="config must be a fusedrl.LossConfig, got"):
            fusedrl.policy_loss(**data["packed"], config=cfg, cu_seqlens=data["cu_seqlens"])


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_the_log_prob_functions_take_one_temperature_a_sequence(backend):
    """[S] or [S, 1] temperatures, as policy_loss(cu_seqlens=) takes them, are each sequence's
    repeated over its tokens ([N] per token as they are); the LM-head form's too."""
    data = _batch(seed=10)
    flat, cuts = data["packed"], data["cu_seqlens"]
    labels = torch.where(flat["mask"], flat["labels"], 0)
    logits = torch.nan_to_num(flat["logits"])
    per_sequence = 0.5 + torch.arange(len(LENGTHS), dtype=torch.float32) / 4
    per_token = per_sequence.repeat_interleave(torch.tensor(LENGTHS))
    want = fusedrl.token_logprobs(logits, labels, per_token, True, backend=backend)
    for temps in (per_sequence, per_sequence[:, None]):
        got = fusedrl.token_logprobs(logits, labels, temps, True, backend=backend, cu_seqlens=cuts)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    hidden, weight = torch.randn(labels.shape[0], 8), torch.randn(VOCAB, 8)
    head = fusedrl.linear_token_logprobs(hidden, weight, labels, per_token, backend="torch")
    head_packed = fusedrl.linear_token_logprobs(
        hidden, weight, labels, per_sequence, backend="torch", cu_seqlens=cuts
    )
    assert torch.equal(head[0], head_packed[0])
    with pytest.raises(ValueError, match=r"temperature shape \(4,\) must be the tokens' \(25,\)$"):
        fusedrl.token_logprobs(logits, labels, torch.ones(4), cu_seqlens=cuts)


def test_the_log_prob_functions_check_and_keep_them():
    """token_logprobs / linear_token_logprobs take cu_seqlens (checked as the loss's) and give
    what they give without it: each row's log-prob is its own."""
    data = _batch(seed=9)
    flat, cuts = data["packed"], data["cu_seqlens"]
    labels = torch.where(flat["mask"], flat["labels"], 0)
    logits = torch.nan_to_num(flat["logits"])
    plain = fusedrl.token_logprobs(logits, labels, 0.8, True, backend="torch")
    packed_call = fusedrl.token_logprobs(
        logits, labels, 0.8, True, backend="torch", cu_seqlens=cuts, max_seqlen=max(LENGTHS)
    )
    assert all(torch.equal(a, b) for a, b in zip(plain, packed_call))
    hidden, weight = torch.randn(labels.shape[0], 8), torch.randn(VOCAB, 8)
    head = fusedrl.linear_token_logprobs(hidden, weight, labels, backend="torch")
    head_packed = fusedrl.linear_token_logprobs(
        hidden, weight, labels, backend="torch", cu_seqlens=cuts
    )
    assert torch.equal(head[0], head_packed[0])
    with pytest.raises(ValueError, match="never decrease"):
        fusedrl.token_logprobs(logits, labels, cu_seqlens=cuts.flip(0))
    with pytest.raises(ValueError, match="max_seqlen=2 is shorter"):
        fusedrl.linear_token_logprobs(hidden, weight, labels, cu_seqlens=cuts, max_seqlen=2)
    with pytest.raises(ValueError, match="needs cu_seqlens"):
        fusedrl.token_logprobs(logits, labels, max_seqlen=4)


@pytest.mark.parametrize("preset", ["dapo", "grpo", "dr_grpo", "gspo"])
def test_which_losses_read_the_logits_once(preset, monkeypatch):
    """Token-level ratios (dapo; grpo and dr_grpo, whose sequences enter through their
    aggregation weights alone) are the plain fused call: the log-prob pass of the two-pass
    route never runs, with rollout log-probs for the metrics too. A sequence ratio (gspo)
    takes it."""
    from fusedrl import single_process

    passes = []
    real = single_process.token_logprobs

    def counted(*args, **kwargs):
        passes.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(single_process, "token_logprobs", counted)
    data = _batch(seed=12)
    flat = {k: v for k, v in data["packed"].items() if k != "rollout_logp"}
    cfg = CASES[preset][0]
    fusedrl.policy_loss(**flat, config=cfg, backend="triton", cu_seqlens=data["cu_seqlens"])
    assert bool(passes) == (preset == "gspo")
    assert packed.weighs_sequences_only(cfg, None, None) == (preset != "gspo")
    # The engine's log-probs read for the mismatch metrics alone (as a trainer passes them):
    # still one read; an IS correction reads them in the loss, which then needs the sequences.
    passes.clear()
    rollout = data["packed"]["rollout_logp"]
    out = fusedrl.policy_loss(
        **flat,
        rollout_logp=rollout,
        config=cfg,
        backend="triton",
        cu_seqlens=data["cu_seqlens"],
    )
    assert bool(passes) == (preset == "gspo") and out.metrics["mismatch_chi2_seq"] > 0
    corrected = cfg.replace(is_correction="sequence_truncate", is_cap=3.0)
    assert not packed.reads_rollout_for_metrics_only(corrected, rollout, None)
    assert packed.reads_rollout_for_metrics_only(cfg, rollout, None)


@pytest.mark.parametrize(("preset", "by_kernel"), [("gspo", True), ("gmpo", False)])
def test_the_two_pass_route_takes_the_backends_own_terms(preset, by_kernel, monkeypatch):
    """A loss that needs whole sequences takes its terms on the padded layout as the backend's
    padded two-pass call does: Triton's terms kernel where it covers the loss (gspo), torch's
    token_terms where not (gmpo); the padded call's loss and gradient either way."""
    from fusedrl import fused_backend

    kernel_calls = []
    real = fused_backend._kernel_terms

    def counted(*args, **kwargs):
        kernel_calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_backend, "_kernel_terms", counted)
    cfg = CASES[preset][0]
    data = _batch(seed=14, per_token_adv=preset != "gmpo")
    want, want_grad = _call(fusedrl.policy_loss, data["padded"], cfg, "triton")
    kernel_calls.clear()
    got, got_grad = _call(
        fusedrl.policy_loss, data["packed"], cfg, "triton", cu_seqlens=data["cu_seqlens"]
    )
    assert len(kernel_calls) == int(by_kernel)
    _assert_equal_outputs(got, got_grad, want, want_grad, data["inside"])
    assert want_grad.abs().sum() > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_distillation_equals_the_padded_call(agg, backend):
    """distill_loss(student [N, V], teacher, cu_seqlens=) against its padded call: the divergence
    is each token's own, the sequences enter through the aggregation weights."""
    data = _batch(seed=17)
    gen = torch.Generator().manual_seed(3)
    teacher = torch.randn(*data["padded"]["mask"].shape, VOCAB, generator=gen)
    student = torch.nan_to_num(data["padded"]["logits"])
    config = LossConfig(agg=agg)
    runs = []
    for layout in ("padded", "packed"):
        cut = (lambda t: t[data["inside"]]) if layout == "packed" else (lambda t: t)
        leaf = cut(student).clone().requires_grad_(True)
        out = fusedrl.distill_loss(
            leaf,
            cut(teacher),
            cut(torch.where(data["padded"]["mask"], data["padded"]["labels"], 0)),
            cut(data["padded"]["mask"]),
            kind="jsd",
            config=config,
            backend=backend,
            **({"cu_seqlens": data["cu_seqlens"]} if layout == "packed" else {}),
        )
        runs.append((out, torch.autograd.grad(out.loss, leaf)[0]))
    (want, want_grad), (got, got_grad) = runs
    torch.testing.assert_close(got.loss, want.loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_grad, want_grad[data["inside"]], atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(got.metrics["distill"], want.metrics["distill"])
    with pytest.raises(NotImplementedError, match="sampled_reverse_kl"):
        fusedrl.distill_loss(
            cut(student),
            cut(teacher),
            data["packed"]["labels"].clamp_min(0),
            data["packed"]["mask"],
            kind="sampled_reverse_kl",
            advantages=torch.zeros(sum(LENGTHS)),
            cu_seqlens=data["cu_seqlens"],
        )
