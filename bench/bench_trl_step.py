"""One TRL GRPO training step, GRPOTrainer vs fusedrl's FusedGRPOTrainer: time and peak memory.

    python bench/bench_trl_step.py                     # Qwen2.5-1.5B-shaped random model (GPU)
    python bench/bench_trl_step.py --smoke             # tiny model, any device (CI checks it runs)

The step is what the trainer runs per micro-batch after generation: `_compute_loss` (forward,
per-token log-probs, the GRPO-family loss), backward and an AdamW step, on synthetic completions
(random token ids; no vLLM needed). GRPOTrainer, FusedGRPOTrainer (its default: the fused LM
head) and FusedGRPOTrainer(fused_lm_head=False) (the logits) get the same weights and inputs.
Results are
printed and saved to bench/results/trl_step-<gpu>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import tempfile
import time
import warnings
from pathlib import Path

import torch
from bench_loss import RESULTS, SMOKE_NOTE, results_dir

warnings.filterwarnings("ignore", message="TRL currently supports vLLM")

QWEN25_15B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
)


def time_steps(step, steps: int, cuda: bool) -> tuple[float, float, int | None]:
    """Median and min ms of `steps` calls after one warm-up call, and the peak memory after it.

    The warm-up call pays for allocations and kernel compilation; the peak is reset after it, so
    it counts what a steady step holds (the weights and optimizer state included).
    """
    times = []
    for i in range(steps + 1):
        if cuda:
            torch.cuda.synchronize()
            if i == 1:
                torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        if i > 0:
            times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return times[len(times) // 2], times[0], peak


def _model_dir(smoke: bool, dtype: torch.dtype, root: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fusedrl.tiny import char_tokenizer

    tokenizer = char_tokenizer()
    shape = (
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=len(tokenizer),
        )
        if smoke
        else QWEN25_15B
    )
    config = Qwen2Config(**shape, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(dtype).save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def _inputs(vocab, batch, prompt_len, completion_len, device):
    gen = torch.Generator().manual_seed(0)
    completion_mask = torch.ones(batch, completion_len, dtype=torch.long)
    lengths = torch.randint(completion_len // 2, completion_len + 1, (batch,), generator=gen)
    completion_mask &= torch.arange(completion_len)[None] < lengths[:, None]
    inputs = dict(
        prompt_ids=torch.randint(3, vocab, (batch, prompt_len), generator=gen),
        prompt_mask=torch.ones(batch, prompt_len, dtype=torch.long),
        completion_ids=torch.randint(3, vocab, (batch, completion_len), generator=gen),
        completion_mask=completion_mask,
        advantages=torch.randn(batch, generator=gen),
        num_items_in_batch=completion_mask.sum().float(),
    )
    return {k: v.to(device) for k, v in inputs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--completion-len", type=int, default=2048)
    parser.add_argument("--loss-type", default="dapo")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--smoke", action="store_true", help="tiny model: not a measurement")
    args = parser.parse_args(argv)
    args.out = results_dir(args.out, args.smoke)
    if args.smoke:
        print(f"# {SMOKE_NOTE}")

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from fusedrl.integrations.trl import FusedGRPOTrainer

    cuda = torch.cuda.is_available()
    if args.smoke:
        args.batch, args.prompt_len, args.completion_len, args.steps = 4, 5, 9, 2
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model_dir(args.smoke, dtype, Path(tmp) / "model")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # fusedrl: the drop-in's default (the fused LM head); fusedrl-logits: its logits path
        trainers = (
            ("trl", GRPOTrainer, {}),
            ("fusedrl", FusedGRPOTrainer, {}),
            ("fusedrl-logits", FusedGRPOTrainer, {"fused_lm_head": False}),
        )
        for name, cls, extra in trainers:
            config = GRPOConfig(
                output_dir=str(Path(tmp) / name),
                loss_type=args.loss_type,
                per_device_train_batch_size=args.batch,
                num_generations=args.batch,
                max_completion_length=args.completion_len,
                report_to=[],
                use_cpu=not cuda,
                bf16=cuda,
                save_strategy="no",
                gradient_checkpointing=not args.smoke,
                beta=0.0,
            )
            trainer = cls(
                model=str(model_dir),
                reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                args=config,
                processing_class=tokenizer,
                train_dataset=Dataset.from_dict({"prompt": ["x"] * args.batch}),
                **extra,
            )
            trainer.current_gradient_accumulation_steps = 1
            model = trainer.model.to(device).train()
            if not args.smoke:
                # Trainer.train() would turn checkpointing on; _compute_loss alone does not (at
                # 8 x 2304 tokens a 1.5B model's activations overflow 80 GB without it).
                model.gradient_checkpointing_enable({"use_reentrant": False})
                model.config.use_cache = False
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
            inputs = _inputs(
                model.config.vocab_size, args.batch, args.prompt_len, args.completion_len, device
            )

            def train_step(trainer=trainer, model=model, optimizer=optimizer, inputs=inputs):
                trainer._compute_loss(model, inputs).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            try:
                step_ms, _, peak = time_steps(train_step, args.steps, cuda)
            except torch.OutOfMemoryError as exc:  # recorded: one trainer's OOM is a result
                step_ms, peak = None, None
                print(f"{name:<8} out of memory: {str(exc).splitlines()[0][:160]}")
            row = dict(
                trainer=name,
                loss_type=args.loss_type,
                batch=args.batch,
                prompt_len=args.prompt_len,
                completion_len=args.completion_len,
                vocab=model.config.vocab_size,
                step_ms=step_ms,
                peak_mem_bytes=peak,
            )
            rows.append(row)
            if step_ms is not None:
                peak = f"{row['peak_mem_bytes'] / 2**30:.2f} GiB" if cuda else "-"
                print(f"{name:<14} step {row['step_ms']:9.1f} ms   peak {peak}")
            del trainer, model, optimizer, inputs, train_step
            gc.collect()  # an OOM's traceback frames hold the model until collected
            if cuda:
                torch.cuda.empty_cache()
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in device_name.lower()).strip("-")
    path = args.out / f"trl_step-{slug}-{datetime.date.today().isoformat()}.json"
    path.write_text(
        json.dumps(
            {
                "device": device_name,
                "torch": torch.__version__,
                "timestamp": datetime.datetime.now().isoformat(timespec="seconds"),
                "smoke": args.smoke,
                "note": SMOKE_NOTE if args.smoke else "",
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
