"""Tiny, locally built models and tokenizers (no hub access): for tests, demos and CPU training.

`char_tokenizer()` is a real `transformers.PreTrainedTokenizerFast` over single characters (a
`tokenizers` WordLevel model with a per-character pre-tokenizer), so anything that takes a Hugging
Face tokenizer (TRL, vLLM, chat templates) takes it. `tiny_llama()` and `tiny_qwen2()` are real
causal LMs with random weights built from a config; head_dim >= 32 because vLLM's CPU attention
rejects less.

Save the char tokenizer next to a Llama, not a Qwen2: transformers 5 reloads the tokenizer of any
folder whose config says `model_type: qwen2` as a byte-level Qwen2Tokenizer, whatever
tokenizer_config.json says, and that one drops spaces, newlines, backslashes and braces.
`tiny_qwen2()` is for in-memory use (tests of the TRL drop-in).
"""

from __future__ import annotations

import string

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>")
# Everything a math answer needs, \boxed{} included.
DEFAULT_CHARS = string.digits + string.ascii_letters + " +-*/=()<>.,:;!?'\"\n\\{}[]^_%$#&|~@`"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def char_tokenizer(chars: str = DEFAULT_CHARS):
    """A character-level fast tokenizer with <pad>, <eos>, <bos> and a minimal chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in dict.fromkeys(chars):
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<pad>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _tiny_causal_lm(
    arch: str,
    vocab_size: int,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 32,
    max_position_embeddings: int = 512,
    seed: int = 0,
    eos_token_id: int = 1,
    pad_token_id: int = 0,
):
    """A randomly initialised `arch` ("llama" or "qwen2") causal LM (fp32) from a config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        arch,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=2,
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def tiny_qwen2(vocab_size: int, **sizes):
    """A randomly initialised Qwen2ForCausalLM (fp32) small enough for 2 CPU cores. `sizes`:
    hidden_size (64), num_layers (2), num_heads (2), head_dim (32), max_position_embeddings
    (512), seed (0), eos_token_id (1), pad_token_id (0)."""
    return _tiny_causal_lm("qwen2", vocab_size, **sizes)


def tiny_llama(vocab_size: int, **sizes):
    """A randomly initialised LlamaForCausalLM (fp32): the one to save with `char_tokenizer()`.
    `sizes` as `tiny_qwen2`'s."""
    return _tiny_causal_lm("llama", vocab_size, **sizes)
