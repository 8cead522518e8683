"""softcap= / logit_scale= of the LM-head losses (fusedrl/logit_transform.py): Gemma 2/3's
final_logit_softcapping and Cohere's / Granite's logit scale applied to each chunk of logits the
losses make, the gradient through tanh included.

The oracle is `fusedrl.reference` on logits transformed here by autograd (tanh), materialised;
the data saturates the cap (|scaled logit| > cap on a share of the vocabulary, asserted) so that
a loss without the transform, or without its derivative, is far off. Then the models: the
transform is read from their configs, and the trainer's fused LM head on a soft-capped Gemma 2
gives the logits path's gradients.
"""

from __future__ import annotations

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, linear_triton, reference
from fusedrl.distill import heads as pair
from fusedrl.logit_transform import check_logit_transform, model_logit_transform

from .conftest import BACKENDS, LOGITS_BACKENDS

CAP, SCALE = 4.0, 1.7


def _data(seed=0, batch=3, time=7, hidden=16, vocab=131, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, time + 1, (batch,), generator=gen)
    mask = torch.arange(time)[None, :] < lengths[:, None]
    mask[1] = False
    return {
        "hidden": torch.randn(batch, time, hidden, generator=gen).to(dtype),
        # large logits: the cap saturates (checked below)
        "weight": (1.5 * torch.randn(vocab, hidden, generator=gen)).to(dtype),
        "bias": (0.5 * torch.randn(vocab, generator=gen)).to(dtype),
        "labels": torch.randint(0, vocab, (batch, time), generator=gen),
        "advantages": torch.randn(batch, generator=gen),
        "mask": mask,
    }


def _transformed(logits, softcap, scale):
    logits = logits * scale
    return softcap * torch.tanh(logits / softcap) if softcap is not None else logits


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 5 rows (Triton's design) and blocks of 5 rows (torch's): boundaries inside
    the sequences."""
    monkeypatch.setattr(linear_triton, "GRAD_CHUNK_BYTES", 5 * 131 * 4)
    monkeypatch.setattr(fusedrl.row_blocks, "BLOCK_ELEMENTS", 5 * 131)
    monkeypatch.setattr(pair, "PAIR_CHUNK_BYTES", 2 * 5 * 131 * 4)


CASES = {
    # (preset, overrides, softcap, logit_scale)
    "dapo-cap": ("dapo", dict(entropy_coef=0.01, temperature=0.8), CAP, None),
    "dapo-scale": ("dapo", dict(), None, SCALE),
    "gspo-cap-and-scale": ("gspo", dict(), CAP, SCALE),
    "grpo-top-k-cap": ("grpo", dict(top_k=20, beta=0.0), CAP, None),
    "dapo-exact-kl-cap": ("dapo", dict(kl="full", beta=0.3), CAP, SCALE),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_linear_policy_loss_equals_the_oracle(case, backend, small_chunks):
    preset, overrides, softcap, scale = CASES[case]
    cfg = LossConfig.preset(preset, **overrides)
    data = _data(seed=len(case))
    exact_kl = cfg.full_kl
    ref_weight = 0.8 * data["weight"].flip(0)  # a reference head: another vocabulary order
    leaves = [data[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    with torch.no_grad():  # the sampler: near the policy, so that the ratios straddle the clip
        raw = data["hidden"] @ data["weight"].T + data["bias"]
        now = reference.token_logprobs(
            _transformed(raw, softcap, scale or 1.0), data["labels"], cfg.temperature
        )[0]
    old = now + 0.15 * torch.randn(now.shape, generator=torch.Generator().manual_seed(3))
    kwargs = dict(old_logp=old, config=cfg, return_entropy=True)
    ours = fusedrl.linear_policy_loss(
        leaves[0],
        leaves[1],
        data["labels"],
        data["advantages"],
        data["mask"],
        bias=leaves[2],
        backend=backend,
        softcap=softcap,
        logit_scale=scale,
        ref_weight=ref_weight if exact_kl else None,
        **kwargs,
    )
    grads = torch.autograd.grad(ours.loss, leaves)
    oracle_leaves = [data[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    h, w, b = oracle_leaves
    raw = h @ w.T + b
    logits = _transformed(raw, softcap, scale if scale is not None else 1.0)
    if softcap is not None:  # the cap acts: a share of the logits is pressed toward it
        assert ((raw * (scale or 1.0)).abs() > CAP)[data["mask"]].float().mean() > 0.3
    ref_args = {}
    if exact_kl:
        ref_raw = data["hidden"] @ ref_weight.T
        ref_args["ref_logits"] = _transformed(ref_raw, softcap, scale or 1.0).detach()
    want = reference.policy_loss(
        logits, data["labels"], data["advantages"], data["mask"], **kwargs, **ref_args
    )
    want_grads = torch.autograd.grad(want.loss, oracle_leaves)
    torch.testing.assert_close(ours.loss, want.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.logp, want.logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.entropy, want.entropy, atol=1e-5, rtol=1e-5)
    for got, expected in zip(grads, want_grads):
        assert expected.abs().max() > 1e-2  # a gradient worth checking
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    # Without the transform the same call is far off: the transform acted.
    plain = fusedrl.linear_policy_loss(
        data["hidden"],
        data["weight"],
        data["labels"],
        data["advantages"],
        data["mask"],
        bias=data["bias"],
        backend=backend,
        ref_weight=ref_weight if exact_kl else None,
        **kwargs,
    )
    assert (plain.logp - want.logp).abs().max() > 0.1


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_token_logprobs_with_and_without_a_gradient(backend, small_chunks):
    data = _data(seed=9)
    leaves = [data[k].clone().requires_grad_(True) for k in ("hidden", "weight")]
    logp, entropy = fusedrl.linear_token_logprobs(
        *leaves,
        data["labels"],
        temperature=0.9,
        return_entropy=True,
        backend=backend,
        softcap=CAP,
        logit_scale=SCALE,
    )
    (logp.sum() + entropy.sum()).backward()
    oracle = [data[k].clone().requires_grad_(True) for k in ("hidden", "weight")]
    logits = _transformed(oracle[0] @ oracle[1].T, CAP, SCALE)
    want_logp, want_entropy = reference.token_logprobs(logits, data["labels"], 0.9, True)
    (want_logp.sum() + want_entropy.sum()).backward()
    torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, atol=1e-5, rtol=1e-5)
    for ours, oracle_leaf in zip(leaves, oracle):
        torch.testing.assert_close(ours.grad, oracle_leaf.grad, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        no_grad, _ = fusedrl.linear_token_logprobs(
            data["hidden"],
            data["weight"],
            data["labels"],
            temperature=0.9,
            backend=backend,
            softcap=CAP,
            logit_scale=SCALE,
        )
    torch.testing.assert_close(no_grad, want_logp, atol=1e-5, rtol=1e-5)


def test_arguments_are_checked_and_refused_where_unsupported(monkeypatch):
    assert check_logit_transform(None, None) is None
    assert check_logit_transform(None, 1.0) is None
    with pytest.raises(ValueError, match="softcap must be a finite number > 0"):
        check_logit_transform(0.0, None)
    with pytest.raises(TypeError, match="logit_scale must be a number"):
        check_logit_transform(None, "2")
    # Finite and > 0, but not a normal fp32 factor: every logit would read as inf, or as 0.
    for softcap, scale, name in (
        (1e-40, None, "logit_scale / softcap"),
        (1e40, None, "logit_scale / softcap"),
        (30.0, 1e39, "logit_scale"),
        (None, 1e-39, "logit_scale"),
    ):
        with pytest.raises(ValueError, match=f"^{name} must be a normal float32 number"):
            check_logit_transform(softcap, scale)
    assert check_logit_transform(1e30, 1e-7) is not None  # a = 1e-37: still normal
    data = _data(seed=1)
    args = (data["hidden"], data["weight"], data["labels"], data["advantages"], data["mask"])
    # A group of one under tensor parallelism is the plain call (2 and 3 ranks:
    # tests/test_tensor_parallel.py).
    one = fusedrl.linear_policy_loss(*args, softcap=CAP, vocab_start=0)
    torch.testing.assert_close(one.loss, fusedrl.linear_policy_loss(*args, softcap=CAP).loss)
    monkeypatch.setenv(linear_triton.DESIGN_ENV, "on-chip")
    interpreted = __import__("os").environ.get("TRITON_INTERPRET") == "1"
    if fusedrl.backends.TRITON_INSTALLED and interpreted:
        with pytest.raises(ValueError, match="on-chip does not apply softcap"):
            fusedrl.linear_policy_loss(*args, softcap=CAP, backend="triton")


def _check_logprobs_with_top_p(backend, logits, labels, temperatures, **transform):
    """token_logprobs(top_p=0.9, **transform) at each temperature (a float, per-token ones),
    with and without a gradient, against the oracle: logp, entropy and the gradient."""
    for temperature in temperatures:
        for grad_on in (False, True):
            x, x_ref = (logits.clone().requires_grad_(grad_on) for _ in "ab")
            logp, entropy = fusedrl.token_logprobs(
                x, labels, temperature, True, backend, top_p=0.9, **transform
            )
            want = reference.token_logprobs(
                x_ref, labels, temperature, True, top_p=0.9, **transform
            )
            torch.testing.assert_close(logp, want[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(entropy, want[1], atol=1e-5, rtol=1e-5)
            if grad_on:
                (grad,) = torch.autograd.grad(logp.sum() + entropy.sum(), x)
                (want_grad,) = torch.autograd.grad(want[0].sum() + want[1].sum(), x_ref)
                torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_logit_scale_on_the_logits_entry_points(backend):
    """policy_loss / token_logprobs(logit_scale=s): the model's logits are s x; folded into the
    temperature (config's or per-token), against the oracle scaling x itself: the loss, logp,
    entropy, the gradient w.r.t. x (a factor s), sampling replay (the sets of s x / T) and the
    exact KL (the reference's logits scaled alike); and far from the unscaled call."""
    from .conftest import make_batch

    data = make_batch(vocab=131, seed=21, with_nan_padding=True)
    temps = 0.6 + torch.rand(data["labels"].shape, generator=torch.Generator().manual_seed(3))
    noise = torch.randn(data["logits"].shape, generator=torch.Generator().manual_seed(4))
    rows = {k: v for k, v in data.items() if k != "logits"}
    cases = (
        dict(config=LossConfig.preset("dapo", temperature=0.8, entropy_coef=0.01)),
        dict(config=LossConfig.preset("gspo", top_k=40, min_p=0.02), temperature=temps),
        dict(
            config=LossConfig.preset("dapo", kl="full", beta=0.1),
            ref_logits=data["logits"] + 0.5 * noise,
        ),
    )
    for kwargs in cases:
        args = dict(rows, **kwargs)
        if "ref_logits" in kwargs:
            args.pop("ref_logp")
        outs = []
        for fn, extra in ((fusedrl.policy_loss, {"backend": backend}), (reference.policy_loss, {})):
            x = data["logits"].clone().requires_grad_(True)
            out = fn(x, **args, **extra, logit_scale=SCALE, return_entropy=True)
            outs.append((out, torch.autograd.grad(out.loss, x)[0]))
        (ours, grad), (want, want_grad) = outs
        torch.testing.assert_close(ours.loss, want.loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.logp, want.logp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.entropy, want.entropy, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-5)
        plain = fusedrl.policy_loss(data["logits"], **args, backend=backend)
        assert (plain.logp - ours.logp).abs().max() > 0.1  # the scale acted
    # every row counts here: padded rows get logits without ties (top_p keeps all of a tie)
    clean = torch.where(data["mask"][..., None], data["logits"], noise)
    labels = torch.where(data["mask"], data["labels"], 0)
    temperatures = (0.7, torch.where(data["mask"], temps, 1.0))
    _check_logprobs_with_top_p(backend, clean, labels, temperatures, logit_scale=SCALE)
    # the default config, and sum pi^2 (Triton's own sum, torch's half-temperature read)
    plain_rows = {k: rows[k] for k in ("labels", "advantages", "mask")}
    ours = fusedrl.policy_loss(data["logits"], **plain_rows, backend=backend, logit_scale=SCALE)
    want = reference.policy_loss(data["logits"], **plain_rows, logit_scale=SCALE)
    torch.testing.assert_close(ours.loss, want.loss, atol=1e-5, rtol=1e-5)
    _, _, sum_sq = fusedrl.token_logprobs(
        clean, labels, 0.7, backend=backend, logit_scale=SCALE, return_sum_pi_squared=True
    )
    torch.testing.assert_close(sum_sq, reference.sum_pi_squared(clean * SCALE, 0.7))
    with pytest.raises(ValueError, match="logit_scale must be a finite number > 0"):
        fusedrl.token_logprobs(clean, labels, logit_scale=-1.0)
    with pytest.raises(TypeError, match="config must be a fusedrl.LossConfig"):
        fusedrl.policy_loss(**data, config="dapo", logit_scale=SCALE)
    with pytest.raises(TypeError, match="temperature must be a float tensor"):
        fusedrl.token_logprobs(clean, labels, torch.ones_like(data["mask"]), logit_scale=SCALE)
    with pytest.raises(TypeError, match="logit_scale must be a number"):
        fusedrl.policy_loss(**data, logit_scale="2")


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_softcap_on_the_logits_entry_points(backend):
    """policy_loss / token_logprobs(softcap=c, logit_scale=s): the model's logits are
    c tanh(s x / c) of these, applied by the kernels as they read each row (`rows.capped`),
    against the oracle capping x itself (checked against the formula here): the fused kernel
    (in place too, sum pi^2 beside it), the two-pass path with per-token temperatures and every
    sampling filter (the capped logits' sets), the exact KL (both rows capped), log-probs with
    and without a gradient; a banned logit (-inf, -finfo.max) stays banned; far from the
    uncapped call."""
    from .conftest import make_batch

    data = make_batch(vocab=131, seed=23, with_nan_padding=True)
    mask = data["mask"]
    x = 2.0 * data["logits"]
    x[0, 0, 5] = float("-inf")  # banned tokens in a counted row: probability 0, not -c
    x[0, 0, 9] = torch.finfo(torch.float32).min
    assert mask[0, 0]
    # the cap acts: a share of the counted logits is pressed toward it
    assert ((SCALE * x).abs() > CAP)[mask].float().mean() > 0.3
    capped = _transformed(torch.where(mask[..., None], x, 0.0), CAP, SCALE)
    capped[0, 0, 5] = capped[0, 0, 9] = float("-inf")
    oracle_logp = reference.token_logprobs(capped, torch.where(mask, data["labels"], 0))[0]
    torch.testing.assert_close(  # the oracle's own cap is the formula
        reference.token_logprobs(
            x, torch.where(mask, data["labels"], 0), softcap=CAP, logit_scale=SCALE
        )[0][mask],
        oracle_logp[mask],
    )
    gen = torch.Generator().manual_seed(5)
    temps = 0.6 + torch.rand(mask.shape, generator=gen)
    noise = torch.randn(x.shape, generator=gen)
    rows = dict(labels=data["labels"], advantages=data["advantages"], mask=mask)
    # The oracle's autograd through the exact KL gives NaN at a banned token (0 log 0): that case
    # reads finite logits.
    finite = torch.where(x < -1e20, 0.0, x)
    cases = (  # (the sampler's log-probs off the policy's by this much: ratios straddle the clip)
        (0.3, x, dict(config=LossConfig.preset("dapo", temperature=0.8, entropy_coef=0.01))),
        (
            2e-4,
            x,
            dict(
                config=LossConfig.preset("gspo", top_k=40, top_p=0.9, min_p=0.02),
                temperature=temps,
                logit_scale=SCALE,
            ),
        ),
        (
            0.3,
            finite,
            dict(
                config=LossConfig.preset("dapo", kl="full", beta=0.1),
                ref_logits=finite + noise,
                logit_scale=SCALE,
            ),
        ),
    )
    for spread, logits, kwargs in cases:
        now = reference.policy_loss(logits, **rows, **kwargs, softcap=CAP).logp
        rows["old_logp"] = now + spread * torch.randn(now.shape, generator=gen)
        outs = []
        for fn, extra in ((fusedrl.policy_loss, {"backend": backend}), (reference.policy_loss, {})):
            leaf = logits.clone().requires_grad_(True)
            out = fn(leaf, **rows, **kwargs, **extra, softcap=CAP, return_entropy=True)
            outs.append((out, torch.autograd.grad(out.loss, leaf)[0]))
        (ours, grad), (want, want_grad) = outs
        torch.testing.assert_close(ours.loss, want.loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.logp, want.logp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.entropy, want.entropy, atol=1e-5, rtol=1e-5)
        assert want_grad.abs().max() > 1e-2
        torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-5)
        if logits is x:
            assert grad[0, 0, 5] == 0 and grad[0, 0, 9] == 0  # banned: no gradient
        plain = fusedrl.policy_loss(logits, **rows, **kwargs, backend=backend)
        assert (plain.logp - ours.logp).abs().max() > 0.1  # the cap acted
    # in place (the fused kernel overwrites the logits) and sum pi^2 beside the loss
    leaf = x.clone().requires_grad_(True)
    buffer = leaf * 1.0
    out = fusedrl.policy_loss(
        buffer,
        **rows,
        **cases[0][2],
        backend=backend,
        softcap=CAP,
        inplace=True,
        return_sum_pi_squared=True,
    )
    (grad,) = torch.autograd.grad(out.loss, leaf)
    torch.testing.assert_close(grad, _oracle_grad(x, rows, cases[0][2]), atol=1e-6, rtol=1e-5)
    unscaled = reference._model_logits(torch.where(mask[..., None], x, 0.0), None, CAP)
    want_sq = reference.sum_pi_squared(unscaled, 0.8)
    torch.testing.assert_close(out.sum_pi_squared, torch.where(mask, want_sq, 0.0))
    # log-probs: top_p over the capped logits, float and per-token temperatures, +- a gradient
    clean = torch.where(mask[..., None], x, noise)
    labels = torch.where(mask, data["labels"], 0)
    temperatures = (0.7, torch.where(mask, temps, 1.0))
    _check_logprobs_with_top_p(backend, clean, labels, temperatures, softcap=CAP)
    _, _, sum_sq = fusedrl.token_logprobs(
        clean,
        labels,
        0.7,
        backend=backend,
        softcap=CAP,
        logit_scale=SCALE,
        return_sum_pi_squared=True,
    )
    want_sq = reference.sum_pi_squared(_transformed(clean, CAP, SCALE), 0.7)
    torch.testing.assert_close(sum_sq, want_sq)


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_softcap_keeps_each_dtypes_masks_banned(backend):
    """Under the cap a -inf logit and the lowest finite value of the logits' dtype (fp16's
    -65504 too: what masks write) keep probability 0 instead of becoming -c: against the oracle
    and the probabilities of the capped logits with those tokens dropped; a label on a banned
    token gets logp -inf."""
    gen = torch.Generator().manual_seed(31)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        x = (3.0 * torch.randn(2, 5, 131, generator=gen)).to(dtype)
        labels = torch.randint(0, 131, (2, 5), generator=gen)
        x[..., 7] = torch.finfo(dtype).min
        x[..., 9] = float("-inf")
        labels[0, 2], labels[1, 3] = 7, 9
        logp, entropy = fusedrl.token_logprobs(x, labels, 0.9, True, backend, softcap=CAP)
        want = reference.token_logprobs(x, labels, 0.9, True, softcap=CAP)
        torch.testing.assert_close(logp, want[0], atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(entropy, want[1], atol=1e-3, rtol=1e-3)
        assert logp[0, 2] == float("-inf") and logp[1, 3] == float("-inf")
        kept = torch.ones(131, dtype=torch.bool)
        kept[7] = kept[9] = False
        capped = CAP * torch.tanh(x.double()[..., kept] / CAP)
        probs = torch.softmax(capped / 0.9, -1)
        dropped = -(probs * probs.log()).sum(-1)
        torch.testing.assert_close(entropy.double(), dropped, atol=1e-3, rtol=1e-3)


def _oracle_grad(x, rows, kwargs):
    leaf = x.clone().requires_grad_(True)
    out = reference.policy_loss(leaf, **rows, **kwargs, softcap=CAP)
    return torch.autograd.grad(out.loss, leaf)[0]


def test_softcap_keywords_and_the_plain_forms():
    """The ops' `cap=` keyword; a group of one under tensor parallelism is the plain call; bad
    values are named."""
    from fusedrl import fused_backend
    from fusedrl.logit_transform import LogitTransform

    from .conftest import make_batch

    data = make_batch(vocab=131, seed=2)
    # The ops' keywords: a = s / c (`cap=`) at the temperature T / c.
    assert fused_backend.temperature_keywords(2.0) == (2.0, {})
    capped = fused_backend.temperature_keywords(2.0, transform=LogitTransform(SCALE, CAP))
    assert capped == (2.0 / CAP, {"cap": SCALE / CAP})
    # a group of one under tensor parallelism is the plain call (2 and 3 ranks:
    # tests/test_tensor_parallel.py)
    one = fusedrl.policy_loss(**data, softcap=CAP, logit_scale=SCALE, vocab_start=0)
    plain = fusedrl.policy_loss(**data, softcap=CAP, logit_scale=SCALE)
    assert torch.equal(one.loss, plain.loss)
    one = fusedrl.token_logprobs(data["logits"], data["labels"], softcap=CAP, vocab_start=0)[0]
    assert torch.equal(one, fusedrl.token_logprobs(data["logits"], data["labels"], softcap=CAP)[0])
    module = fusedrl.PolicyLoss("dapo", softcap=CAP, logit_scale=SCALE)
    want = fusedrl.policy_loss(
        **data, config=LossConfig.preset("dapo"), softcap=CAP, logit_scale=SCALE
    )
    assert torch.equal(module(**data).loss, want.loss) and "softcap=4.0" in repr(module)
    with pytest.raises(ValueError, match="softcap must be a finite number > 0"):
        fusedrl.policy_loss(**data, softcap=0.0)
    with pytest.raises(TypeError, match="softcap must be a number"):
        fusedrl.token_logprobs(data["logits"], data["labels"], softcap="30")


def test_the_transform_is_read_from_the_models_configs():
    from transformers import AutoConfig

    class Model:
        def __init__(self, arch, **kwargs):
            self.config = AutoConfig.for_model(arch, **kwargs)

    assert model_logit_transform(Model("gemma2", final_logit_softcapping=30.0)) == {
        "softcap": 30.0,
        "logit_scale": None,
    }
    assert model_logit_transform(Model("cohere", logit_scale=0.0625)) == {
        "softcap": None,
        "logit_scale": 0.0625,
    }
    assert model_logit_transform(Model("granite", logits_scaling=8.0)) == {
        "softcap": None,
        "logit_scale": 0.125,
    }
    assert model_logit_transform(Model("qwen2")) == {"softcap": None, "logit_scale": None}


def _tiny_gemma2(vocab=37, seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gemma2",
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=False,
        final_logit_softcapping=0.5,
        attn_logit_softcapping=None,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def test_the_trainer_keeps_the_fused_lm_head_for_a_soft_capped_gemma2():
    """A tiny Gemma 2 with a cap small enough to act: the trainer's fused LM head (hidden
    states, head and the model's soft cap) gives the logits path's gradient of every parameter
    and its old log-probs."""
    from fusedrl.linear import lm_head_of, plain_lm_head
    from fusedrl.trainer.step import accumulate_gradients, token_logprobs

    from .test_trainer_units import _tiny_batch

    cfg = LossConfig.preset("dapo", entropy_coef=0.01)
    batch, _, _ = _tiny_batch(n=5)
    grads, logps = [], []
    for lm_head in (False, True):
        model = _tiny_gemma2()
        assert plain_lm_head(model) is None and lm_head_of(model) is model.lm_head
        logps.append(token_logprobs(model, batch, cfg, 2, None, "torch", lm_head=lm_head))
        accumulate_gradients(model, batch, cfg, 2, None, "torch", lm_head=lm_head)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(logps[1], logps[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)
    # the cap acts: without it the head's log-probs differ
    model = _tiny_gemma2()
    model.config.final_logit_softcapping = None
    uncapped = token_logprobs(model, batch, cfg, 2, None, "torch", lm_head=True)
    assert (uncapped - logps[0]).abs().max() > 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["jsd", "sampled_reverse_kl"])
def test_linear_distill_loss_with_each_models_transform(kind, backend, small_chunks):
    """A soft-capped student and a scaled teacher: each head's chunks take its own transform,
    against the oracle on the logits transformed by autograd."""
    data = _data(seed=11)
    gen = torch.Generator().manual_seed(12)
    teacher_hidden = torch.randn(3, 7, 12, generator=gen)
    teacher_weight = 1.5 * torch.randn(131, 12, generator=gen)
    student, teacher = {"softcap": CAP, "logit_scale": None}, {"softcap": None, "logit_scale": 0.6}
    extra = {}
    if kind == "sampled_reverse_kl":
        extra = dict(advantages=data["advantages"], old_logp=None, config=LossConfig())
    leaves = [data[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    ours = fusedrl.linear_distill_loss(
        leaves[0],
        leaves[1],
        teacher_hidden,
        teacher_weight,
        data["labels"],
        data["mask"],
        kind=kind,
        beta=0.4,
        temperature=0.9,
        student_bias=leaves[2],
        backend=backend,
        student_transform=student,
        teacher_transform=teacher,
        **extra,
    )
    grads = torch.autograd.grad(ours.loss, leaves)
    oracle = [data[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    logits = _transformed(oracle[0] @ oracle[1].T + oracle[2], CAP, 1.0)
    teacher_logits = _transformed(teacher_hidden @ teacher_weight.T, None, 0.6)
    if kind == "sampled_reverse_kl":  # its logits form, itself checked against the oracle
        want = fusedrl.distill_loss(
            logits,
            teacher_logits,
            data["labels"],
            data["mask"],
            kind=kind,
            beta=0.4,
            temperature=0.9,
            backend="torch",
            **extra,
        )
    else:
        want = reference.distill_loss(
            logits,
            teacher_logits,
            data["labels"],
            data["mask"],
            kind=kind,
            beta=0.4,
            temperature=0.9,
        )
    want_grads = torch.autograd.grad(want.loss, oracle)
    torch.testing.assert_close(ours.loss, want.loss, atol=1e-5, rtol=1e-5)
    for got, expected in zip(grads, want_grads):
        assert expected.abs().max() > 1e-3
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="teacher_transform must be None or a dict"):
        fusedrl.linear_distill_loss(
            data["hidden"],
            data["weight"],
            teacher_hidden,
            teacher_weight,
            data["labels"],
            data["mask"],
            teacher_transform={"cap": 3.0},
        )


def test_the_trainer_distils_a_soft_capped_student_on_the_fused_head():
    """--distill-teacher with soft-capped models on both sides: the fused LM head (each head's
    cap applied by linear_distill_loss and linear_policy_loss) gives the logits path's
    gradients."""
    from fusedrl.trainer.step import Distill, accumulate_gradients

    from .test_trainer_units import _tiny_batch

    cfg = LossConfig.preset("dapo")
    batch, _, _ = _tiny_batch(n=5)
    teacher = _tiny_gemma2(seed=5)
    grads = []
    for lm_head in (False, True):
        model = _tiny_gemma2()
        accumulate_gradients(
            model,
            batch,
            cfg,
            2,
            None,
            "torch",
            lm_head=lm_head,
            teacher=teacher,
            distill=Distill("forward_kl", 0.5, 0.5),
        )
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)
