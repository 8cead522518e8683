"""fusedrl.integrations.trl against TRL itself: same loss, same parameter gradients and same logged
metrics as `GRPOTrainer._compute_loss` on a real (tiny, random) Qwen2 model and a tiny Qwen2-MoE
(router aux loss), and a real 2-step training run; `fusedrl.distill_loss` against GKD's
`generalized_jsd_loss`."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

trl = pytest.importorskip("trl")
warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # GKD's loss, below

from datasets import Dataset  # noqa: E402
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import fusedrl  # noqa: E402
from fusedrl.integrations.trl import FusedGRPOTrainer, loss_config_from_trl  # noqa: E402
from fusedrl.tiny import char_tokenizer, tiny_qwen2  # noqa: E402

B, P, T = 4, 5, 7


def _reward_len(completions, **kwargs):
    return [float(len(c)) for c in completions]


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    """The tiny model saved locally: TRL loads the policy (and, with beta > 0, its reference
    model) from a path, so each trainer gets its own copy of the same weights."""
    path = tmp_path_factory.mktemp("tiny-qwen2")
    tiny_qwen2(len(tokenizer), hidden_size=64, num_layers=1).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def moe_dir(tokenizer, tmp_path_factory):
    """A tiny random Qwen2-MoE that returns its router logits, with a coefficient large enough
    that a missing (or mis-scaled) load-balancing term shows in the loss and the router grads."""
    path = tmp_path_factory.mktemp("tiny-qwen2-moe")
    config = Qwen2MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        output_router_logits=True,
        router_aux_loss_coef=0.05,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=2,
    )
    torch.manual_seed(0)
    Qwen2MoeForCausalLM(config).save_pretrained(path)
    return str(path)


def _args(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=B,
        num_generations=B,
        max_completion_length=T,
        report_to=[],
        use_vllm=False,
        use_cpu=True,
        logging_steps=1,
        temperature=0.9,
        epsilon_high=0.28,
        max_steps=2,
        save_strategy="no",
        bf16=False,  # fp32 parity: no CPU bf16 autocast
        fp16=False,
    )
    return GRPOConfig(**{**base, **overrides})


def _trainer(cls, model, tokenizer, args, **kwargs):
    dataset = Dataset.from_dict({"prompt": ["1+1=", "2+2=", "3+3=", "4+4="]})
    trainer = cls(
        model=model,
        reward_funcs=_reward_len,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        **kwargs,
    )
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _inputs(model, loss_type, beta, seed=0):
    """Inputs as TRL's generation step makes them; row 3 is an empty completion (a NaN in TRL's
    per-sequence clip fractions, which clip_ratio/low_min and high_max skip)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompt_ids = torch.randint(3, vocab, (B, P), generator=gen)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[1, :2] = 0  # left padding
    completion_ids = torch.randint(3, vocab, (B, T), generator=gen)
    completion_mask = torch.ones(B, T, dtype=torch.long)
    completion_mask[0, 4:] = 0  # ended early
    completion_mask[2, 2:] = 0
    completion_mask[3, :] = 0
    with torch.no_grad():
        logits = model(
            input_ids=torch.cat([prompt_ids, completion_ids], 1),
            attention_mask=torch.cat([prompt_mask, completion_mask], 1),
        ).logits
        logp = torch.log_softmax(logits[:, P - 1 : -1].float() / 0.9, -1)
        logp = logp.gather(-1, completion_ids[..., None]).squeeze(-1)
    inputs = dict(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        advantages=torch.randn(B, generator=gen),
        old_per_token_logps=logp + 0.2 * torch.randn(B, T, generator=gen),
        num_items_in_batch=completion_mask.sum().float(),
    )
    if beta:
        ref = logp + 0.3 * torch.randn(B, T, generator=gen)
        # one counted token 4 nats likelier under the reference: k3 = e^4 - 5 = 49.6, past the
        # clamp at 10 that verl's k3 has and TRL's does not
        ref[0, 1] = logp[0, 1] + 4.0
        inputs["ref_per_token_logps"] = ref
    return inputs


def _loss_and_grads(trainer, inputs):
    model = trainer.model
    model.train()
    model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(model, inputs)
    params = [p for p in model.parameters() if p.requires_grad]
    return loss.detach(), torch.autograd.grad(loss, params)


def _assert_same(trl_trainer, fused_trainer, inputs):
    """Same loss, same gradient for every parameter, and the same metrics (names and values)."""
    ref_loss, ref_grads = _loss_and_grads(trl_trainer, inputs)
    loss, grads = _loss_and_grads(fused_trainer, inputs)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
    scale = max(g.abs().max().item() for g in ref_grads)
    assert scale > 0
    for g, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-6 * scale)
    ref_metrics = dict(trl_trainer._metrics["train"])
    metrics = dict(fused_trainer._metrics["train"])
    assert sorted(metrics) == sorted(ref_metrics)
    for name, ref in ref_metrics.items():
        assert len(metrics[name]) == len(ref) == 1, name
        value, expected = metrics[name][0], ref[0]
        assert math.isclose(value, expected, rel_tol=1e-5, abs_tol=1e-6) or (
            math.isnan(value) and math.isnan(expected)
        ), (name, value, expected)
    return metrics


CASES = (
    [
        (lt, "token", beta)
        for lt in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
        for beta in (0.0, 0.04)
    ]
    + [("grpo", "sequence", beta) for beta in (0.0, 0.04)]
    + [("luspo", "sequence", beta) for beta in (0.0, 0.04)]
    # accepted with TRL's warning (the sequence weighted by its length)
    + [(lt, "sequence", 0.0) for lt in ("bnpo", "dr_grpo", "dapo", "cispo")]
    + [("dapo", "sequence", 0.04), ("cispo", "sequence", 0.04)]
    + [("sapo", "sequence", beta) for beta in (0.0, 0.04)]
)


@pytest.mark.parametrize("loss_type, level, beta", CASES)
def test_parity_with_trl_compute_loss(loss_type, level, beta, model_dir, tokenizer, tmp_path):
    extra = {"epsilon_high": 5.0} if loss_type == "cispo" else {}
    if beta:
        extra["use_bias_correction_kl"] = False  # TRL's default multiplies the KL by the ratio
    args = _args(tmp_path, loss_type=loss_type, importance_sampling_level=level, beta=beta, **extra)
    trl_trainer = _trainer(GRPOTrainer, model_dir, tokenizer, args)
    fused_trainer = _trainer(FusedGRPOTrainer, model_dir, tokenizer, args)
    _assert_same(trl_trainer, fused_trainer, _inputs(trl_trainer.model, loss_type, beta))


# Each option on data where it acts: a bias-corrected KL (ratios away from 1), sequences that
# drifted from the sampler with both advantage signs, half the tokens below the entropy quantile.
CORRECTIONS = {
    # two-sided clipping at the sequence level with delta below 1 + epsilon_high (TRL counts the
    # clip metrics on the ratio after its delta clamp)
    "delta_sequence": ("grpo", dict(importance_sampling_level="sequence", delta=1.02)),
    "bias_corrected_kl": ("dapo", dict(beta=0.04, use_bias_correction_kl=True)),
    "bias_corrected_kl_grpo": ("grpo", dict(beta=0.04, use_bias_correction_kl=True)),
    # TRL's defaults at the sequence level: the KL times the sequence ratio, differentiated
    # through every token of the sequence
    "bias_corrected_kl_gspo": (
        "grpo",
        dict(beta=0.04, use_bias_correction_kl=True, importance_sampling_level="sequence"),
    ),
    "bias_corrected_kl_sequence_dapo": (
        "dapo",
        dict(beta=0.04, use_bias_correction_kl=True, importance_sampling_level="sequence"),
    ),
    "off_policy_mask": ("grpo", dict(off_policy_mask_threshold=0.05)),
    "off_policy_mask_vespo": ("vespo", dict(off_policy_mask_threshold=0.05)),
    "top_entropy_quantile": ("dapo", dict(top_entropy_quantile=0.5)),
    "top_entropy_quantile_luspo": ("luspo", dict(top_entropy_quantile=0.3)),
}


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
@pytest.mark.parametrize("with_sampler_logps", [False, True])
def test_parity_with_trl_corrections(name, with_sampler_logps, model_dir, tokenizer, tmp_path):
    loss_type, options = CORRECTIONS[name]
    if with_sampler_logps and "off_policy_mask_threshold" not in options:
        pytest.skip("only the off-policy mask reads the sampler's log-probs")
    args = _args(tmp_path, loss_type=loss_type, **options)
    trainers = [_trainer(c, model_dir, tokenizer, args) for c in (GRPOTrainer, FusedGRPOTrainer)]
    inputs = _inputs(trainers[0].model, loss_type, options.get("beta", 0.0), seed=4)
    inputs["advantages"] = torch.tensor([-1.0, 0.7, -0.4, 0.2])
    gen = torch.Generator().manual_seed(5)
    inputs["old_per_token_logps"][0] += 0.6  # sequence 0 drifted from the old policy
    if options.get("delta"):  # sequence 1 (A > 0) above 1 + epsilon_high, and above delta
        inputs["old_per_token_logps"][1] -= 0.6
    if with_sampler_logps:  # ... but not from the sampler; sequence 2 did (gaps ~ -0.4, 0.6)
        gap = torch.tensor([-1.0, 0.3, 0.6, 0.0])[:, None] + 0.01 * torch.randn(B, T, generator=gen)
        inputs["sampling_per_token_logps"] = inputs["old_per_token_logps"] + gap
    _assert_same(*trainers, inputs)
    config = trainers[1].fused_config
    assert config.kl_bias_correction == options.get("use_bias_correction_kl", False)
    assert config.off_policy_mask == options.get("off_policy_mask_threshold")
    assert config.top_entropy_quantile == options.get("top_entropy_quantile", 1.0)


def test_top_entropy_under_several_processes_gathers_the_quantile(
    model_dir, tokenizer, tmp_path, monkeypatch
):
    """Under several processes the drop-in takes the top-entropy quantile over the process
    group (`fusedrl.batch_statistics_over`), as TRL gathers it: run here in a gloo group of
    one with the accelerator saying 2 processes (the branch runs, its gathers are the process's
    own; tests/test_batch_stats.py has the quantile over two ranks), equal to GRPOTrainer."""
    import torch.distributed as dist
    from accelerate import Accelerator

    from fusedrl import token_terms

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    seen = []
    real = token_terms.gathered

    def counted(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(token_terms, "gathered", counted)
    args = _args(tmp_path, loss_type="dapo", top_entropy_quantile=0.5)
    trainers = [_trainer(c, model_dir, tokenizer, args) for c in (GRPOTrainer, FusedGRPOTrainer)]
    monkeypatch.setattr(Accelerator, "num_processes", property(lambda self: 2))
    try:
        _assert_same(*trainers, _inputs(trainers[0].model, "dapo", 0.0, seed=4))
    finally:
        dist.destroy_process_group()
    assert seen  # the fused loss took the group's quantile


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
def test_parity_vespo_with_vllm_importance_sampling(mode, model_dir, tokenizer, tmp_path):
    """VESPO folds TRL's per-token IS ratios into its sequence weight instead of multiplying."""
    args = _args(
        tmp_path,
        loss_type="vespo",
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_max=1.3,
    )
    trainers = [_trainer(c, model_dir, tokenizer, args) for c in (GRPOTrainer, FusedGRPOTrainer)]
    inputs = _inputs(trainers[0].model, "vespo", 0.0, seed=6)
    gen = torch.Generator().manual_seed(7)
    ratio = torch.exp(0.1 * torch.randn(B, T, generator=gen)) * inputs["completion_mask"]
    ratio = ratio + (1 - inputs["completion_mask"])  # TRL's ratio is 1 on padding
    ratio = ratio.clamp(max=1.3) if mode.endswith("truncate") else ratio * (ratio <= 1.3)
    inputs["importance_sampling_ratio"] = ratio
    for trainer in trainers:
        trainer.use_vllm = True
        trainer.vllm_importance_sampling_correction = True
    metrics = _assert_same(*trainers, inputs)
    assert 0 < metrics["vespo/phi_seq_mean"][0] != 1


@pytest.mark.parametrize(
    "loss_type, level, beta", [("dapo", "token", 0.0), ("grpo", "sequence", 0.04)]
)
def test_parity_with_the_fused_lm_head(
    loss_type, level, beta, model_dir, tokenizer, tmp_path, monkeypatch
):
    """fused_lm_head=True: the loss from hidden states and the head, TRL's numbers; the head
    makes logits for the completion tokens alone (skip_masked_rows)."""
    live = []
    real = fusedrl.linear_single_process.live_row_indices
    spied = lambda valid, count=None: live.append(int(valid.sum())) or real(valid, count)  # noqa: E731
    monkeypatch.setattr(fusedrl.linear_single_process, "live_row_indices", spied)
    extra = {"use_bias_correction_kl": False} if beta else {}
    args = _args(tmp_path, loss_type=loss_type, importance_sampling_level=level, beta=beta, **extra)
    trl_trainer = _trainer(GRPOTrainer, model_dir, tokenizer, args)
    fused_trainer = _trainer(FusedGRPOTrainer, model_dir, tokenizer, args)
    fused_trainer.fused_lm_head = True
    inputs = _inputs(trl_trainer.model, loss_type, beta)
    _assert_same(trl_trainer, fused_trainer, inputs)
    assert live and live[0] == inputs["completion_mask"].sum() < inputs["completion_mask"].numel()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        ref, ref_ent, _ = trl_trainer._get_per_token_logps_and_entropies(
            trl_trainer.model, ids, mask, T, compute_entropy=True
        )
        ours, ent, _ = fused_trainer._get_per_token_logps_and_entropies(
            fused_trainer.model, ids, mask, T, compute_entropy=True
        )
    # Positions past a completion's end are padding, which the loss never reads.
    real = inputs["completion_mask"].bool()
    torch.testing.assert_close(ours[real], ref[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[real], ref_ent[real], rtol=1e-5, atol=1e-5)


def test_parity_with_the_head_in_fp32(model_dir, tokenizer, tmp_path):
    """cast_lm_head_to_fp32 on a bf16 model: TRL runs the head in fp32 on the bf16 body's hidden
    states, and so does the fused head (in bf16 they are ~1e-2 apart in the gradients)."""
    args = _args(
        tmp_path,
        loss_type="dapo",
        cast_lm_head_to_fp32=True,
        model_init_kwargs={"dtype": torch.bfloat16},
    )
    trainers = [_trainer(c, model_dir, tokenizer, args) for c in (GRPOTrainer, FusedGRPOTrainer)]
    assert trainers[1].fused_lm_head
    assert trainers[1].model.model.embed_tokens.weight.dtype == torch.bfloat16
    _assert_same(*trainers, _inputs(trainers[0].model, "dapo", 0.0, seed=8))


def test_parity_with_a_peft_adapter(model_dir, tokenizer, tmp_path):
    """A LoRA policy (peft_config): the adapter runs inside the body that the fused head reads
    (the forward TRL patches is the PEFT model's base); TRL's numbers, the head on."""
    peft = pytest.importorskip("peft")
    args = _args(tmp_path, loss_type="grpo", beta=0.04, use_bias_correction_kl=False)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    trainers = [
        _trainer(c, model_dir, tokenizer, args, peft_config=lora)
        for c in (GRPOTrainer, FusedGRPOTrainer)
    ]
    assert trainers[1].fused_lm_head
    _assert_same(*trainers, _inputs(trainers[0].model, "grpo", 0.04, seed=9))


@pytest.mark.parametrize(
    "mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
)
def test_parity_with_vllm_importance_sampling(mode, model_dir, tokenizer, tmp_path):
    args = _args(
        tmp_path,
        loss_type="dapo",
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_max=1.3,
    )
    trainers = [_trainer(c, model_dir, tokenizer, args) for c in (GRPOTrainer, FusedGRPOTrainer)]
    inputs = _inputs(trainers[0].model, "dapo", 0.0, seed=1)
    gen = torch.Generator().manual_seed(2)
    shape = (B, 1) if mode.startswith("sequence") else (B, T)
    ratio = torch.exp(0.3 * torch.randn(shape, generator=gen))
    ratio = ratio.clamp(max=1.3) if mode.endswith("truncate") else ratio * (ratio <= 1.3)
    inputs["importance_sampling_ratio"] = ratio  # as TRL's _generate_and_score_completions makes it
    for trainer in trainers:
        trainer.use_vllm = True  # TRL applies the ratio only on its vLLM path
        trainer.vllm_importance_sampling_correction = True
    _assert_same(*trainers, inputs)


def test_parity_with_delta(model_dir, tokenizer, tmp_path):
    args = _args(tmp_path, loss_type="dapo", delta=1.5)
    trainers = [_trainer(c, model_dir, tokenizer, args) for c in (GRPOTrainer, FusedGRPOTrainer)]
    inputs = _inputs(trainers[0].model, "dapo", 0.0, seed=3)
    inputs["old_per_token_logps"] = inputs["old_per_token_logps"] - 0.6  # ratios above delta
    _assert_same(*trainers, inputs)


@pytest.mark.parametrize("sign", [-1.0, 1.0])
def test_clip_extreme_metrics_match_trl(sign, model_dir, tokenizer, tmp_path):
    """clip_ratio/low_min (all advantages negative, ratios pushed below 1 - eps) and
    clip_ratio/high_max (positive, above 1 + eps) away from 0, so that the per-sequence
    fractions, the empty row's NaN and the nanmin / nanmax are all exercised."""
    args = _args(tmp_path, loss_type="grpo")
    trainers = [_trainer(c, model_dir, tokenizer, args) for c in (GRPOTrainer, FusedGRPOTrainer)]
    inputs = _inputs(trainers[0].model, "grpo", 0.0, seed=4)
    inputs["advantages"] = sign * (inputs["advantages"].abs() + 0.1)
    inputs["old_per_token_logps"] = inputs["old_per_token_logps"] - 0.25 * sign
    metrics = _assert_same(*trainers, inputs)
    name = "clip_ratio/low_min" if sign < 0 else "clip_ratio/high_max"
    assert 0.0 < metrics[name][0] < 1.0


@pytest.mark.parametrize("lm_head", [False, True])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_parity_with_gradient_accumulation(
    loss_type, lm_head, model_dir, tokenizer, tmp_path, monkeypatch
):
    """Mid-window micro-batch of 2 accumulation steps, a generation batch of 1 step: TRL divides
    grpo's loss by the steps and rescales dapo's token count by steps / steps_per_generation.
    The fused loss writes its gradient already divided (grad_scale): backward rescales none."""
    from fusedrl import _autograd

    args = _args(tmp_path, loss_type=loss_type)
    trainers = [_trainer(c, model_dir, tokenizer, args) for c in (GRPOTrainer, FusedGRPOTrainer)]
    trainers[1].fused_lm_head = lm_head
    for trainer in trainers:
        trainer.current_gradient_accumulation_steps = 2
    factors = []
    real = _autograd.scale_unless_one
    monkeypatch.setattr(
        _autograd, "scale_unless_one", lambda g, f: factors.append(float(f)) or real(g, f)
    )
    _assert_same(*trainers, _inputs(trainers[0].model, loss_type, 0.0, seed=5))
    assert factors and set(factors) == {1.0}, factors


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_parity_with_router_aux_loss(loss_type, moe_dir, tokenizer, tmp_path):
    """An MoE model: TRL adds router_aux_loss_coef * aux_loss (over gradient accumulation) and
    logs aux_loss; so does the fused trainer."""
    args = _args(tmp_path, loss_type=loss_type)
    trainers = [_trainer(c, moe_dir, tokenizer, args) for c in (GRPOTrainer, FusedGRPOTrainer)]
    for trainer in trainers:
        assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == 0.05
        trainer.current_gradient_accumulation_steps = 2
    metrics = _assert_same(*trainers, _inputs(trainers[0].model, loss_type, 0.0, seed=6))
    assert metrics["aux_loss"][0] > 0


def test_import_does_not_print_trl_vllm_version_warning():
    """fusedrl.integrations.trl silences the vLLM-version warning of TRL's import, and only that:
    no warning filter outlives the import, and the environment does trigger it (else the check
    would prove nothing)."""
    code = (
        "import warnings\n"
        "import fusedrl.integrations.trl\n"
        "leaked = any(f[1] is not None and 'vLLM' in f[1].pattern for f in warnings.filters)\n"
        "from trl.import_utils import is_vllm_available\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    is_vllm_available()\n"
        "n = sum('TRL currently supports vLLM' in str(w.message) for w in caught)\n"
        "print('RESULT', leaked, n)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    leaked, triggered = run.stdout.split("RESULT")[-1].split()
    if triggered == "0":
        pytest.skip("TRL does not warn about this environment's vLLM: nothing to silence")
    assert leaked == "False"
    import_output = run.stderr + run.stdout.split("RESULT")[0]
    assert import_output.count("TRL currently supports vLLM") == 0, import_output


# The entropy bonus on data where it acts: each loss type's own normalisation against TRL's
# token-mean bonus, the top-entropy selection, gradient accumulation (TRL divides the bonus by
# the steps; dapo's loss is not divided otherwise), the fused LM head.
ENTROPY_CASES = {
    "grpo": ("grpo", {}, 1),
    "dapo-accumulated": ("dapo", {}, 2),
    "dr_grpo-top-entropy": ("dr_grpo", {"top_entropy_quantile": 0.5}, 1),
    "bnpo-lm-head": ("bnpo", {}, 1),
}


@pytest.mark.parametrize("case", sorted(ENTROPY_CASES))
def test_parity_with_the_entropy_bonus(case, model_dir, tokenizer, tmp_path):
    loss_type, extra, steps = ENTROPY_CASES[case]
    args = _args(tmp_path, loss_type=loss_type, entropy_coef=0.05, **extra)
    trainers = [_trainer(c, model_dir, tokenizer, args) for c in (GRPOTrainer, FusedGRPOTrainer)]
    trainers[1].fused_lm_head = case.endswith("lm-head")
    for trainer in trainers:
        trainer.current_gradient_accumulation_steps = steps
    metrics = _assert_same(*trainers, _inputs(trainers[0].model, loss_type, 0.0, seed=7))
    assert "policy_loss" in metrics and metrics["entropy_coef"] == [0.05]
    # The bonus acted: without it the loss is another number.
    plain = _trainer(
        FusedGRPOTrainer, model_dir, tokenizer, _args(tmp_path, loss_type=loss_type, **extra)
    )
    plain.current_gradient_accumulation_steps = steps
    inputs = _inputs(trainers[0].model, loss_type, 0.0, seed=7)
    assert abs(_loss_and_grads(plain, inputs)[0] - _loss_and_grads(trainers[1], inputs)[0]) > 1e-3


@pytest.mark.parametrize("target", [100.0, 0.01])  # entropy below the target: grows; above: falls
def test_parity_with_adaptive_entropy(target, model_dir, tokenizer, tmp_path):
    """use_adaptive_entropy: three optimizer steps; TRL's gate (no bonus before the first
    measurement), its updates and its logged coefficient, step by step."""
    args = _args(
        tmp_path,
        loss_type="dapo",
        use_adaptive_entropy=True,
        entropy_coef=0.02,
        entropy_target=target,
        entropy_coef_delta=0.01,
    )
    trainers = [_trainer(c, model_dir, tokenizer, args) for c in (GRPOTrainer, FusedGRPOTrainer)]
    for seed in range(3):
        inputs = _inputs(trainers[0].model, "dapo", 0.0, seed=20 + seed)
        (ref_loss, ref_grads), (loss, grads) = (_loss_and_grads(t, inputs) for t in trainers)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
        for g, ref in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-7)
    trl_trainer, fused_trainer = trainers
    assert fused_trainer.entropy_coef == pytest.approx(trl_trainer.entropy_coef)
    assert fused_trainer._last_world_entropy == pytest.approx(trl_trainer._last_world_entropy)
    for name in ("entropy_coef", "policy_loss", "entropy"):
        assert fused_trainer._metrics["train"][name] == pytest.approx(
            trl_trainer._metrics["train"][name], rel=1e-5
        ), name
    expected = [0.03, 0.04, 0.05] if target > 1 else [0.01, 0.0, 0.0]
    assert fused_trainer._metrics["train"]["entropy_coef"] == pytest.approx(expected)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("cap", [None, 0.5])
def test_parity_cispo_with_a_cap_below_one(cap, level, model_dir, tokenizer, tmp_path):
    """TRL's cispo caps the ratio at epsilon_high itself; unset, that is epsilon (0.2), which
    TRL's own tests run: every ratio above the cap weighs the cap. Accepted, TRL's numbers."""
    args = _args(tmp_path, loss_type="cispo", importance_sampling_level=level, epsilon_high=cap)
    trainers = [_trainer(c, model_dir, tokenizer, args) for c in (GRPOTrainer, FusedGRPOTrainer)]
    assert trainers[1].fused_config.eps_high == pytest.approx((cap or args.epsilon) - 1)
    metrics = _assert_same(*trainers, _inputs(trainers[0].model, "cispo", 0.0, seed=10))
    assert 0 < metrics["cispo_clip_ratio"][0] < 1  # capped tokens (A > 0), and others


def test_every_loss_type_is_accepted_at_the_sequence_level(tmp_path, caplog):
    """Every loss_type TRL takes at importance_sampling_level="sequence" is taken, with TRL's
    warning where TRL warns (bnpo / dr_grpo / dapo / cispo: the sequence weighted by its length;
    their parity with TRL: test_parity_with_trl_compute_loss)."""
    import logging

    from fusedrl.integrations.trl import SUPPORTED_LOSS_TYPES

    for loss_type in SUPPORTED_LOSS_TYPES:
        caplog.clear()
        extra = {"epsilon_high": 5.0} if loss_type == "cispo" else {}
        args = _args(tmp_path, loss_type=loss_type, importance_sampling_level="sequence", **extra)
        with caplog.at_level(logging.WARNING, logger="fusedrl.integrations.trl"):
            cfg = loss_config_from_trl(args)
        warned = "weights each sequence by its completion length" in caplog.text
        assert warned == (loss_type in ("bnpo", "dr_grpo", "dapo", "cispo")), loss_type
        assert cfg.ratio_level == ("token" if loss_type == "vespo" else "sequence"), loss_type


def test_bad_settings_fail_before_the_models_load(tmp_path):
    """The drop-in's own arguments and an unsupported GRPOConfig are refused before TRL loads
    anything: the model path here does not exist, so any later check would name it instead."""
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match="fused_backend='jax' is not one of"):
        FusedGRPOTrainer(
            model=missing, reward_funcs=_reward_len, args=_args(tmp_path), fused_backend="jax"
        )
    with pytest.raises(ValueError, match="fused_lm_head must be None, True or False"):
        FusedGRPOTrainer(
            model=missing, reward_funcs=_reward_len, args=_args(tmp_path), fused_lm_head="yes"
        )
    bad = _args(tmp_path, importance_sampling_level="tokens")  # GRPOConfig takes any string
    with pytest.raises(ValueError, match="importance_sampling_level='tokens' is not supported"):
        FusedGRPOTrainer(missing, _reward_len, bad)
    # LossConfig's refusals in GRPOConfig's names
    bad = _args(tmp_path, delta=1.1)  # below 1 + epsilon_high: TRL trains it, fusedrl refuses
    with pytest.raises(ValueError, match=r"GRPOConfig\(loss_type='dapo', .*delta=1.1, .*eps_high"):
        FusedGRPOTrainer(missing, _reward_len, bad)
    bad = _args(tmp_path, loss_type="dr_grpo", max_completion_length=None)
    with pytest.raises(ValueError, match="divides by max_completion_length, which is None"):
        FusedGRPOTrainer(missing, _reward_len, bad)
    # epsilon >= 1: TRL's lower bound 1 - epsilon <= 0 never binds; fusedrl's is open
    assert loss_config_from_trl(_args(tmp_path, epsilon=1.0)).eps_low == 1.0 - 1e-12
    with pytest.raises(ValueError, match="fused_lm_head=True needs fused_backend 'auto'"):
        FusedGRPOTrainer(
            missing, _reward_len, _args(tmp_path), fused_backend="cuda", fused_lm_head=True
        )
    if not torch.cuda.is_available():  # a backend this machine cannot run
        with pytest.raises(ValueError, match="fused_backend='cuda': backend='cuda' .* needs CUDA"):
            FusedGRPOTrainer(missing, _reward_len, _args(tmp_path), fused_backend="cuda")


def test_the_fused_lm_head_is_the_default_and_said(model_dir, tokenizer, tmp_path, caplog):
    """One process and a plain head: the loss runs from the hidden states and the head by
    default, one INFO line at start says so (fusedrl, its version, the backend, the head, the
    loss); fused_lm_head=False keeps the logits, and says why."""
    import logging

    with caplog.at_level(logging.INFO, logger="fusedrl.integrations.trl"):
        trainer = _trainer(FusedGRPOTrainer, model_dir, tokenizer, _args(tmp_path))
    assert trainer.fused_lm_head is True
    lines = [r.getMessage() for r in caplog.records if r.name == "fusedrl.integrations.trl"]
    assert len(lines) == 1 and fusedrl.__version__ in lines[0], lines
    assert "backend auto, fused LM head on, loss LossConfig(" in lines[0], lines
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fusedrl.integrations.trl"):
        off = FusedGRPOTrainer(
            model=model_dir,
            reward_funcs=_reward_len,
            args=_args(tmp_path),
            train_dataset=trainer.train_dataset,
            processing_class=tokenizer,
            fused_lm_head=False,
        )
    assert off.fused_lm_head is False
    assert "fused LM head off (fused_lm_head=False)" in caplog.records[-1].getMessage()
    trainer.fused_backend = "cuda"  # asked for by name: its logits kernel, and the log says so
    assert trainer._fused_lm_head(None) == (
        False,
        "fused_backend='cuda': the CUDA extension has no LM-head kernel",
    )
    trainer.fused_backend = "auto"
    trainer.is_fsdp_enabled = True  # a sharded head: the logits path, or an error if required
    assert trainer._fused_lm_head(None) == (False, "DeepSpeed / FSDP shard the LM head's weight")
    with pytest.raises(ValueError, match="fused_lm_head=True cannot run: DeepSpeed / FSDP"):
        trainer._fused_lm_head(True)


def test_mapping_values(tmp_path):
    cfg = loss_config_from_trl(
        _args(tmp_path, loss_type="dr_grpo", beta=0.04, use_bias_correction_kl=False)
    )
    assert (cfg.agg, cfg.norm_constant, cfg.kl, cfg.beta) == (
        "seq-mean-token-sum-norm",
        7.0,
        "k3",
        0.04,
    )
    cfg = loss_config_from_trl(
        _args(tmp_path, loss_type="grpo", importance_sampling_level="sequence")
    )
    assert cfg.ratio_level == "sequence" and cfg.temperature == 0.9


@pytest.mark.slow
def test_short_training_run(model_dir, tokenizer, tmp_path):
    """Two real optimizer steps: generation, rewards, the fused loss (with a KL to the reference
    model), backward, AdamW."""
    args = _args(
        tmp_path, loss_type="dapo", learning_rate=1e-3, beta=0.04, use_bias_correction_kl=False
    )
    trainer = _trainer(FusedGRPOTrainer, model_dir, tokenizer, args)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    result = trainer.train()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))
    changed = any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert changed
    logged = [h for h in trainer.state.log_history if "entropy" in h]
    clip = ("clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max")
    assert logged and all(all(k in h for k in clip) and "kl" in h for h in logged)


@pytest.mark.slow
def test_bench_trl_step_smoke(tmp_path):
    """bench/bench_trl_step.py runs end to end (tiny model, CPU); its numbers are not checked."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "bench_trl_step.py"
    subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (result,) = tmp_path.glob("trl_step-*.json")
    rows = json.loads(result.read_text())["rows"]
    assert [r["trainer"] for r in rows] == ["trl", "fusedrl", "fusedrl-logits"]
    assert all(r["step_ms"] > 0 for r in rows)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_distill_loss_equals_trl_generalized_jsd(beta, temperature):
    """kind="jsd" is TRL's generalized JSD, beta's endpoints included; forward_kl and reverse_kl
    are its beta = 0 and 1."""
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    from .test_distill import _inputs, _run

    student, teacher, labels, mask = _inputs(seed=int(10 * beta))
    trl_labels = torch.where(mask, labels, -100)
    x = student.clone().requires_grad_(True)
    theirs = GKDTrainer.generalized_jsd_loss(
        x, teacher, trl_labels, beta=beta, temperature=temperature
    )
    (their_grad,) = torch.autograd.grad(theirs, x)
    kinds = ["jsd"] + (["forward_kl"] if beta == 0 else ["reverse_kl"] if beta == 1 else [])
    for kind in kinds:
        ours, grad = _run(
            fusedrl.distill_loss,
            student,
            teacher,
            labels,
            mask,
            kind=kind,
            beta=beta,
            temperature=temperature,
        )
        torch.testing.assert_close(ours.loss, theirs, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(grad, their_grad, atol=1e-7, rtol=1e-5)
