"""The on-chip sampled-set kernel (kernels/sampling.py) on the interpreter.

It writes the logits with -inf outside each row's sampled set. The kept set is checked against
the reference's `_vllm_sampling_set` (written from vLLM's sampler: softmax, topk, sort) and the
written tensor bit for bit against `fusedrl.sampling` (torch.topk / sort), on odd shapes where
each filter, the order between them, ties, banned tokens and NaN rows all act.
"""

from __future__ import annotations

import math

import pytest
import torch

from fusedrl.reference import _vllm_sampling_set
from fusedrl.sampling import SamplingMask, mask_to_sampled_set

from .conftest import needs_interpreter

pytestmark = needs_interpreter

VOCAB = 1031  # 3 interpreted tiles of 512, the last partial


def _write(
    logits, labels, temperature, top_k=None, top_p=None, min_p=None, out=None, row_temps=None
):
    from fusedrl.kernels.sampling import write_sampled_set

    out = torch.full_like(logits, 7.0) if out is None else out
    write_sampled_set(logits, labels, out, temperature, top_k, top_p, min_p, row_temps=row_temps)
    return out


def _inputs(seed, dtype=torch.float32, batch=3, time=5, vocab=VOCAB, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(batch, time, vocab, generator=gen)).to(dtype)
    labels = torch.randint(0, vocab, (batch, time), generator=gen)
    return logits, labels


def _kept(out):
    return out != -math.inf


def _reference_kept(logits, labels, temperature, top_k, top_p, min_p):
    keep = _vllm_sampling_set(logits.float() / temperature, labels, top_k, top_p, min_p)
    return keep & (logits != -math.inf)


def _assert_same_set(out, logits, labels, temperature, top_k=None, top_p=None, min_p=None):
    """The kernel's set is the reference's, except that ties at the top_p boundary are all kept
    (vLLM's unstable sort keeps an arbitrary part of them; bf16 logits tie often)."""
    expected = _reference_kept(logits, labels, temperature, top_k, top_p, min_p)
    extra = _kept(out) & ~expected
    assert not (expected & ~_kept(out)).any(), "the kernel dropped a token vLLM keeps"
    for b, t, v in extra.nonzero().tolist():
        row_expected = expected[b, t].clone()
        row_expected[labels[b, t].clamp_min(0)] = False  # the label may sit below the set
        assert logits[b, t, v] == logits[b, t][row_expected].min(), "an extra token, not a tie"


def _assert_matches_the_torch_select(
    logits, labels, temperature, top_k, top_p, min_p, row_temps=None
):
    """The kernel's set against the reference's and the torch select's (bit for bit); with
    `row_temps` ([B, T]) each row at its own temperature, in place of `temperature`."""
    out = _write(logits, labels, temperature, top_k, top_p, min_p, row_temps=row_temps)
    rows_t = temperature if row_temps is None else row_temps[..., None]
    _assert_same_set(out, logits, labels, rows_t, top_k, top_p, min_p)
    column = temperature if row_temps is None else row_temps.view(-1, 1)
    torch_select = mask_to_sampled_set(
        logits.view(-1, VOCAB), labels.view(-1), column, SamplingMask(top_k, top_p, min_p)
    )
    assert torch.equal(out, torch_select.view_as(out))
    return out


# (temperature, top_k, top_p, min_p)
FILTERS = {
    "top_k": (1.0, 7, None, None),
    "top_k_hot": (0.6, 40, None, None),
    "top_p": (1.0, None, 0.9, None),
    "top_p_cold": (1.7, None, 0.5, None),
    "min_p": (0.7, None, None, 0.05),
    "top_k_top_p": (1.0, 30, 0.8, None),
    "all": (0.8, 20, 0.9, 0.05),
    "min_p_binds": (1.0, 200, None, 0.3),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(FILTERS))
def test_kept_set_matches_the_reference_and_the_torch_select(name, dtype):
    temperature, top_k, top_p, min_p = FILTERS[name]
    logits, labels = _inputs(seed=len(name), dtype=dtype)
    labels[0, 0] = -100  # an ignored position: its "label" is token 0
    out = _assert_matches_the_torch_select(logits, labels, temperature, top_k, top_p, min_p)
    assert torch.equal(out[_kept(out)], logits[_kept(out)])  # kept logits are copied unchanged
    kept = _kept(out).sum(-1)
    assert (kept < VOCAB).all() and (kept >= 1).all()  # every row masked something
    if name == "min_p_binds":  # fewer than top_k survive min_p: min_p's floor decides
        assert (kept < top_k).any()


def test_ties_at_the_top_k_boundary_are_all_kept_and_renormalised_over():
    """vLLM keeps every logit equal to the k-th largest, and top_p then renormalises over all
    of them (fusedrl.sampling's topk takes only k: it must count the others' mass too)."""
    logits, labels = _inputs(seed=3, batch=2, time=2)
    kth = logits.topk(5, -1).values[..., 4:5]
    logits[..., :6] = kth  # six more copies of the 5th largest value (one row's own included)
    out = _write(logits, labels, 1.0, top_k=5)
    assert (_kept(out).sum(-1) > 5).all()
    _assert_same_set(out, logits, labels, 1.0, top_k=5)
    for top_p in (0.6, 0.8, 0.9, 0.95):
        _assert_matches_the_torch_select(logits, labels, 1.0, 5, top_p, None)


def test_few_candidates_are_gathered_and_crowded_rows_take_the_radix_selects(radix_rows):
    """top_k (up to COMPACT_TOP_K) and top_p gather the logits at or above a threshold and
    select among them in registers; a row where more than CANDIDATES lie there (ties with the
    k-th largest) or none (all -inf), and under top_p a row whose nucleus is wider than the
    gathered logits (nearly flat), takes the radix passes instead. Both give the reference's
    set, and the torch select's bit for bit; the other rows never reach the radix passes."""
    from fusedrl.kernels.sampling import CANDIDATES, COMPACT_TOP_K, _gathers_candidates

    crowd = CANDIDATES.value + 40
    logits, labels = _inputs(seed=11, batch=2, time=3)
    kth = logits[0, 0].topk(5).values[4]
    logits[0, 0, 100 : 100 + crowd] = kth  # ties with the 5th largest: k + crowd candidates
    logits[0, 1] = 0.01 * logits[0, 1]  # nearly flat: min_p 0.05 keeps every token
    logits[1, 2] = -math.inf  # nothing to gather
    # Exactly CANDIDATES at or above the threshold (the scratch full), and one more: 255 or
    # 256 logits of 10 over 128 groups, then the row max (the last gathered) far above them.
    logits[1, :2] = -20.0
    logits[1, 0, : CANDIDATES.value - 1] = 10.0
    logits[1, 1, : CANDIDATES.value] = 10.0
    logits[1, :2, 900] = 18.0
    crowded, flat, empty, one_over = 1, 1, 1, 1
    cases = {  # (top_k, top_p, min_p): the rows that take (top_k's, top_p's) radix passes
        (5, None, None): (crowded + empty + one_over, 0),
        (5, 0.9, None): (crowded + empty + one_over, crowded + empty + one_over),
        (None, 0.9, None): (0, crowded + flat + empty + one_over),
        (None, 0.05, None): (0, crowded + empty + one_over),  # a nucleus of ~50: gathered
        # min_p's floor (18 + 0.8 log 0.05) leaves the row max alone above it in those two
        (None, 0.9, 0.05): (0, crowded + flat + empty),
        (5, 0.8, 0.05): (crowded + empty, crowded + empty),
    }
    for (top_k, top_p, min_p), radix in cases.items():
        assert _gathers_candidates(top_k is not None, top_p is not None, min_p is not None, top_k)
        radix_rows.update(_count_select=0, _mass_select=0)
        _assert_matches_the_torch_select(logits, labels, 0.8, top_k, top_p, min_p)
        assert (radix_rows["_count_select"], radix_rows["_mass_select"]) == radix
    assert (logits[0, 0] >= kth).sum() > CANDIDATES.value  # the crowded rows crowd
    assert (logits[1, 0] >= 10).sum() == CANDIDATES.value  # the full scratch, and one over
    assert (logits[1, 1] >= 10).sum() == CANDIDATES.value + 1
    assert (logits[0, 1] >= logits[0, 1].max() + 0.8 * math.log(0.05)).sum() > CANDIDATES.value
    assert _kept(_write(logits, labels, 0.8, 5))[0, 0].sum() > crowd  # the ties are kept
    # the gathered rows: up to COMPACT_TOP_K; beyond it, the radix passes only
    assert not _gathers_candidates(True, True, False, COMPACT_TOP_K + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_p_alone_is_decided_by_the_gathered_logits_where_they_hold_the_nucleus(
    dtype, radix_rows
):
    """Without top_k, top_p gathers a guess of TOP_P_GUESS groups' logits and sums the whole
    row's mass in the same read: a row whose nucleus lies among them is decided there, one
    whose nucleus is wider (its smallest kept logit below the gathered ones) by the radix
    passes. Rows from peaked to flat, at several top_p and temperatures, and each row at its
    own (per-token temperatures: the row's mass and its pairs weighed at the row's own)."""
    from fusedrl.kernels.sampling import CANDIDATES

    logits, labels = _inputs(seed=13, batch=4, time=6, dtype=torch.float32)
    logits = logits * torch.linspace(0.05, 3.0, 24).view(4, 6, 1)  # from flat to peaked
    logits = logits.to(dtype)
    row_temps = 0.5 + torch.rand(4, 6, generator=torch.Generator().manual_seed(5))
    for temperature, top_p in [(1.0, 0.9), (0.7, 0.95), (1.3, 0.5), ("per row", 0.8)]:
        radix_rows.update(_mass_select=0)
        rows_t = row_temps if temperature == "per row" else None
        temperature = 1.0 if rows_t is not None else temperature
        out = _assert_matches_the_torch_select(
            logits, labels, temperature, None, top_p, None, row_temps=rows_t
        )
        kept = _kept(out).sum(-1)
        assert 0 < radix_rows["_mass_select"] < 24  # both ways acted
        # a nucleus wider than any gather takes the radix passes; most narrow ones do not
        assert radix_rows["_mass_select"] >= (kept > CANDIDATES.value).sum()
        assert radix_rows["_mass_select"] <= (kept > 40).sum()


def test_banned_tokens_and_rows_with_fewer_than_k_candidates():
    logits, labels = _inputs(seed=4, batch=2, time=3)
    logits[..., ::2] = -math.inf  # half the vocab banned
    logits[1, 2, 10:] = -math.inf  # a row with 5 finite logits left: top_k=50 keeps all of them
    labels[1, 2] = 1
    out = _write(logits, labels, 1.0, top_k=50)
    assert _kept(out)[1, 2].sum() == torch.isfinite(logits[1, 2]).sum() == 5
    _assert_same_set(out, logits, labels, 1.0, top_k=50)
    out = _write(logits, labels, 1.0, top_k=50, top_p=0.95)
    assert _kept(out)[1, 2].sum() < 5  # top_p drops some of the five
    _assert_same_set(out, logits, labels, 1.0, top_k=50, top_p=0.95)


def test_the_label_is_kept_outside_the_set():
    logits, labels = _inputs(seed=5)
    labels = logits.argmin(-1)  # the least likely token of every row
    out = _write(logits, labels, 1.0, top_k=3, top_p=0.5, min_p=0.1)
    assert torch.equal(out.gather(-1, labels[..., None]), logits.gather(-1, labels[..., None]))
    assert (_kept(out).sum(-1) >= 2).all()  # the label and the top token


def test_a_nan_row_stays_nan():
    logits, labels = _inputs(seed=6, batch=1, time=3)
    logits[0, 1, 17] = math.nan
    out = _write(logits, labels, 1.0, top_k=5, top_p=0.9, min_p=0.05)
    assert out[0, 1, 17].isnan()  # the row's log-softmax then reads NaN, as without the mask
    rows = slice(0, 3, 2)  # the other rows are unaffected
    _assert_same_set(out[:, rows], logits[:, rows], labels[:, rows], 1.0, 5, 0.9, 0.05)


def test_a_nan_counts_among_the_k_largest_as_in_torch_topk():
    """top_k's keys rank NaN above +inf, as torch.topk does: a row with NaNs keeps fewer of its
    finite logits. The gathered way cannot see a NaN (it gathers by comparison), so such a
    row takes the radix passes; the floors equal the torch select's."""
    from fusedrl.kernels.sampling import sampled_floors
    from fusedrl.sampling import sampling_floor

    logits, labels = _inputs(seed=12, batch=1, time=3)
    logits[0, 1, [3, 500, 900]] = math.nan
    for top_p in (None, 0.9):
        floors = sampled_floors(logits, labels, 1.0, 5, top_p, None)
        expected = sampling_floor(logits.view(-1, VOCAB), SamplingMask(5, top_p, None))
        assert torch.equal(floors.view(-1), expected)
    assert (logits[0, 1] >= floors[0, 1]).sum() == 2  # the NaNs took three of the five


def test_in_place_and_on_a_strided_slice():
    """[B, P+T, V] logits sliced to [B, T, V] (batch and time strides, no copy), written in
    place and into a separate buffer."""
    full, labels = _inputs(seed=7, time=9)
    logits = full[:, 4:]
    labels = labels[:, 4:]
    expected = _write(logits.contiguous(), labels.contiguous(), 0.9, top_k=10, top_p=0.8)
    separate = _write(logits, labels, 0.9, top_k=10, top_p=0.8)
    assert torch.equal(separate, expected)
    before = full[:, :4].clone()
    _write(logits, labels, 0.9, top_k=10, top_p=0.8, out=logits)
    assert torch.equal(logits, expected) and torch.equal(full[:, :4], before)


def test_filters_that_are_off_copy_the_row():
    logits, labels = _inputs(seed=8)
    for kwargs in (dict(top_k=VOCAB), dict(top_p=1.0), dict(min_p=0.0), {}):
        assert torch.equal(_write(logits, labels, 1.0, **kwargs), logits)
    out = _write(logits[:, :0], labels[:, :0], 1.0, top_k=3)  # no rows: nothing to do
    assert out.shape == (3, 0, VOCAB)


@pytest.mark.parametrize("temperature", [0.7, 0.9, 1.7])
def test_min_p_boundary_to_the_ulp(temperature):
    """Logits at each float within 3 ulps of min_y x T: exactly those with x / T >= min_y (as
    vLLM computes it, in fp32) are kept, although min_y x T itself rounds to either side."""
    logits, labels = _inputs(seed=9, batch=4, time=8)
    min_p = 0.05
    min_y = logits.amax(-1) / temperature + math.log(min_p)
    guess = (min_y * temperature)[..., None]
    below, above = guess, guess
    neighbours = [guess]
    for _ in range(3):
        below = torch.nextafter(below, torch.tensor(-math.inf))
        above = torch.nextafter(above, torch.tensor(math.inf))
        neighbours = [below, *neighbours, above]
    logits[..., 100:107] = torch.cat(neighbours, -1)
    labels[:] = 0
    out = _write(logits, labels, temperature, min_p=min_p)
    expected = logits / temperature >= min_y[..., None]
    expected[..., 0] = True
    assert torch.equal(_kept(out), expected)
    inside = expected[..., 100:107].sum(-1)
    assert ((inside > 0) & (inside < 7)).all()  # the boundary falls among the neighbours
    # The guess is off by an ulp in some row: the kernel's steps to the boundary acted.
    assert (inside != 4).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_floors_among_negative_logits(dtype):
    """All logits negative: the keys are the inverted bits, whose low bits (below a bf16 / fp16
    mantissa) are ones, so the select's prefix sits just below the floor's value, never on
    another logit's."""
    logits, labels = _inputs(seed=10, dtype=torch.float32, scale=2.0)
    logits = (logits - 30.0).to(dtype)
    for top_k, top_p, min_p in [(500, None, None), (None, 0.95, None), (300, 0.9, 0.001)]:
        out = _write(logits, labels, 0.9, top_k, top_p, min_p)
        expected = mask_to_sampled_set(
            logits.view(-1, VOCAB), labels.view(-1), 0.9, SamplingMask(top_k, top_p, min_p)
        )
        assert torch.equal(out, expected.view_as(out))
        kept = _kept(out).sum(-1)
        assert (kept > 1).all() and (kept < VOCAB).all()
