"""linear_policy_loss(skip_masked_rows=True / live_rows=n): the LM head makes logits for the live
rows alone (mask != 0), gathered, and every output is as without it: against the oracle on the
materialised logits and against the same call without the skip, on both backends, token-level
(one sweep) and sequence-level (two sweeps) losses, per-token temperatures, sampling replay and a
soft cap, NaN-padded masked rows, strided and flat hidden states; the rows that reach the head
are counted, so a skip that skips nothing fails."""

from __future__ import annotations

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, linear_torch, linear_triton
from fusedrl.distill import heads as distill_heads

from .conftest import (
    BACKENDS,
    assert_lm_head_form_matches_the_oracle,
    make_batch,
    needs_interpreter,
)

VOCAB, HIDDEN = 131, 16


def _head(seed=4, batch=3, time=7):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, time, HIDDEN, generator=gen)
    weight = 0.5 * torch.randn(VOCAB, HIDDEN, generator=gen)
    data = make_batch(batch=batch, time=time, vocab=VOCAB, seed=seed)
    rows = {k: v for k, v in data.items() if k != "logits"}
    assert 0 < int(rows["mask"].sum()) < rows["mask"].numel()  # some rows live, some not
    return hidden, weight, rows


@pytest.fixture
def head_rows(monkeypatch):
    """The number of rows of hidden states each call sends to the LM head (both backends gather
    them with linear_torch.masked_rows); small chunks, so that several chunks run."""
    monkeypatch.setattr(linear_triton, "GRAD_CHUNK_BYTES", 5 * VOCAB * 4)
    monkeypatch.setattr(fusedrl.row_blocks, "BLOCK_ELEMENTS", 5 * VOCAB)
    seen = []
    real = linear_torch.masked_rows

    def counted(lin, hidden=None):
        rows = real(lin, hidden)
        seen.append(rows.shape[0])
        return rows

    for module in (linear_torch, linear_triton, distill_heads):
        monkeypatch.setattr(module, "masked_rows", counted)
    return seen


CASES = {
    "dapo": ("dapo", {}),  # token-level: one sweep
    "gspo": ("gspo", {}),  # sequence-level: stats, then the gradient sweep
    "grpo-kl-entropy": ("grpo", dict(entropy_coef=0.01, agg="seq-mean-token-mean")),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_equals_the_oracle_from_the_live_rows_alone(case, backend, head_rows):
    preset, overrides = CASES[case]
    hidden, weight, rows = _head()
    temps = 0.6 + torch.rand(rows["mask"].shape, generator=torch.Generator().manual_seed(1))
    live = int(rows["mask"].sum())
    ours, _ = assert_lm_head_form_matches_the_oracle(
        hidden,
        weight,
        rows,
        backend,
        fused_only=dict(skip_masked_rows=True),
        config=LossConfig.preset(preset, **overrides),
        temperature=temps,
    )
    assert head_rows and set(head_rows) == {live}
    assert (ours.logp[~rows["mask"]] == 0).all()


def _outputs(backend, hidden, weight, bias, rows, **kwargs):
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    out = fusedrl.linear_policy_loss(
        leaves[0],
        leaves[1],
        **rows,
        bias=leaves[2],
        backend=backend,
        return_entropy=True,
        **kwargs,
    )
    grads = torch.autograd.grad(out.loss, leaves)
    extra = [] if out.sum_pi_squared is None else [out.sum_pi_squared]
    return [out.loss, out.logp, out.entropy, *extra, *out.metrics.values(), *grads]


def _assert_same(with_skip, without):
    assert len(with_skip) == len(without)
    for got, want in zip(with_skip, without):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_output_as_without_it(backend, head_rows):
    """NaN padding in the skipped rows (never read), a bias, a strided [B, P+T, H] view, sampling
    replay with a soft cap, sum pi^2; and the [N, H] form."""
    hidden, weight, rows = _head(seed=7)
    mask = rows["mask"]
    body = torch.randn(3, 2 + 7, HIDDEN)
    body[:, 2:][~mask] = float("nan")
    strided = body[:, 2:]  # the model body's [B, P+T, H] output, completion rows
    bias = torch.randn(VOCAB)
    cfg = LossConfig.preset("dapo", top_k=20)
    kwargs = dict(config=cfg, softcap=4.0, return_sum_pi_squared=False)
    without = _outputs(backend, torch.nan_to_num(strided), weight, bias, rows, **kwargs)
    head_rows.clear()
    with_skip = _outputs(backend, strided, weight, bias, rows, skip_masked_rows=True, **kwargs)
    _assert_same(with_skip, without)
    assert set(head_rows) == {int(mask.sum())}

    flat = {k: v.reshape(-1) for k, v in rows.items() if k != "advantages"}
    flat["advantages"] = rows["advantages"][:, None].expand(mask.shape).reshape(-1)
    packed = torch.where(mask[..., None], hidden, float("nan")).reshape(-1, HIDDEN)
    sq = dict(config=LossConfig.preset("dapo"), return_sum_pi_squared=True)
    without = _outputs(backend, torch.nan_to_num(packed), weight, bias, flat, **sq)
    head_rows.clear()
    with_skip = _outputs(backend, packed, weight, bias, flat, live_rows=int(mask.sum()), **sq)
    _assert_same(with_skip, without)
    assert set(head_rows) == {int(mask.sum())}


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_heads_skip_them_alike(backend, head_rows):
    """The exact KL's reference head (one sweep and two) and distillation's teacher head make no
    logits for the masked rows either: each skipped call's gathers are counted, the student's and
    the teacher's (sampled_reverse_kl's two log-prob calls have no mask: every row, by design)."""
    hidden, weight, rows = _head(seed=5)
    rows.pop("ref_logp")  # the exact KL reads the reference head instead
    rows.pop("old_logp")  # on-policy: no sequence is clipped, each one's policy gradient acts
    mask, live = rows["mask"], int(rows["mask"].sum())
    gen = torch.Generator().manual_seed(6)
    ref_hidden = torch.randn(hidden.shape, generator=gen)
    ref_hidden[~mask] = float("nan")  # the teacher's padding: never read
    ref_weight = 0.5 * torch.randn(VOCAB, HIDDEN, generator=gen)
    for preset in ("dapo", "gspo"):
        cfg = LossConfig.preset(preset, kl="full", beta=0.2)
        temps = 0.6 + torch.rand(mask.shape, generator=gen)
        heads = dict(config=cfg, ref_weight=ref_weight, temperature=temps)
        outs = []
        for skip in (dict(), dict(live_rows=live)):
            ref = ref_hidden if skip else torch.nan_to_num(ref_hidden)
            head_rows.clear()
            outs.append(
                _outputs(
                    backend,
                    hidden,
                    weight,
                    torch.zeros(VOCAB),
                    rows,
                    ref_hidden=ref,
                    **heads,
                    **skip,
                )
            )
        _assert_same(outs[1], outs[0])
        sweeps = 1 if preset == "dapo" else 2  # gspo: statistics, then the gradient
        assert head_rows == [live, live] * sweeps  # the policy's and the reference's, each sweep
    labels = torch.where(mask, rows["labels"], 0)
    for kind in ("jsd", "sampled_reverse_kl"):
        outs = []
        for skip in (False, True):
            student = hidden.clone().requires_grad_(True)
            head_rows.clear()
            out = fusedrl.linear_distill_loss(
                student,
                weight,
                ref_hidden if skip else torch.nan_to_num(ref_hidden),
                ref_weight,
                labels,
                mask,
                kind=kind,
                backend=backend,
                skip_masked_rows=skip,
            )
            outs.append([out.loss, out.logp, *torch.autograd.grad(out.loss, student)])
        _assert_same(outs[1], outs[0])
        if kind == "jsd":
            assert head_rows == [live, live]  # the student's and the teacher's
        else:  # the policy loss's; its two log-prob calls (Triton gathers theirs) take every row
            assert head_rows.count(live) == 1 and set(head_rows) <= {live, mask.numel()}


@needs_interpreter
def test_the_on_chip_design(head_rows, monkeypatch):
    monkeypatch.setenv(linear_triton.DESIGN_ENV, "on-chip")
    hidden, weight, rows = _head(seed=9)
    for preset in ("dapo", "gspo"):
        assert_lm_head_form_matches_the_oracle(
            hidden,
            weight,
            rows,
            "triton",
            fused_only=dict(skip_masked_rows=True),
            config=LossConfig.preset(preset),
        )
    assert set(head_rows) == {int(rows["mask"].sum())}


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_all_masked_batch_gives_zero(backend, head_rows):
    hidden, weight, rows = _head()
    rows["mask"] = torch.zeros_like(rows["mask"])
    hidden[:] = float("nan")
    for count in (None, 0):
        outs = _outputs(
            backend,
            hidden,
            weight,
            torch.zeros(VOCAB),
            rows,
            config=LossConfig.preset("dapo"),
            skip_masked_rows=True,
            live_rows=count,
        )
        assert outs[0].item() == 0.0
        for t in outs:
            assert torch.isfinite(t).all() and not t.any()
    assert set(head_rows) == {0}


def test_a_wrong_live_row_count_raises():
    hidden, weight, rows = _head()
    live = int(rows["mask"].sum())
    ok = fusedrl.linear_policy_loss(hidden, weight, **rows, live_rows=live, backend="torch")
    torch.testing.assert_close(ok.loss, fusedrl.linear_policy_loss(hidden, weight, **rows).loss)
    for wrong in (live - 1, live + 1):
        with pytest.raises(RuntimeError, match="live_rows"):
            fusedrl.linear_policy_loss(hidden, weight, **rows, live_rows=wrong, backend="torch")


def test_misuse_is_named():
    hidden, weight, rows = _head()
    call = lambda **kw: fusedrl.linear_policy_loss(hidden, weight, **rows, **kw)  # noqa: E731
    with pytest.raises(TypeError, match="skip_masked_rows must be a bool"):
        call(skip_masked_rows=1)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="live_rows must be"):
            call(live_rows=bad)
    with pytest.raises(ValueError, match="live_rows=22 exceeds the 21 rows"):
        call(live_rows=22)
    # Under tensor parallelism (tests/test_tensor_parallel.py, 2 and 3 ranks); a group of one is
    # the plain call.
    one = call(skip_masked_rows=True, vocab_start=0, vocab_size=VOCAB)
    torch.testing.assert_close(one.loss, call().loss)
