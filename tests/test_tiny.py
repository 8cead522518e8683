"""The tiny local model and tokenizer survive save_pretrained / from_pretrained exactly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from fusedrl.tiny import char_tokenizer, tiny_llama  # noqa: E402

MATH = "Solve: 12 + 30 = ?\nShow your work, then answer in \\boxed{}.\n\\boxed{42} [x_1^2] 5% {a}"


def test_saved_char_tokenizer_encodes_and_decodes_like_the_original(tmp_path):
    tokenizer = char_tokenizer()
    tiny_llama(len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    ids = tokenizer.encode(MATH, add_special_tokens=False)
    assert pad_free(ids, tokenizer) and reloaded.encode(MATH, add_special_tokens=False) == ids
    assert reloaded.decode(ids) == tokenizer.decode(ids) == MATH
    chat = [{"role": "user", "content": MATH}]
    assert reloaded.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == (
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    )
    assert (reloaded.eos_token_id, reloaded.pad_token_id) == (tokenizer.eos_token_id, 0)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.config.vocab_size == len(reloaded)
    assert torch.isfinite(model(torch.tensor([ids])).logits).all()


def pad_free(ids, tokenizer) -> bool:
    """Every character has its own token: nothing fell back to <pad> (the unknown token)."""
    return tokenizer.pad_token_id not in ids
