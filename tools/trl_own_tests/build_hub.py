"""Write an offline Hugging Face cache whose `trl-internal-testing/<name>` models are local
stand-ins: TRL's tiny test architectures with random weights and fusedrl's character tokenizer."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
import transformers as tf

from fusedrl.tiny import char_tokenizer

REVISION = "0" * 40  # the snapshot every stand-in's refs/main points at


def stand_ins() -> dict:
    """name -> (config class, model class, config fields beyond the shared small shape)."""
    head = {"num_labels": 1}
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    return {
        "tiny-Qwen2ForCausalLM-2.5": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
        "tiny-Qwen2ForSequenceClassification-2.5": (
            tf.Qwen2Config,
            tf.Qwen2ForSequenceClassification,
            head,
        ),
        "tiny-Qwen3ForCausalLM": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {}),
        "tiny-Qwen3ForSequenceClassification": (
            tf.Qwen3Config,
            tf.Qwen3ForSequenceClassification,
            head,
        ),
        "tiny-Qwen3MoeForCausalLM": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, moe),
        "tiny-LlamaForCausalLM-3.2": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
        "tiny-LlamaForSequenceClassification-3.2": (
            tf.LlamaConfig,
            tf.LlamaForSequenceClassification,
            head,
        ),
        "tiny-MistralForCausalLM-0.2": (tf.MistralConfig, tf.MistralForCausalLM, {}),
        # the logit transforms after the head that the fused head applies itself
        "tiny-Gemma2ForCausalLM": (
            tf.Gemma2Config,
            tf.Gemma2ForCausalLM,
            {"final_logit_softcapping": 30.0},
        ),
        "tiny-Cohere2ForCausalLM": (tf.Cohere2Config, tf.Cohere2ForCausalLM, {"logit_scale": 0.25}),
    }


def build(hub: Path) -> None:
    tokenizer = char_tokenizer()
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    for name, (config_class, model_class, extra) in stand_ins().items():
        repo = hub / f"models--trl-internal-testing--{name}"
        shutil.rmtree(repo, ignore_errors=True)
        snapshot = repo / "snapshots" / REVISION
        snapshot.mkdir(parents=True)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(REVISION)
        torch.manual_seed(0)
        model_class(config_class(**shape, **extra)).save_pretrained(snapshot)
        tokenizer.save_pretrained(snapshot)
        print(f"stand-in trl-internal-testing/{name}")


if __name__ == "__main__":
    build(Path(sys.argv[1]) / "hub")
