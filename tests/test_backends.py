"""Every backend against fusedrl.reference: loss, gradients, logp, entropy and metrics.

The Triton kernels run on CPU tensors through the interpreter (TRITON_INTERPRET=1, set in
conftest); on a GPU machine the same tests run them compiled (tests/test_gpu.py adds real sizes).
"""

from __future__ import annotations

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, reference, row_blocks, torch_backend

from .conftest import (
    ALL_PRESETS,
    CUDA_ON_THE_HOST,
    LOGITS_BACKENDS,
    make_batch,
    run_loss,
)

ATOL = 1e-6


@pytest.fixture(params=LOGITS_BACKENDS)
def backend(request, monkeypatch):
    if request.param == "triton":
        launch = pytest.importorskip("fusedrl.kernels.launch")
        # Small vocab tiles so that every row spans several tiles and a partial last one.
        monkeypatch.setattr(launch, "MAX_BLOCK_V_INTERPRETED", 256)
    return request.param


def _impl(backend):
    def call(*args, **kwargs):
        return fusedrl.policy_loss(*args, backend=backend, **kwargs)

    return call


def assert_matches_reference(data, cfg, backend, *, atol=ATOL, rtol=1e-5, grad_atol=None, **kwargs):
    before = data["logits"].clone()
    ours, grad = run_loss(_impl(backend), data, cfg, return_entropy=True, **kwargs)
    assert torch.equal(before, data["logits"])  # inplace=False never writes into the logits
    ref, ref_grad = run_loss(reference.policy_loss, data, cfg, return_entropy=True, **kwargs)
    torch.testing.assert_close(ours.loss, ref.loss, atol=atol, rtol=rtol)
    torch.testing.assert_close(ours.logp, ref.logp, atol=atol, rtol=rtol)
    # The CUDA kernels sum each row relative to its label logit in one pass (no max): the entropy
    # lse - sum p z comes from sums whose terms are ~|max - label| (here up to ~30 bits at
    # T = 0.6), so it carries that many times their rounding; logp and the gradient do not.
    entropy_atol = 3e-5 if backend == CUDA_ON_THE_HOST else atol
    torch.testing.assert_close(ours.entropy, ref.entropy, atol=entropy_atol, rtol=rtol)
    assert grad.dtype == data["logits"].dtype and grad.shape == data["logits"].shape
    # a comparison of gradients that are all 0 (every token clipped or masked) proves nothing
    assert bool(data["mask"].any()) <= bool(torch.nan_to_num(ref_grad).abs().sum() > 0), cfg
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=grad_atol or atol, rtol=rtol)
    assert set(ours.metrics) == set(ref.metrics)
    for key, value in ref.metrics.items():
        assert ours.metrics[key].dim() == 0 and ours.metrics[key].dtype == torch.float32
        torch.testing.assert_close(ours.metrics[key], value, atol=atol, rtol=rtol, msg=key)
    return ours, grad


@pytest.mark.parametrize("name", ALL_PRESETS)
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_every_preset_fp32(name, per_token_adv, backend):
    data = make_batch(batch=4, time=9, vocab=1031, seed=3, per_token_adv=per_token_adv)
    # VESPO's weight exp(lambda + k log w - lambda w) of a sequence ratio w (a sum of up to T
    # log-ratios) amplifies the last-bit differences of logp by about T |k - lambda w|.
    rtol = 5e-5 if name == "vespo" else 1e-5
    assert_matches_reference(data, LossConfig.preset(name), backend, rtol=rtol)


# verl's rollout rejection sampling, token and sequence options chained (tests/test_rejection.py
# asserts that each option rejects some tokens, not all).
REJECTION_OPTIONS = {
    "rejection_token_seq": LossConfig(
        rejection="token_k1,seq_mean_k3", rejection_threshold="0.7_1.4,0.05"
    ),
    # (GSPO's 3e-4 / 4e-4 bounds would clip every sequence these rules keep: a zero gradient)
    "rejection_gspo": LossConfig.preset(
        "gspo",
        rejection="seq_sum_k1,seq_max_k2,token_k3",
        rejection_threshold="0.5_1.9,0.2,0.1",
        eps_low=0.2,
        eps_high=0.3,
    ),
    "rejection_seq_is_entropy": LossConfig(
        rejection="token_k2",
        rejection_threshold=0.05,
        is_correction="sequence_truncate",
        is_cap=1.5,
        entropy_coef=0.01,
        agg="seq-mean-token-mean",
    ),
    # trust-region sequence masking (arXiv 2512.23075), alone and chained with a rejection
    "trust_region_max": LossConfig(trust_region_delta=0.8),
    "trust_region_mean_gspo": LossConfig.preset(
        "gspo",
        trust_region_delta=0.1,
        trust_region_mode="mean",
        rejection="token_k1",
        rejection_threshold="0.5_2.0",
    ),
}
# M2PO: the tokens of largest (log r)^2 dropped until the rest's mean is below tau
M2PO_OPTIONS = {
    "m2po": LossConfig.preset("dapo", m2po_tau=0.02, entropy_coef=0.01),
    "m2po_seq_mean": LossConfig(m2po_tau=0.05, agg="seq-mean-token-mean"),
}
VERL_LOSS_OPTIONS = {
    "dro": LossConfig(loss="dro", dro_beta=0.3, kl="k3", beta=0.05),
    "dppo_tv": LossConfig(loss="dppo_tv", eps_low=0.002, eps_high=0.002, dppo_ratio_cap=1.2),
    "dppo_kl": LossConfig(loss="dppo_kl", eps_low=5e-4, eps_high=5e-4, dppo_ratio_cap=1.2),
    # prime-rl's DPPO + KL: kl_tau (log r)^2 on every counted token
    "dppo_tv_kl_tau": LossConfig(
        loss="dppo_tv", eps_low=0.002, eps_high=0.002, dppo_ratio_cap=1.2, kl_tau=0.05
    ),
    "kl_cov": LossConfig(loss="kl_cov", kl_cov_ratio=0.2, kl_cov_coef=0.5),
    "clip_cov": LossConfig(
        loss="clip_cov", clip_cov_ratio=0.1, clip_cov_lb=-0.5, clip_cov_ub=2.0, clip_cov_seed=3
    ),
    "clip_cov_seq_mean": LossConfig(
        loss="clip_cov",
        clip_cov_ratio=0.5,
        clip_cov_lb=-1.0,
        clip_cov_ub=1.0,
        clip_cov_seed=4,
        agg="seq-mean-token-mean",
        entropy_coef=0.01,
    ),
}
OPTIONS = {
    "dual_clip": LossConfig(dual_clip_c=1.5, eps_low=0.1),
    "delta": LossConfig(delta=1.25, eps_high=0.1),
    "entropy_bonus": LossConfig(entropy_coef=0.03),
    "entropy_bonus_seq": LossConfig(entropy_coef=-0.02, agg="seq-mean-token-mean"),
    "temperature": LossConfig(temperature=0.6, entropy_coef=0.01),
    "gspo_dual": LossConfig(ratio_level="sequence", dual_clip_c=2.0, eps_low=0.05, eps_high=0.05),
    "seq_sum": LossConfig(agg="seq-mean-token-sum"),
    "sum_norm": LossConfig(agg="seq-mean-token-sum-norm", norm_constant=13.0),
    "gmpo_seq_is": LossConfig(loss="gmpo", is_correction="sequence_mask", is_cap=1.5),
    "dcpo_kl": LossConfig(loss="dcpo", kl="k3", beta=0.1),
    "sapo_is": LossConfig(loss="sapo", is_correction="token_truncate", is_cap=1.2),
    # TRL's cispo with epsilon_high = 0.9: a cap below 1
    "cispo_cap_below_one": LossConfig(loss="cispo", eps_low=0.5, eps_high=-0.1),
    **{f"kl_{k}": LossConfig(kl=k, beta=0.2) for k in ("k1", "k2", "abs", "k3", "k1+", "k3+")},
    **{
        f"is_{m}": LossConfig(is_correction=m, is_cap=1.3)
        for m in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    },
    "is_low": LossConfig(is_correction="token_truncate", is_cap=1.3, is_cap_low=0.8),
    "luspo_token_dual": LossConfig(loss="luspo", ratio_level="token", dual_clip_c=2.0),
    "vespo_is_kl": LossConfig(
        loss="vespo",
        is_correction="token_truncate",
        is_cap=2.0,
        kl="k3",
        beta=0.1,
        vespo_k_pos=1.5,
        vespo_lambda_pos=2.5,
        vespo_k_neg=2.5,
        vespo_lambda_neg=1.5,
    ),
    "kl_bias_correction": LossConfig(kl="k3", beta=0.2, kl_bias_correction=True),
    "kl_bias_correction_gspo": LossConfig.preset(
        "gspo", kl="k1", beta=0.1, kl_bias_correction=True
    ),
    "off_policy_mask_is": LossConfig(off_policy_mask=0.05, is_correction="token_truncate"),
    "top_entropy_bonus_seq": LossConfig(
        top_entropy_quantile=0.4, entropy_coef=0.02, agg="seq-mean-token-mean"
    ),
    # verl's losses, with thresholds that make every branch act on make_batch's data
    # (tests/test_verl_losses.py asserts that they do).
    **VERL_LOSS_OPTIONS,
    **REJECTION_OPTIONS,
    **M2PO_OPTIONS,
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_options_fp32(name, backend):
    data = make_batch(batch=4, time=9, vocab=523, seed=4, per_token_adv=True)
    assert_matches_reference(data, OPTIONS[name], backend)


@pytest.mark.parametrize("name", ["dapo", "grpo", "gspo", "gmpo", "cispo"])
def test_normalizer(name, backend):
    data = make_batch(seed=5)
    assert_matches_reference(data, LossConfig.preset(name), backend, normalizer=17.0)
    assert_matches_reference(data, LossConfig.preset(name), backend, normalizer=torch.tensor(17.0))


def test_on_policy_without_old_logp(backend):
    data = make_batch(seed=6)
    data["old_logp"] = None
    out, _ = assert_matches_reference(data, LossConfig.preset("grpo"), backend)
    assert out.metrics["clipfrac"] == 0 and out.metrics["ppo_kl"] == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ALL_PRESETS)
def test_low_precision_gradients_within_one_rounding(dtype, name, backend):
    """bf16 / fp16 logits: the gradient against the float64 truth on the same logits, element by
    element, within one rounding of the dtype. A GPU and the torch backend round to nearest (half
    an ulp); the Triton interpreter truncates fp32 -> bf16 (one ulp): one ulp is allowed, plus a
    fp32 noise floor of 16 fp32 ulps of the row's largest entry (the label's 1 - p cancels in
    fp32)."""
    data = make_batch(
        batch=3, time=5, vocab=1031, dtype=dtype, seed=7, per_token_adv=name == "gspo_token"
    )
    cfg = LossConfig.preset(name).replace(entropy_coef=0.01)
    args = {k: v for k, v in data.items() if k != "logits"}
    truth_logits = data["logits"].detach().double().requires_grad_(True)
    truth = reference.policy_loss(truth_logits, config=cfg, **args)
    (truth_grad,) = torch.autograd.grad(truth.loss, truth_logits)
    ours, grad = run_loss(_impl(backend), data, cfg)
    assert grad.dtype == dtype
    assert_within_one_rounding(grad, truth_grad)
    torch.testing.assert_close(ours.loss.double(), truth.loss, atol=1e-5, rtol=1e-5)


def assert_within_one_rounding(grad: torch.Tensor, truth_grad: torch.Tensor) -> None:
    """A bf16 / fp16 gradient against its float64 truth: one ulp of its dtype per element
    (fp16's subnormals at their fixed spacing), plus 16 fp32 ulps of the row's largest entry."""
    ulp = torch.finfo(grad.dtype).eps * truth_grad.abs()
    if grad.dtype == torch.float16:  # subnormal fp16 has a fixed absolute spacing
        ulp = ulp.clamp_min(2.0**-24)
    noise = 16 * torch.finfo(torch.float32).eps * truth_grad.abs().amax(-1, keepdim=True)
    excess = (grad.double() - truth_grad).abs() - (ulp + noise)
    assert (excess <= 0).all(), f"{int((excess > 0).sum())} entries beyond one rounding"


def test_small_blocks_cover_every_row(monkeypatch, backend):
    """Force many blocks (and a partial last block) so the chunk loop is exercised."""
    monkeypatch.setattr(row_blocks, "BLOCK_ELEMENTS", 3 * 257)
    data = make_batch(batch=3, time=7, vocab=257, seed=8)
    assert_matches_reference(data, LossConfig.preset("grpo").replace(entropy_coef=0.01), backend)


def test_strided_view_of_prompt_and_completion_logits(monkeypatch, backend):
    """A [B, P+T, V] tensor sliced to the completion is used as a view, never copied."""
    monkeypatch.setattr(row_blocks, "BLOCK_ELEMENTS", 2 * 211)  # blocks of 2 rows, T = 7
    data = make_batch(batch=3, time=7, vocab=211, seed=9)
    full = torch.randn(3, 10, 211)
    full[:, 2:9] = data["logits"]
    view = full[:, 2:9]
    assert not view.is_contiguous()
    data["logits"] = view
    assert_matches_reference(data, LossConfig.preset("dapo").replace(entropy_coef=0.02), backend)
    with pytest.raises(RuntimeError):
        view.view(21, 211)  # the walk-per-sequence path is the one exercised


def test_flat_token_input(backend):
    data = make_batch(batch=1, time=11, vocab=331, seed=10, per_token_adv=True, empty_rows=())
    flat = {k: v[0] for k, v in data.items()}
    cfg = LossConfig.preset("dapo")
    out, grad = run_loss(_impl(backend), flat, cfg)
    ref, ref_grad = run_loss(reference.policy_loss, data, cfg)
    assert out.logp.shape == (11,)
    torch.testing.assert_close(out.loss, ref.loss)
    torch.testing.assert_close(grad, ref_grad[0])


def test_inplace_writes_gradient_into_logits(backend):
    data = make_batch(seed=11)
    cfg = LossConfig.preset("dapo")
    _, expected = run_loss(reference.policy_loss, data, cfg)
    logits = data["logits"].clone().requires_grad_(True)
    args = {k: v for k, v in data.items() if k != "logits"}
    seen = []
    logits.register_hook(lambda g: seen.append(g.data_ptr()))
    out = fusedrl.policy_loss(logits, config=cfg, inplace=True, backend=backend, **args)
    torch.testing.assert_close(logits.detach(), expected)  # the buffer now holds the gradient
    out.loss.backward()
    torch.testing.assert_close(logits.grad, expected)
    assert seen == [logits.data_ptr()]  # backward hands back the logits buffer: no second copy


def test_upstream_gradient_scales(backend):
    data = make_batch(seed=12)
    cfg = LossConfig.preset("grpo")
    logits = data["logits"].clone().requires_grad_(True)
    args = {k: v for k, v in data.items() if k != "logits"}
    out = fusedrl.policy_loss(logits, config=cfg, backend=backend, **args)
    (3.5 * out.loss).backward()
    _, ref_grad = run_loss(reference.policy_loss, data, cfg)
    torch.testing.assert_close(logits.grad, 3.5 * ref_grad)


@pytest.mark.parametrize("name", ALL_PRESETS)
@pytest.mark.parametrize("impl", ["torch", "triton", "reference"])
def test_all_masked_batch_gives_zero_loss_and_gradient(name, impl):
    data = make_batch(seed=13, with_nan_padding=True)
    data["mask"] = torch.zeros_like(data["mask"])
    data["logits"] = torch.full_like(data["logits"], float("nan"))
    data["labels"] = torch.full_like(data["labels"], -100)
    fn = reference.policy_loss if impl == "reference" else _impl(impl)
    cfg = LossConfig.preset(name).replace(entropy_coef=0.01)
    out, grad = run_loss(fn, data, cfg, return_entropy=True)
    assert out.loss.item() == 0.0
    assert torch.count_nonzero(grad) == 0
    for key, value in out.metrics.items():
        assert torch.isfinite(value), key


@pytest.mark.parametrize("name", ["dapo", "grpo", "gspo", "gmpo", "sapo"])
def test_nan_padding_in_masked_positions_is_ignored(name, backend):
    """Masked rows may hold NaN logits, NaN old/ref logp and label -100: nothing leaks."""
    clean = make_batch(seed=14)
    dirty = make_batch(seed=14, with_nan_padding=True)
    for key in ("old_logp", "ref_logp", "rollout_logp", "advantages"):
        if dirty[key].shape == dirty["mask"].shape:
            dirty[key] = dirty[key].masked_fill(~dirty["mask"], float("nan"))
    cfg = LossConfig.preset(name)
    out, grad = run_loss(_impl(backend), dirty, cfg)
    ref, ref_grad = run_loss(reference.policy_loss, clean, cfg)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(out.loss, ref.loss)
    torch.testing.assert_close(grad, ref_grad)


def test_neg_inf_logits_at_other_tokens_are_fine(backend):
    """Banned tokens (-inf, as after top-k filtering) have probability 0 and zero gradient."""
    data = make_batch(seed=15)
    banned = torch.zeros_like(data["logits"], dtype=torch.bool)
    banned[..., :100] = True
    banned.scatter_(-1, data["labels"][..., None], False)
    data["logits"] = data["logits"].masked_fill(banned, float("-inf"))
    cfg = LossConfig.preset("dapo").replace(entropy_coef=0.05)
    out, grad = assert_matches_reference(data, cfg, backend)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert torch.count_nonzero(grad[banned]) == 0


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's numpy
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logit_in_a_valid_row_propagates(bad, backend):
    """Documented: NaN/+inf in a counted row makes the loss NaN (never silently dropped)."""
    data = make_batch(seed=16)
    row = data["mask"].nonzero()[0]
    data["logits"][row[0], row[1], 5] = bad
    out, _ = run_loss(_impl(backend), data, LossConfig.preset("dapo"))
    assert torch.isnan(out.loss)


# ------------------------------------------------------------------------- token_logprobs
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("shape", [(13, 1031), (2, 5, 257)])
def test_token_logprobs_matches_reference(temperature, shape, backend):
    gen = torch.Generator().manual_seed(17)
    logits = torch.randn(*shape, generator=gen, dtype=torch.float64).float().requires_grad_(True)
    labels = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    w_logp, w_ent = torch.randn(shape[:-1], generator=gen), torch.randn(shape[:-1], generator=gen)
    results = []
    for fn in (fusedrl.token_logprobs, reference.token_logprobs):
        logp, ent = fn(
            logits, labels, temperature=temperature, return_entropy=True, backend=backend
        )
        (grad,) = torch.autograd.grad((logp * w_logp).sum() + (ent * w_ent).sum(), logits)
        results.append((logp, ent, grad))
    for ours, ref in zip(*results):
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=1e-5)


def test_token_logprobs_without_entropy_and_no_grad(backend):
    data = make_batch(seed=18, empty_rows=())
    with torch.no_grad():
        logp, ent = fusedrl.token_logprobs(data["logits"], data["labels"], backend=backend)
    assert ent is None and not logp.requires_grad and logp.dtype == torch.float32
    ref, _ = reference.token_logprobs(data["logits"], data["labels"])
    torch.testing.assert_close(logp, ref)
    logits = data["logits"].clone().requires_grad_(True)
    logp, ent = fusedrl.token_logprobs(logits, data["labels"], backend=backend)
    logp.sum().backward()
    ref_logits = data["logits"].clone().requires_grad_(True)
    reference.token_logprobs(ref_logits, data["labels"])[0].sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)


def test_batch_invariance_of_logp(backend):
    """A row's logp does not depend on what else is in the batch (bitwise)."""
    data = make_batch(batch=4, time=6, seed=19, empty_rows=())
    full, _ = fusedrl.token_logprobs(data["logits"], data["labels"], backend=backend)
    alone, _ = fusedrl.token_logprobs(data["logits"][2:3], data["labels"][2:3], backend=backend)
    assert torch.equal(full[2:3], alone)


def test_policy_loss_module_and_auto_backend():
    data = make_batch(seed=20)
    module = fusedrl.PolicyLoss("dapo")
    assert "eps_high=0.28" in repr(module)
    args = {k: v for k, v in data.items() if k != "logits"}
    out = module(data["logits"], **args)
    ref = reference.policy_loss(data["logits"], config=LossConfig.preset("dapo"), **args)
    torch.testing.assert_close(out.loss, ref.loss)
    auto = fusedrl.policy_loss(data["logits"], config=LossConfig.preset("dapo"), **args)
    torch.testing.assert_close(auto.loss, ref.loss)


# What each public surface of the policy loss does not take of policy_loss's arguments, and why;
# anything else policy_loss takes, every surface takes (a new argument joins them all, or here).
SURFACE_EXCEPTIONS = {
    # the LM-head form: hidden states and the head in place of logits that never exist
    "linear_policy_loss": {"logits", "inplace", "ref_logits"},
    # the oracle: one process, the whole vocabulary
    "reference.policy_loss": {"tp_group", "vocab_start", "vocab_size", "cp_group"},
    "PolicyLoss": set(),
}


def _surface_arguments() -> dict[str, set[str]]:
    import inspect

    def names(function):
        return set(inspect.signature(function).parameters) - {"self"}

    module = names(fusedrl.PolicyLoss.__init__) | names(fusedrl.PolicyLoss.forward)
    return {
        "linear_policy_loss": names(fusedrl.linear_policy_loss),
        "reference.policy_loss": names(reference.policy_loss),
        "PolicyLoss": module,
    }


def test_every_surface_accepts_what_policy_loss_accepts():
    """Every surface of the policy loss (the module, its constructor's settings and forward's
    keywords together; the LM-head form; the oracle) takes every argument of policy_loss
    but its named exceptions; a per-token temperature, a number temperature and a device
    entropy coefficient through the module equal the function's."""
    import inspect

    wanted = set(inspect.signature(fusedrl.policy_loss).parameters)
    for surface, takes in _surface_arguments().items():
        assert wanted - takes == SURFACE_EXCEPTIONS[surface], surface
    data = make_batch(seed=22)
    args = {k: v for k, v in data.items() if k != "logits"}
    for temperature in (torch.full(data["labels"].shape, 0.8), 0.8):
        extra = dict(temperature=temperature, entropy_coef=torch.tensor(0.01))
        out = fusedrl.PolicyLoss("dapo", backend="torch")(data["logits"], **args, **extra)
        want = fusedrl.policy_loss(
            data["logits"], config=LossConfig.preset("dapo"), **args, backend="torch", **extra
        )
        torch.testing.assert_close(out.loss, want.loss, atol=0, rtol=0)


def test_unavailable_backends_raise_clearly(monkeypatch):
    data = make_batch(seed=21)
    args = {k: v for k, v in data.items() if k != "logits"}
    with pytest.raises(RuntimeError, match="backend='cuda' .* needs CUDA tensors"):
        fusedrl.policy_loss(data["logits"], backend="cuda", **args)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="backend='triton' needs CUDA tensors"):
        fusedrl.policy_loss(data["logits"], backend="triton", **args)
    with pytest.raises(ValueError, match="backend"):
        fusedrl.policy_loss(data["logits"], backend="jax", **args)


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
@pytest.mark.parametrize("preset", ["dapo", "gspo", "gmpo"])
def test_precomputed_is_weights_equal_is_correction(mode, preset, backend):
    """is_weights= (as verl / TRL hand them over) == the same weights from rollout_logp."""
    if preset == "gmpo" and mode.startswith("token"):
        pytest.skip("gmpo takes sequence IS modes only")
    data = make_batch(seed=22, per_token_adv=preset != "gmpo")
    cfg = LossConfig.preset(preset)
    with_rollout = cfg.replace(is_correction=mode, is_cap=1.4)
    expected, expected_grad = run_loss(reference.policy_loss, data, with_rollout)
    inp = fusedrl._inputs.prepare_loss_inputs(
        data["logits"],
        data["labels"],
        data["advantages"],
        data["mask"],
        data["old_logp"],
        None,
        data["rollout_logp"],
        with_rollout,
        None,
    )
    weights = reference.is_weights(inp.old_logp, inp, with_rollout)
    if mode.startswith("sequence"):
        weights = weights[:, :1]  # [B, 1], TRL's layout of sequence weights
    plain = {k: v for k, v in data.items() if k != "rollout_logp"}
    out, grad = run_loss(_impl(backend), plain, cfg, is_weights=weights)
    torch.testing.assert_close(out.loss, expected.loss, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(grad, expected_grad, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(out.metrics["is_weight_mean"], expected.metrics["is_weight_mean"])


def test_is_weights_and_is_correction_are_exclusive():
    data = make_batch(seed=23)
    with pytest.raises(ValueError, match="is_weights and config.is_correction are exclusive"):
        fusedrl.policy_loss(
            **data, config=LossConfig(is_correction="token_mask"), is_weights=torch.ones(3, 7)
        )
    with pytest.raises(ValueError, match="is_weights shape"):
        fusedrl.policy_loss(**data, is_weights=torch.ones(3, 6))
    with pytest.raises(ValueError, match="gmpo.*one weight per sequence"):
        fusedrl.policy_loss(**data, config=LossConfig.preset("gmpo"), is_weights=torch.ones(3, 7))


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
@pytest.mark.parametrize("shape", [(2, 0, 7), (0, 3, 7)])
def test_token_logprobs_backward_of_an_empty_batch(backend, shape):
    """No rows: empty log-probs and entropy, and an empty gradient (no launch, no division)."""
    logits = torch.zeros(shape, requires_grad=True)
    labels = torch.zeros(shape[:2], dtype=torch.long)
    logp, entropy = fusedrl.token_logprobs(logits, labels, return_entropy=True, backend=backend)
    assert logp.shape == entropy.shape == shape[:2]
    (logp.sum() + entropy.sum()).backward()
    assert logits.grad.shape == shape


# ------------------------------------------------------------------------------ the contract
def _protocol_members(protocol) -> set[str]:
    own = set(vars(protocol)) | set(getattr(protocol, "__annotations__", {}))
    return {name for name in own if not name.startswith("_")}


def test_every_backend_module_keeps_the_backend_contract():
    """backends.Backend / LinearBackend: every member present on every module, and the
    capability flag says what the module has (no hasattr probing by the callers)."""
    import importlib

    from fusedrl import backends

    logits = [torch_backend, importlib.import_module("fusedrl.cuda_backend")]
    linear = [importlib.import_module("fusedrl.linear_torch")]
    if backends.TRITON_INSTALLED:
        logits.append(importlib.import_module("fusedrl.triton_backend"))
        linear.append(importlib.import_module("fusedrl.linear_triton"))
    assert _protocol_members(backends.Backend) >= {"policy_loss", "SUMS_PI_SQUARED_IN_PASS"}
    for module in logits:
        missing = _protocol_members(backends.Backend) - set(dir(module))
        assert not missing, (module.__name__, missing)
        squares = {"policy_loss_squares", "token_logprobs_squares"} <= set(dir(module))
        assert module.SUMS_PI_SQUARED_IN_PASS is squares, module.__name__
    for module in linear:
        missing = _protocol_members(backends.LinearBackend) - set(dir(module))
        assert not missing, (module.__name__, missing)
        assert module.squares_in_sweep() in (True, False)
        if module.squares_in_sweep():
            assert hasattr(module, "token_logprobs_squares"), module.__name__


def test_loss_inputs_are_built_once():
    """LossInputs is frozen: a changed input is a new object, whose derived values (the masked
    means' weights) are its own, never the old mask's."""
    import dataclasses

    from fusedrl._inputs import prepare_loss_inputs
    from fusedrl.token_terms import masked_mean

    data = make_batch(vocab=131, seed=3)
    inp = prepare_loss_inputs(
        data["logits"],
        data["labels"],
        data["advantages"],
        data["mask"],
        None,
        None,
        None,
        LossConfig(),
        None,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        inp.mask = inp.mask * 0  # type: ignore[misc]
    ones = torch.ones_like(inp.mask)
    assert masked_mean(ones, inp) == 1.0 and inp.derived  # computed once, kept
    halved = dataclasses.replace(inp, mask=inp.mask * 0.5)
    assert not halved.derived  # not the old mask's
    assert masked_mean(ones, halved) == 1.0
