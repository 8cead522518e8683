"""Tensor parallelism: the fused loss on vocab-sharded logits against the peers' way, one run.

    python bench/bench_tp.py                  # GPU: tp in {2, 4, 8} up to the visible GPUs
    python bench/bench_tp.py --tp 2           # one group size
    python bench/bench_tp.py --smoke          # CPU, gloo, 2 processes: not a measurement

One process per GPU (torch.multiprocessing, NCCL), one world per tp. Each rank holds its slice
[B, T, V / tp] of bf16 logits (N = B·T = 16384 tokens, V = 151936 by default); labels, mask and
the per-token inputs are replicated. Ops and impls:

- `token_logprobs_fwd` (no grad: old / reference log-probs): `fusedrl` is
  fusedrl.token_logprobs(..., tp_group=); `megatron-eager` is Megatron's vocab-parallel
  log-probs (`-vocab_parallel_cross_entropy`, what verl's vocab_parallel_log_probs_from_logits
  calls), written here from its formulas: an fp32 copy of the slice, an all-reduce MAX, an
  all-reduce SUM of the label's logit, an all-reduce SUM of the exp-sums.
- `logp_entropy_fwd_bwd`: log-probs and entropy, forward + backward of a weighted sum of both.
  `verl-eager` is verl's Megatron engine: its vocab_parallel_entropy (three more all-reduces,
  in the logits' dtype) on the logits, Megatron's log-probs on a copy of them; `fusedrl` is one
  fusedrl.token_logprobs(..., return_entropy=True, tp_group=) call (what
  fusedrl.integrations.verl.vocab_parallel_log_probs_and_entropy runs).
- `policy_loss_fwd_bwd` (--presets, default dapo and gspo): the loss and d loss / d logits.
  `megatron-eager` is Megatron's log-probs then the policy loss in PyTorch (what every peer does
  under TP); `fusedrl` is fusedrl.policy_loss(..., tp_group=).

Each op is also run at tp = 1 (rank 0 alone, the whole [B, T, V] logits on one GPU, no group):
`fusedrl` and the eager impl with no collective.

Timing: before each timed call every rank synchronises and meets at a barrier, then a CUDA event
pair (perf_counter on CPU) brackets the call; a call's time is the slowest rank's. The number of
calls is agreed by all ranks (from a 5-call estimate). Medians (p20, p80) over the calls; the
inputs rotate over two copies of the logits. `bytes_floor` is what the op must move per rank
(its slice read once; the gradient written once; sequence-level losses read it twice), and
`%floor` compares the time with that at the device-to-device copy bandwidth measured in the same
run. The collectives of one call are counted on every rank by wrapping torch.distributed
(`collectives`: calls by name; `comm_bytes_per_token`: the bytes of the tensors each rank hands
to them (an all-gather's input, an all-reduce's tensor), over N). `logp_max_diff`,
`entropy_max_diff`, `loss_max_diff`, `grad_max_diff` (the largest over the ranks; the gradient
on a window of CHECK_COLUMNS columns of each slice): against the fusedrl tensor-parallel call on
the same inputs (an impl that computes something else shows here). Peak memory is above the
inputs, the largest over the ranks. The table is printed; the JSON goes to
bench/results/tp-<date>-<time>.json (`tp-smoke.json` with "smoke": true for --smoke, which runs
fp32 so that the checks are tight).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_loss import SMOKE_NOTE, copy_bandwidth_gbps, write_run_json  # noqa: E402

import fusedrl  # noqa: E402
from fusedrl import LossConfig  # noqa: E402

OPS = ("token_logprobs_fwd", "logp_entropy_fwd_bwd", "policy_loss_fwd_bwd")
EAGER = {
    "token_logprobs_fwd": "megatron-eager",
    "logp_entropy_fwd_bwd": "verl-eager",
    "policy_loss_fwd_bwd": "megatron-eager",
}
COPIES = 2
SMOKE = dict(N=32, V=262, sequences=4, warmup=1, rep_ms=20)
COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "reduce_scatter",
    "reduce_scatter_tensor",
)


# ------------------------------------------------------------------------------ the peers' way
def _vocab_range(logits: torch.Tensor, group) -> tuple[int, int]:
    """Megatron's layout: rank r holds [r * V_r, (r + 1) * V_r) (even slices)."""
    width = logits.shape[-1]
    rank = 0 if group is None else dist.get_rank(group)
    return rank * width, (rank + 1) * width


def _all_reduce(t: torch.Tensor, op, group) -> None:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)


class MegatronLogProbs(torch.autograd.Function):
    """log p(label) of vocab-sharded logits as Megatron's vocab_parallel_cross_entropy computes
    it (its negative), from its formulas: fp32 logits, the row max all-reduced (MAX), the
    label's shifted logit from its owner all-reduced (SUM), the exp-sums all-reduced (SUM). The
    fp32 softmax of the slice is kept for backward, which communicates nothing:
    d logp / d z = onehot(label) - softmax. `group=None`: one rank, no collective."""

    @staticmethod
    def forward(ctx, logits, labels, group):
        z = logits.float()
        if z is logits:  # Megatron works in place on its fp32 input; not on the caller's here
            z = z.clone()
        top = z.amax(dim=-1)
        _all_reduce(top, dist.ReduceOp.MAX, group)
        z -= top.unsqueeze(-1)
        start, stop = _vocab_range(logits, group)
        owned = (labels >= start) & (labels < stop)
        local = torch.where(owned, labels - start, 0)
        picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        picked = torch.where(owned, picked, 0.0)
        _all_reduce(picked, dist.ReduceOp.SUM, group)
        z.exp_()
        total = z.sum(dim=-1)
        _all_reduce(total, dist.ReduceOp.SUM, group)
        z /= total.unsqueeze(-1)  # the slice's softmax
        ctx.save_for_backward(z, owned, local)
        ctx.dtype = logits.dtype
        return picked - torch.log(total)

    @staticmethod
    def backward(ctx, grad_logp):
        softmax, owned, local = ctx.saved_tensors
        grad = softmax.neg_()
        grad.scatter_add_(-1, local.unsqueeze(-1), owned.unsqueeze(-1).to(grad.dtype))
        grad.mul_(grad_logp.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None


class VerlEntropy(torch.autograd.Function):
    """The entropy of vocab-sharded logits as verl's vocab_parallel_entropy computes it
    (verl/utils/megatron/tensor_parallel.py, verl 0.9.1), from its formulas, in the logits'
    dtype: the row max all-reduced (MAX), the exp-sums (SUM), sum p·z (SUM);
    H = max + log sum - sum p·z. Backward: d H / d z = -p (z - sum p·z), no collective."""

    @staticmethod
    def forward(ctx, logits, group):
        top = logits.amax(dim=-1, keepdim=True)
        _all_reduce(top, dist.ReduceOp.MAX, group)
        probs = (logits - top).exp_()
        total = probs.sum(dim=-1, keepdim=True)
        _all_reduce(total, dist.ReduceOp.SUM, group)
        probs.div_(total)
        mean_z = (probs * logits).sum(dim=-1, keepdim=True)
        _all_reduce(mean_z, dist.ReduceOp.SUM, group)
        ctx.save_for_backward(logits, probs, mean_z)
        return (top + total.log() - mean_z).squeeze(-1)

    @staticmethod
    def backward(ctx, grad_entropy):
        logits, probs, mean_z = ctx.saved_tensors
        return -probs * (logits - mean_z) * grad_entropy.unsqueeze(-1), None


def eager_policy_loss(logp, cfg: LossConfig, inputs: dict) -> torch.Tensor:
    """The policy loss in PyTorch from the [B, T] log-probs (TRL's / verl's formulas): the
    clipped ratio per token (GSPO: the sequence's geometric-mean ratio, with the token's
    gradient), KL k3 when beta > 0, token-mean or seq-mean-token-mean."""
    if cfg.loss != "ppo" or cfg.agg not in ("token-mean", "seq-mean-token-mean"):
        raise ValueError(f"the eager baseline covers ppo / token-mean / seq-mean-token-mean: {cfg}")
    mask = inputs["mask"].float()
    log_ratio = logp - inputs["old"]
    if cfg.ratio_level == "sequence":
        seq = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = logp - logp.detach() + seq.detach()
    ratio = torch.exp(log_ratio)
    adv = inputs["advantages"][:, None]
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - cfg.eps_low, 1 + cfg.eps_high) * adv)
    if cfg.beta > 0:
        d = inputs["ref"] - logp
        per_token = per_token + cfg.beta * (torch.exp(d) - d - 1)
    if cfg.agg == "token-mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


# ------------------------------------------------------------------------------ inputs, steps
class Inputs:
    """One rank's inputs: `COPIES` logits (its slice, or the whole rows at tp = 1) to rotate
    over, each with its own old / reference log-probs; replicated labels, mask, advantages."""

    def __init__(self, args, device, dtype, group, start, width, backend):
        gen = torch.Generator(device=device).manual_seed(0)
        batch, time_ = args.sequences, args.N // args.sequences
        self.logits, self.old, self.ref = [], [], []
        for _ in range(COPIES):  # the same whole logits on every rank: each keeps its columns
            whole = torch.randn((batch, time_, args.V), generator=gen, device=device, dtype=dtype)
            self.logits.append(whole[..., start : start + width].clone())
            del whole
        self.labels = torch.randint(0, args.V, (batch, time_), generator=gen, device=device)
        self.mask = torch.rand((batch, time_), generator=gen, device=device) > 0.1
        self.advantages = torch.randn(batch, generator=gen, device=device)
        self.weights = torch.randn((2, batch, time_), generator=gen, device=device)
        for logits in self.logits:
            with torch.no_grad():
                logp, _ = fusedrl.token_logprobs(
                    logits, self.labels, backend=backend, tp_group=group
                )
            noise = torch.randn((2, batch, time_), generator=gen, device=device)
            self.old.append(logp + 0.1 * noise[0])
            self.ref.append(logp + 0.1 * noise[1])
        self.turn = 0

    def take(self) -> dict:
        i = self.turn % COPIES
        self.turn += 1
        return {
            "logits": self.logits[i],
            "labels": self.labels,
            "mask": self.mask,
            "advantages": self.advantages,
            "old": self.old[i],
            "ref": self.ref[i],
        }

    @property
    def bytes_of_logits(self) -> int:
        return self.logits[0].numel() * self.logits[0].element_size()


def make_step(op, impl, cfg, inputs: Inputs, group, backend):
    """A zero-argument callable: one call of `impl` on the next rotated inputs, returning its
    outputs for the check ({"logp", and "entropy" / "loss" / "grad" where the op has them})."""
    fused = impl == "fusedrl"
    tp = {"tp_group": group} if group is not None else {}

    if op == "token_logprobs_fwd":

        def step():
            x = inputs.take()
            with torch.no_grad():
                if fused:
                    logp, _ = fusedrl.token_logprobs(
                        x["logits"], x["labels"], backend=backend, **tp
                    )
                else:
                    logp = MegatronLogProbs.apply(x["logits"], x["labels"], group)
            return {"logp": logp}

        return step

    if op == "logp_entropy_fwd_bwd":

        def step():
            x = inputs.take()
            leaf = x["logits"].detach().requires_grad_(True)
            if fused:
                logp, entropy = fusedrl.token_logprobs(
                    leaf, x["labels"], return_entropy=True, backend=backend, **tp
                )
            else:  # verl's engine: the entropy, then the log-probs of a copy of the logits
                copy = leaf.clone()
                entropy = VerlEntropy.apply(leaf, group)
                logp = MegatronLogProbs.apply(copy, x["labels"], group)
            w = inputs.weights
            total = (logp * w[0]).sum() + (entropy.float() * w[1]).sum()
            (grad,) = torch.autograd.grad(total, leaf)
            return {"logp": logp.detach(), "entropy": entropy.detach(), "grad": grad}

        return step

    def step():
        x = inputs.take()
        leaf = x["logits"].detach().requires_grad_(True)
        if fused:
            out = fusedrl.policy_loss(
                leaf,
                x["labels"],
                x["advantages"],
                x["mask"],
                old_logp=x["old"],
                ref_logp=x["ref"] if cfg.beta else None,
                config=cfg,
                backend=backend,
                **tp,
            )
            logp, loss = out.logp, out.loss
        else:
            logp = MegatronLogProbs.apply(leaf, x["labels"], group)
            loss = eager_policy_loss(logp, cfg, x)
        (grad,) = torch.autograd.grad(loss, leaf)
        return {"logp": logp.detach(), "loss": loss.detach(), "grad": grad}

    return step


def floor_bytes(op: str, cfg: LossConfig | None, inputs: Inputs) -> int:
    """What the op must move per rank: its slice read once (sequence-level losses: twice, the
    sequence's ratio is known only after the whole sequence), the gradient written once."""
    logits = inputs.bytes_of_logits
    if op == "token_logprobs_fwd":
        return logits
    if op == "policy_loss_fwd_bwd" and cfg.is_sequence_level:
        return 3 * logits
    return 2 * logits


# ------------------------------------------------------------------------------ measuring
class CollectiveCount:
    """Counts torch.distributed's collectives (the outermost, when one calls another) and the
    bytes each rank sends: all-reduce its tensor, all-gather its input."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.sent = 0
        self._depth = 0
        self._saved: dict = {}

    @contextlib.contextmanager
    def counting(self):
        for name in COLLECTIVES:
            if hasattr(dist, name):
                self._saved[name] = getattr(dist, name)
                setattr(dist, name, self._counted(name, self._saved[name]))
        try:
            yield self
        finally:
            for name, fn in self._saved.items():
                setattr(dist, name, fn)

    def _counted(self, name, fn):
        def counted(*args, **kwargs):
            if self._depth == 0:
                self.calls[name] = self.calls.get(name, 0) + 1
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                sent = tensors[-1] if tensors else None  # all_gather_*(out, in): the input
                if isinstance(sent, torch.Tensor):
                    self.sent += sent.numel() * sent.element_size()
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted


def _sync(device, group) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if group is not None:
        dist.barrier(group=group)


def time_step(step, device, group, warmup: int, rep_ms: float) -> list[float]:
    """ms of each timed call on this rank; every rank makes the same number of calls."""
    for _ in range(warmup):
        step()

    def one() -> float:
        _sync(device, group)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize(device)
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        step()
        return (time.perf_counter() - t0) * 1e3

    estimate = torch.tensor(sorted(one() for _ in range(5))[2], dtype=torch.float64)
    if group is not None:  # the same count on every rank, or the collectives would hang
        estimate = estimate.to(device)
        dist.all_reduce(estimate, op=dist.ReduceOp.MAX, group=group)
    calls = int(min(200, max(5, rep_ms / max(float(estimate), 1e-3))))
    return [one() for _ in range(calls)]


def peak_above_inputs(step, device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def _gather(obj, group) -> list:
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


CHECKED = ("logp", "entropy", "loss", "grad")
CHECK_COLUMNS = 4096  # of each rank's gradient slice (rank 0's: the tp = 1 gradient's first)


def _max_diff(a: torch.Tensor | None, b: torch.Tensor | None, mask=None) -> float | None:
    """max |a - b| (over the counted tokens); None when either impl lacks the output, or when
    the shapes differ (the tp = 1 gradient is the whole rows, the others' one slice: rank 0
    compares its columns)."""
    if a is None or b is None:
        return None
    if a.shape != b.shape:
        if a.dim() != b.dim() or a.shape[:-1] != b.shape[:-1]:
            return None
        width = min(a.shape[-1], b.shape[-1])
        a, b = a[..., :width], b[..., :width]
    diff = (a.float() - b.float()).abs()
    if mask is not None:
        diff = diff[mask]
    return float(diff.max()) if diff.numel() else 0.0


def measure(args, op, impl, cfg, inputs, group, device, backend, tp, truth):
    """(One row: times (the slowest rank per call), collectives, peak memory, the check; the
    outputs of the first call, on the first copy of the inputs)."""
    step = make_step(op, impl, cfg, inputs, group, backend)
    inputs.turn = 0  # the first call of every impl gets the same inputs: the check compares them
    count = CollectiveCount()
    with count.counting():
        out = step()
    if "grad" in out:  # kept for the check: a window of the slice's columns bounds the memory
        out["grad"] = out["grad"][..., :CHECK_COLUMNS].clone()
    times = time_step(step, device, group, args.warmup, args.rep_ms)
    peak = peak_above_inputs(step, device)
    per_rank = _gather((times, peak), group)
    slowest = torch.tensor([list(t) for t, _ in per_rank], dtype=torch.float64).amax(0)
    q = slowest.quantile(torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64)).tolist()
    peaks = [p for _, p in per_rank if p is not None]
    floor = floor_bytes(op, cfg, inputs)
    row = {
        "op": op,
        "impl": impl,
        "preset": args.preset_of(cfg),
        "tp": tp,
        "N": args.N,
        "V": args.V,
        "V_rank": inputs.logits[0].shape[-1],
        "dtype": str(inputs.logits[0].dtype).replace("torch.", ""),
        "ms": q[0],
        "ms_p20": q[1],
        "ms_p80": q[2],
        "calls": len(slowest),
        "bytes_floor": floor,
        "gbps": floor / (q[0] * 1e-3) / 1e9,
        "pct_of_floor": 100.0 * floor / (args.bandwidth * 1e9) * 1e3 / q[0],
        "copy_bandwidth_gbps": args.bandwidth,  # rank 0's device, measured in this run
        "peak_mem_bytes": max(peaks) if peaks else None,
        "collectives": dict(sorted(count.calls.items())),
        "comm_bytes_per_token": count.sent / args.N,
    }
    if truth is not None:  # the largest difference over the ranks (each checks its slice)
        per_token = ("logp", "entropy")
        mine = {
            key: _max_diff(out.get(key), truth.get(key), inputs.mask if key in per_token else None)
            for key in CHECKED
        }
        for key in CHECKED:
            diffs = [d[key] for d in _gather(mine, group) if d.get(key) is not None]
            row[f"{key}_max_diff"] = max(diffs) if diffs else None
    return row, out


# ------------------------------------------------------------------------------ the worlds
def _cases(args):
    for op in args.ops:
        if op == "policy_loss_fwd_bwd":
            for preset in args.presets:
                yield op, LossConfig.preset(preset)
        else:
            yield op, None


def _print_row(row: dict) -> None:
    calls = sum(row["collectives"].values())
    peak = row["peak_mem_bytes"]
    print(
        f"{row['op']:<21} {row['impl']:<15} {row['preset'] or '-':<6} {row['tp']:>3} "
        f"{row['ms']:9.3f} {row['ms_p20']:8.3f} {row['ms_p80']:8.3f} {row['gbps']:7.0f} "
        f"{row['pct_of_floor']:6.1f}% {calls:>5} {row['comm_bytes_per_token']:7.1f} "
        f"{'-' if peak is None else f'{peak / 2**20:.0f}':>9} "
        + " ".join(_fmt(row.get(f"{key}_max_diff")) for key in CHECKED),
        flush=True,
    )


def _fmt(x) -> str:
    return f"{'-':>9}" if x is None else f"{x:9.2e}"


HEADER = (
    f"{'op':<21} {'impl':<15} {'preset':<6} {'tp':>3} {'ms':>9} {'p20':>8} {'p80':>8} "
    f"{'GB/s':>7} {'%floor':>7} {'colls':>5} {'B/token':>7} {'peak MiB':>9} "
    + " ".join(f"{'d' + key:>9}" for key in CHECKED)
)


def _worker(rank: int, world: int, port: int, args, rows_file: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.smoke:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl", rank=rank, world_size=world, device_id=device, timeout=timedelta(minutes=30)
        )
    group = dist.group.WORLD
    dtype = getattr(torch, args.dtype)
    backend = args.backend
    width = args.V // world  # Megatron's even slices (main checks that V divides)
    start = rank * width
    args.bandwidth = copy_bandwidth_gbps(device, args.copy_gib)
    inputs = Inputs(args, device, dtype, group, start, width, backend)
    rows = []
    truths = {}
    for op, cfg in _cases(args):
        for impl in ("fusedrl", EAGER[op]):
            truth = truths.get((op, args.preset_of(cfg)))
            row, out = measure(args, op, impl, cfg, inputs, group, device, backend, world, truth)
            truths.setdefault((op, args.preset_of(cfg)), out)
            rows.append(row)
            if rank == 0:
                _print_row(row)
    del inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if rank == 0 and args.with_tp1:  # the whole rows on one device, no group
        whole = Inputs(args, device, dtype, None, 0, args.V, backend)
        for op, cfg in _cases(args):
            truth = truths[(op, args.preset_of(cfg))]
            for impl in ("fusedrl", EAGER[op]):
                row, _ = measure(args, op, impl, cfg, whole, None, device, backend, 1, truth)
                rows.append(row)
                _print_row(row)
        del whole
    dist.barrier()
    if rank == 0:
        torch.save(rows, rows_file)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(args, world: int) -> list[dict]:
    """Spawn the world of `world` processes; the rows rank 0 measured."""
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = os.path.join(tmp, "rows.pt")
        mp.start_processes(
            _worker,
            args=(world, _free_port(), args, rows_file),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        return torch.load(rows_file)


class _Args(argparse.Namespace):
    def preset_of(self, cfg):
        if cfg is None:
            return None
        return next(p for p in self.presets if LossConfig.preset(p) == cfg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tp",
        nargs="+",
        type=int,
        default=None,
        help="group sizes (default: 2, 4, 8 up to the visible GPUs)",
    )
    parser.add_argument("--N", type=int, default=16384)
    parser.add_argument("--V", type=int, default=151936)
    parser.add_argument("--sequences", type=int, default=16, help="B; T = N / B")
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    parser.add_argument("--presets", nargs="+", default=["dapo", "gspo"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--backend", default="auto", help="fusedrl backend (auto: Triton on CUDA)")
    parser.add_argument(
        "--no-tp1",
        dest="with_tp1",
        action="store_false",
        help="skip the tp = 1 rows (the whole rows on one GPU)",
    )
    parser.add_argument("--copy-gib", type=float, default=4.0)
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls before timing")
    parser.add_argument("--rep-ms", type=float, default=500.0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, gloo, 2 processes, tiny shapes: checks the script runs, measures nothing",
    )
    args = parser.parse_args(argv, namespace=_Args())
    gpus = torch.cuda.device_count()
    if args.smoke:
        args.N, args.V, args.sequences = SMOKE["N"], SMOKE["V"], SMOKE["sequences"]
        args.warmup, args.rep_ms, args.copy_gib = SMOKE["warmup"], SMOKE["rep_ms"], 0.001
        args.tp, args.dtype = [2], "float32"
        device = torch.device("cpu")
        print(f"# {SMOKE_NOTE}: CPU, gloo, 2 processes, N={args.N}, V={args.V}")
    else:
        if gpus < 2:
            print(
                f"bench_tp.py: skipped: tensor parallelism needs 2 or more GPUs, found {gpus} "
                "(run --smoke for the CPU check of this script)"
            )
            return 0
        args.tp = args.tp or [t for t in (2, 4, 8) if t <= gpus]
        too_big = [t for t in args.tp if t > gpus or t < 2]
        if too_big:
            parser.error(f"--tp {too_big}: need 2 <= tp <= {gpus} (the visible GPUs)")
        device = torch.device("cuda", 0)
        print(f"# {gpus} x {torch.cuda.get_device_name(0)}  torch {torch.__version__}")
    if args.N % args.sequences:
        parser.error(f"--N {args.N} is not a multiple of --sequences {args.sequences}")
    uneven = [t for t in args.tp if args.V % t]
    if uneven:  # Megatron pads its vocabulary to a multiple of tp
        parser.error(f"--V {args.V} does not split evenly over tp {uneven} (Megatron's layout)")
    print(f"# N={args.N} V={args.V} {args.dtype}; ms: the slowest rank per call, median")
    print(HEADER)
    print("-" * len(HEADER))
    rows = []
    for i, world in enumerate(args.tp):
        args.with_tp1 = args.with_tp1 and i == 0  # tp = 1 once
        rows += run_world(args, world)
    write_run_json(
        args.out,
        "tp",
        "tensor_parallel",
        args.smoke,
        device,
        getattr(torch, args.dtype),
        rows,
        gpus=gpus,
        tp=args.tp,
        N=args.N,
        V=args.V,
        backend=args.backend,
        timing="slowest rank per call: cuda events (perf_counter on CPU) after a barrier",
    )
    if args.smoke:
        print(SMOKE_NOTE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
