"""One fusedrl-train optimizer step vs the same step with TRL-style eager log-probs and loss.

    python bench/bench_train_step.py            # Qwen2.5-1.5B-shaped random model (GPU)
    python bench/bench_train_step.py --smoke    # tiny model, any device (CI checks it runs)

The step is the trainer's update on one minibatch: forward of the policy (fp32 master weights,
bf16 autocast on a GPU), the GRPO-family loss, backward, grad-norm clip and AdamW. Rollouts are
synthetic token ids (no vLLM). `fusedrl` is `fusedrl.trainer.step.accumulate_gradients` (the fused
loss reads the logits view once and writes the gradient into it); `eager` takes the completion
logits, divides by the temperature, log-softmaxes in fp32 and gathers (TRL's recipe), then the
same loss in PyTorch ops. `fusedrl-packed` is the fusedrl step with `--pack` (each micro-batch
as one padding-free row: trainer/packing.py; completions of 1/2 to 1 times --completion-len,
so about a quarter of the padded batch is padding). All get the same weights and batch.
Results: a table and bench/results/train_step-<gpu>-<date>.json (median step time, peak memory).
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
from bench_loss import RESULTS, SMOKE_NOTE, results_dir
from bench_trl_step import QWEN25_15B, time_steps  # shared by both step benchmarks

from fusedrl import LossConfig
from fusedrl.trainer.step import Batch, accumulate_gradients, collate, completion_logits

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=1031,
    tie_word_embeddings=False,
)


IMPLS = ("eager", "fusedrl", "fusedrl-packed")


def make_batch(vocab: int, batch: int, prompt_len: int, completion_len: int) -> Batch:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(completion_len // 2, completion_len + 1, (batch,), generator=gen)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()] * batch
    completions = [torch.randint(3, vocab, (int(n),), generator=gen).tolist() for n in lengths]
    logps = [(-torch.rand(len(c), generator=gen) * 3).tolist() for c in completions]
    advantages = torch.randn(batch, generator=gen)
    return collate(
        prompts, completions, advantages, torch.ones(batch, dtype=torch.bool), logps, pad_id=0
    )


def eager_loss(model, batch: Batch, cfg: LossConfig, autocast) -> torch.Tensor:
    """TRL-style: fp32 log-softmax of the completion logits, gather, PPO-clip, token-mean."""
    logits = completion_logits(model, batch, autocast)
    logp = torch.log_softmax(logits.float() / cfg.temperature, dim=-1)
    logp = logp.gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - batch.rollout_logp)
    adv = batch.advantages[:, None]
    clipped = torch.clamp(ratio, 1 - cfg.eps_low, 1 + cfg.eps_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    loss = (per_token * batch.mask).sum() / batch.mask.sum().clamp(min=1)
    loss.backward()
    return loss.detach()


def run(impl: str, model, batch: Batch, cfg: LossConfig, steps: int, autocast) -> dict:
    cuda = batch.input_ids.is_cuda
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    batch.old_logp = batch.rollout_logp  # an off-policy minibatch: the ratio is not 1

    def train_step():
        if impl.startswith("fusedrl"):
            pack = impl == "fusedrl-packed"
            accumulate_gradients(model, batch, cfg, 0, autocast, "auto", pack=pack)
        else:
            eager_loss(model, batch, cfg, autocast)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step_ms, step_ms_min, peak = time_steps(train_step, steps, cuda)
    return dict(impl=impl, step_ms=step_ms, step_ms_min=step_ms_min, peak_mem_bytes=peak)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--completion-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--smoke", action="store_true", help="tiny model: not a measurement")
    args = parser.parse_args(argv)
    args.out = results_dir(args.out, args.smoke)
    if args.smoke:
        print(f"# {SMOKE_NOTE}")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    autocast = torch.bfloat16 if cuda else None
    if args.smoke:
        args.batch, args.prompt_len, args.completion_len, args.steps = 4, 5, 9, 2
    shape = TINY if args.smoke else QWEN25_15B
    cfg = LossConfig.preset("dapo")
    batch = make_batch(shape["vocab_size"], args.batch, args.prompt_len, args.completion_len)
    batch = batch.to(device)
    rows = []
    for impl in IMPLS:
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**shape, pad_token_id=0)).to(device).train()
        if args.gradient_checkpointing and not args.smoke:
            model.gradient_checkpointing_enable()
        row = run(impl, model, batch, cfg, args.steps, autocast)
        row.update(
            batch=args.batch,
            prompt_len=args.prompt_len,
            completion_len=args.completion_len,
            vocab=shape["vocab_size"],
            tokens=int(batch.mask.sum().item()),
        )
        rows.append(row)
        del model
        if cuda:
            torch.cuda.empty_cache()
    base = rows[0]
    print(f"{'impl':<14} {'step ms':>9} {'speedup':>8} {'peak GiB':>9} {'mem saved':>10}")
    for row in rows:
        peak = row["peak_mem_bytes"]
        saved = (base["peak_mem_bytes"] - peak) / 2**30 if peak is not None else None
        print(
            f"{row['impl']:<14} {row['step_ms']:9.1f} {base['step_ms'] / row['step_ms']:7.2f}x "
            f"{'-' if peak is None else f'{peak / 2**30:9.2f}'} "
            f"{'-' if saved is None else f'{saved:9.2f}'}"
        )
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in device_name.lower()).strip("-")
    path = args.out / f"train_step-{slug}-{datetime.date.today().isoformat()}.json"
    path.write_text(
        json.dumps(
            {
                "device": device_name,
                "torch": torch.__version__,
                "smoke": args.smoke,
                "note": SMOKE_NOTE if args.smoke else "",
                "timestamp": datetime.datetime.now().isoformat(timespec="seconds"),
                "model": "tiny" if args.smoke else "Qwen2.5-1.5B-shaped",
                "loss": "dapo",
                "gradient_checkpointing": args.gradient_checkpointing and not args.smoke,
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {path}")
    if args.smoke:
        print(SMOKE_NOTE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
