"""Kernel benchmark: fusedrl against its peers and against the memory-bandwidth floor.

    python bench/bench_loss.py                         # the full matrix (GPU)
    python bench/bench_loss.py --matrix small          # N=16384, V=151936, dapo grpo gspo
    python bench/bench_loss.py --N 16384 --V 151936 --presets dapo
    python bench/bench_loss.py --smoke                 # tiny shapes, any device: not a measurement

Ops: `token_logprobs_fwd` (no grad: what old / reference log-probs cost) and
`policy_loss_fwd_bwd` (loss + d loss / d logits). Impls: fusedrl-triton, fusedrl-cuda (the csrc/
extension; each with an -inplace variant that writes the gradient into the logits),
fusedrl-torch, torch-eager (what TRL does: fp32 log_softmax + gather + loss math + autograd),
torch-compile (torch.compile of fusedrl.reference), liger (liger_kernel's logits-level
triton_grpo_loss with its loss type matched to the preset; it writes its gradient in place).
An impl this machine cannot run (no CUDA device, liger_kernel not installed) is skipped with the
reason printed and recorded in the JSON (`skipped`).

Every number of one run is measured in that run: the device-to-device copy bandwidth (a large
`copy_`, bytes read + written) sets the floor; each case is timed over inputs rotated so that L2
does not serve a repeated call (median, p20, p80); peak memory is the allocator's high-water mark
above the inputs. Out-of-place impls are timed with `triton.testing.do_bench`. In-place impls
(fusedrl-*-inplace, liger) destroy the logits they are given, so they get their own CUDA-event
loop: per call, the buffer is rewritten from a pristine copy and L2 is flushed, then a start event,
the step, an end event; only the step lies between the events. Every buffer is restored before the
next impl runs, so no impl is timed on gradient values. Each rotated buffer has its own old /
reference log-probs, computed from it. A table is printed and one JSON file per op is written to
bench/results/<op>-<gpu>-<date>.json, rewritten after every case (a run cut short keeps what it
measured; `"complete": false` until the end). `--smoke` results say `"smoke": true`: they check
that the script runs, they measure nothing. `--cuda-graph` (GPU): each step is captured once per
rotated buffer in a CUDA graph and its replays are timed, so that a host-bound shape shows the
GPU's own time beside the eager one (an impl that cannot be captured records its error).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

import fusedrl
from fusedrl import LossConfig, reference

RESULTS = Path(__file__).resolve().parent / "results"
SMOKE_RESULTS = RESULTS / "smoke"  # git-ignored: what a smoke run writes measures nothing
OPS = ("token_logprobs_fwd", "policy_loss_fwd_bwd")
IMPLS = (
    "fusedrl-triton",
    "fusedrl-triton-inplace",
    # the split-row kernel (kernels/split_rows.py: FUSEDRL_SPLIT_ROWS=on), beside the default
    "fusedrl-triton-split",
    "fusedrl-triton-split-inplace",
    "fusedrl-cuda",
    "fusedrl-cuda-inplace",
    "fusedrl-torch",
    "torch-eager",
    "torch-compile",
    "liger",
)
# Impls that write their gradient into the logits buffer they are given (liger: inplace=True).
INPLACE_IMPLS = (
    "fusedrl-triton-inplace",
    "fusedrl-triton-split-inplace",
    "fusedrl-cuda-inplace",
    "liger",
)
MATRICES = {
    "full": dict(N=[4096, 16384, 65536], V=[32000, 128256, 151936]),
    "small": dict(N=[16384], V=[151936]),
}
SMOKE_NOTE = "smoke run, not a measurement"
# Presets of the benchmark beyond LossConfig's: the exact KL to the reference over the whole
# vocabulary (kl="full": the reference's logits read beside the policy's, floor 2R + 1W), and
# DAPO on raw logits of a soft-capped head (Gemma 2/3's cap of 30: the kernels apply c tanh(x / c)
# as they read, floor 1R + 1W, Triton's and the CUDA extension's; eager caps an fp32 copy first;
# Liger has no cap).
# Gradient accumulation over 4 micro-batches (every impl backpropagates loss / 4): fusedrl
# declares the factor (`grad_scale=`, "accum4": the gradient written at it) or not
# ("accum4_rescaled": backward rescales the whole gradient, a second 1R + 1W).
BENCH_PRESETS = {
    "full_kl": dict(preset="dapo", kl="full", beta=0.04),
    "softcap": dict(preset="dapo", softcap=30.0),
    "accum4": dict(preset="dapo", upstream=0.25, declared=True),
    "accum4_rescaled": dict(preset="dapo", upstream=0.25, declared=False),
}
CASE_KEYS = ("softcap", "upstream", "declared")  # what a case takes beside its LossConfig


def bench_config(preset: str) -> LossConfig:
    extra = dict(BENCH_PRESETS.get(preset, {"preset": preset}))
    for key in CASE_KEYS:
        extra.pop(key, None)
    return LossConfig.preset(extra.pop("preset"), **extra)


def bench_softcap(preset: str) -> float | None:
    return BENCH_PRESETS.get(preset, {}).get("softcap")


def bench_upstream(preset: str) -> tuple[float, bool]:
    """(the factor every impl multiplies its loss by, whether fusedrl declares it)."""
    extra = BENCH_PRESETS.get(preset, {})
    return extra.get("upstream", 1.0), extra.get("declared", False)


# ------------------------------------------------------------------------------ timing
def _quantiles(times: list[float]) -> tuple[float, float, float]:
    q = torch.tensor(times).quantile(torch.tensor([0.5, 0.2, 0.8])).tolist()
    return q[0], q[1], q[2]


def _bench(fn, device: torch.device, warmup_ms: int, rep_ms: int) -> tuple[float, float, float]:
    """(median, p20, p80) in ms of an out-of-place step."""
    if device.type == "cuda":
        import triton.testing

        p50, p20, p80 = triton.testing.do_bench(
            fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8]
        )
        return p50, p20, p80
    return _bench_restoring(fn, lambda: None, device, warmup_ms, rep_ms)


def _bench_restoring(
    fn, restore, device: torch.device, warmup_ms: int, rep_ms: int
) -> tuple[float, float, float]:
    """(median, p20, p80) in ms of `fn`, with `restore()` run before every call, untimed.

    For in-place impls, which overwrite the logits they are given: `restore` rewrites the buffer
    the next call takes from its pristine copy. `do_bench` cannot leave a per-call copy out of the
    timed region, so this loop does what it does (iteration count from a 5-call estimate, L2
    flushed by a 256 MB memset before each call, a CUDA event pair around each call) with the
    restore queued before the flush: only `fn` lies between the two events.
    """
    if device.type != "cuda":
        # On a CPU (a smoke run, or torch's CPU code), timed calls for rep_ms, at least one: an
        # interpreted Triton call (~1 s) is timed once, not three times, in a smoke run.
        times = []
        restore()
        fn()
        deadline = time.perf_counter() + rep_ms / 1e3
        while not times or (time.perf_counter() < deadline and len(times) < 50):
            restore()
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return _quantiles(times)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)

    def timed_call():
        restore()
        flush.zero_()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        return start, end

    def elapsed(events):
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in events]

    restore()
    fn()  # compile / autotune
    estimate = max(sorted(elapsed([timed_call() for _ in range(5)]))[2], 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        restore()
        fn()
    return _quantiles(elapsed([timed_call() for _ in range(max(1, int(rep_ms / estimate)))]))


def copy_bandwidth_gbps(device: torch.device, gib: float) -> float:
    """Device-to-device copy: bytes read + written per second, the practical memory floor."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms, _, _ = _bench(lambda: dst.copy_(src), device, 50, 300)
    return 2 * n * 2 / (ms * 1e-3) / 1e9


# ------------------------------------------------------------------------------ inputs
class Inputs(NamedTuple):
    """What one step gets: a logits buffer and the old / reference log-probs made from it."""

    logits: torch.Tensor
    old: torch.Tensor
    ref: torch.Tensor
    ref_logits: torch.Tensor | None = None  # the reference's [B, T, V] logits (kl="full")


class Case:
    """Inputs of one (N, V, preset) case.

    `copies` logits buffers rotate between calls, so that L2 cannot serve a repeated call. Each
    buffer has its own old / reference log-probs, computed from that buffer (so every call sees
    ratios near 1, whichever buffer it gets). With `pristine=True` each buffer also keeps an
    untouched copy: in-place impls overwrite the buffer they are given with the gradient, and
    `restore_next` / `restore_all` rewrite it from that copy, outside the timed region.
    """

    def __init__(self, n, vocab, preset, dtype, device, copies, sequences, pristine=False):
        gen = torch.Generator(device=device).manual_seed(0)
        self.cfg = bench_config(preset)
        self.softcap = bench_softcap(preset)
        self.upstream, self.declared = bench_upstream(preset)
        self.batch = sequences
        self.time = n // sequences
        shape = (self.batch, self.time, vocab)
        # Liger wants [B, T+1, V] (it drops the last position): give every impl a view of one.
        self.buffers = [
            torch.randn(
                (self.batch, self.time + 1, vocab), generator=gen, device=device, dtype=dtype
            )
            for _ in range(copies)
        ]
        self.pristine = [buf.clone() for buf in self.buffers] if pristine else None
        self.labels = torch.randint(0, vocab, shape[:2], generator=gen, device=device)
        self.mask = torch.rand(shape[:2], generator=gen, device=device) > 0.1
        self.advantages = torch.randn(self.batch, generator=gen, device=device)
        self.old, self.ref = [], []
        # kl="full": a reference near each buffer (the KL small, as between a policy and its
        # reference), one per copy so that L2 cannot serve it either
        self.ref_logits = (
            [
                (buf[:, :-1] + 0.5 * torch.randn(shape, generator=gen, device=device, dtype=dtype))
                for buf in self.buffers
            ]
            if self.cfg.full_kl
            else None
        )
        for buf in self.buffers:
            with torch.no_grad():
                logp, _ = fusedrl.token_logprobs(buf[:, :-1], self.labels, softcap=self.softcap)
            self.old.append(logp + 0.1 * torch.randn(shape[:2], generator=gen, device=device))
            self.ref.append(logp + 0.1 * torch.randn(shape[:2], generator=gen, device=device))
        self._next = 0
        self.dirty = False  # an in-place impl has written into the buffers

    def take(self, with_extra_position=False) -> Inputs:
        """The next rotated buffer (a [B, T, V] view, or all of [B, T+1, V]) and its log-probs."""
        i = self._next % len(self.buffers)
        self._next += 1
        buf = self.buffers[i]
        ref_logits = None if self.ref_logits is None else self.ref_logits[i]
        return Inputs(
            buf if with_extra_position else buf[:, :-1], self.old[i], self.ref[i], ref_logits
        )

    def peek(self) -> Inputs:
        """What the next `take` returns (a [B, T, V] view), without taking it."""
        i = self._next % len(self.buffers)
        ref_logits = None if self.ref_logits is None else self.ref_logits[i]
        return Inputs(self.buffers[i][:, :-1], self.old[i], self.ref[i], ref_logits)

    def restore_next(self) -> None:
        """Rewrite the buffer that the next `take` returns from its pristine copy."""
        i = self._next % len(self.buffers)
        self.buffers[i].copy_(self.pristine[i])

    def restore_all(self) -> None:
        if self.pristine is not None:
            for buf, clean in zip(self.buffers, self.pristine):
                buf.copy_(clean)
        self.dirty = False

    @property
    def bytes_of_logits(self):
        return self.batch * self.time * self.buffers[0].shape[-1] * self.buffers[0].element_size()


def trl_style_loss(logits, case: Case, old, ref, ref_logits=None):
    """What TRL's GRPOTrainer does per step: fp32 log-softmax + gather, loss math, autograd."""
    cfg = case.cfg
    if case.softcap is not None:  # Gemma 2's forward: c tanh(x / c), here on an fp32 copy
        logits = case.softcap * torch.tanh(logits.float() / case.softcap)
    logp = torch.log_softmax(logits.float() / cfg.temperature, dim=-1)
    logp = logp.gather(-1, case.labels[..., None]).squeeze(-1)
    mask = case.mask.float()
    log_ratio = logp - old
    if cfg.ratio_level == "sequence":
        seq = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = logp - logp.detach() + seq.detach()
    ratio = torch.exp(log_ratio)
    adv = case.advantages[:, None]
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - cfg.eps_low, 1 + cfg.eps_high) * adv)
    if cfg.full_kl:  # KL(pi || pi_ref) over the vocabulary: both log-softmaxes in fp32
        log_pi = torch.log_softmax(logits.float() / cfg.temperature, dim=-1)
        log_ref = torch.log_softmax(ref_logits.float() / cfg.temperature, dim=-1)
        per_token = per_token + cfg.beta * (log_pi.exp() * (log_pi - log_ref)).sum(-1)
    elif cfg.beta > 0:
        d = ref - logp
        per_token = per_token + cfg.beta * (torch.exp(d) - d - 1)
    if cfg.agg == "token-mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def _liger_fn():
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    def run(case: Case, inp: Inputs):
        cfg = case.cfg
        loss_type = "dapo" if cfg.agg == "token-mean" else "grpo"
        out = triton_grpo_loss(
            inp.logits,  # [B, T+1, V], a leaf; its gradient is written into it (inplace=True)
            inp.old,
            inp.ref if cfg.beta > 0 else None,
            case.labels,
            case.advantages,
            case.mask,
            temperature=cfg.temperature,
            beta=cfg.beta,
            eps_low=cfg.eps_low,
            eps_high=cfg.eps_high,
            inplace=True,
            loss_type=loss_type,
            importance_sampling_level=cfg.ratio_level,
            reduce=True,
        )
        return out[0] if isinstance(out, tuple) else out

    return run


def _leaf(inp: Inputs) -> Inputs:
    return inp._replace(logits=inp.logits.detach().requires_grad_(True))


def _split_rows(on: bool) -> None:
    """The fused Triton loss by the split-row kernel (`on`) or the two-sweep one, for the next
    step; a split step whose kernel declined its grid (not co-resident: it would have timed the
    two-sweep kernel under the split one's name) raises instead."""
    from fusedrl.kernels import split_rows

    split_rows.POLICY = "always" if on else "off"
    if on and split_rows._NOT_CO_RESIDENT:
        raise RuntimeError(f"the split-row kernel declined: {split_rows._NOT_CO_RESIDENT}")


def make_step(op: str, impl: str, case: Case):
    """A zero-argument callable running one step of `impl` on the next rotated input."""
    cfg = case.cfg

    def loss_kwargs(inp: Inputs):
        cap = {} if case.softcap is None else {"softcap": case.softcap}
        if case.declared and impl.startswith("fusedrl"):
            cap["grad_scale"] = case.upstream
        if cfg.full_kl:
            return dict(old_logp=inp.old, ref_logits=inp.ref_logits, config=cfg, **cap)
        ref = inp.ref if cfg.beta > 0 else None
        return dict(old_logp=inp.old, ref_logp=ref, config=cfg, **cap)

    if op == "token_logprobs_fwd":
        if impl in INPLACE_IMPLS:
            return None  # no gradient, nothing to write in place (liger has no logprobs op)
        if "split" in impl.split("-"):
            return None  # the split-row kernel is the fused loss's: no row of its own here
        if impl.startswith("fusedrl"):
            backend = impl.split("-")[1]

            def step():
                with torch.no_grad():
                    fusedrl.token_logprobs(case.take().logits, case.labels, backend=backend)
        elif impl == "torch-eager":

            def step():
                with torch.no_grad():
                    lp = torch.log_softmax(case.take().logits.float(), -1)
                    lp.gather(-1, case.labels[..., None])
        elif impl == "torch-compile":
            fn = torch.compile(reference.token_logprobs)

            def step():
                with torch.no_grad():
                    fn(case.take().logits, case.labels)
        else:
            return None
        return step

    if impl.startswith("fusedrl"):
        backend = impl.split("-")[1]  # triton | cuda | torch
        inplace = impl.endswith("inplace")
        split = "split" in impl.split("-")

        def step():
            if backend == "triton":
                _split_rows(split)
            inp = _leaf(case.take())
            out = fusedrl.policy_loss(
                inp.logits,
                case.labels,
                case.advantages,
                case.mask,
                backend=backend,
                inplace=inplace,
                **loss_kwargs(inp),
            )
            return out.loss, torch.autograd.grad(out.loss * case.upstream, inp.logits)[0]
    elif impl == "torch-eager":

        def step():
            inp = _leaf(case.take())
            loss = trl_style_loss(inp.logits, case, inp.old, inp.ref, inp.ref_logits)
            return loss, torch.autograd.grad(loss * case.upstream, inp.logits)[0]
    elif impl == "torch-compile":
        fn = torch.compile(reference.policy_loss)

        def step():
            inp = _leaf(case.take())
            out = fn(inp.logits, case.labels, case.advantages, case.mask, **loss_kwargs(inp))
            return out.loss, torch.autograd.grad(out.loss * case.upstream, inp.logits)[0]
    elif impl == "liger":
        if cfg.full_kl or case.softcap is not None:
            return None  # Liger's GRPO loss has no exact KL over the vocabulary, no soft cap
        run = _liger_fn()

        def step():
            inp = _leaf(case.take(with_extra_position=True))
            loss = run(case, inp)
            grad = torch.autograd.grad(loss * case.upstream, inp.logits)[0]
            return loss, grad[:, :-1]  # (the extra position Liger drops: no gradient)
    else:
        raise ValueError(impl)
    return step


# Before a preset's cases are timed, each impl's loss and gradient are checked against
# fusedrl.reference in fp32 on the same inputs: a small case of the same preset, vocabulary and
# dtype (the oracle's fp32 copies of a timed case would not fit beside it).
VERIFY_TOKENS = 256
LOSS_RTOL, GRAD_TOL = 2e-3, 2e-2  # loss relative; gradient: max |diff| / max |oracle's|


def verify_impls(
    impls, device, dtype, vocab: int, preset: str, sequences: int, tokens: int | None = None
) -> dict:
    """impl -> "ok", or what differs from the oracle's loss / gradient, on a small case of
    `tokens` (VERIFY_TOKENS unless given)."""
    tokens = VERIFY_TOKENS if tokens is None else tokens
    case = Case(
        tokens,
        vocab,
        preset,
        dtype,
        device,
        1,
        min(sequences, tokens),
        pristine=any(i in INPLACE_IMPLS for i in impls),
    )
    cfg, found = case.cfg, {}
    for impl in impls:
        step = make_step("policy_loss_fwd_bwd", impl, case)
        if step is None:
            continue
        if case.pristine is not None:
            case.restore_all()
        inp = case.peek()
        logits = inp.logits.detach().float().requires_grad_(True)
        extra = {"ref_logits": inp.ref_logits.float()} if cfg.full_kl else {}
        want = reference.policy_loss(
            logits,
            case.labels,
            case.advantages,
            case.mask,
            old_logp=inp.old,
            ref_logp=inp.ref if cfg.beta > 0 and not cfg.full_kl else None,
            config=cfg,
            softcap=case.softcap,
            **extra,
        )
        (want_grad,) = torch.autograd.grad(want.loss * case.upstream, logits)
        loss, grad = step()
        loss, want_loss = float(loss.detach()), float(want.loss.detach())
        loss_gap = abs(loss - want_loss)
        grad_gap = float((grad.float() - want_grad).abs().max())
        scale = float(want_grad.abs().max())
        if loss_gap > LOSS_RTOL * abs(want_loss) + 1e-5:
            found[impl] = f"loss {loss:.6g} vs the oracle's {want_loss:.6g}"
        elif grad_gap > GRAD_TOL * scale + 1e-9:
            found[impl] = f"gradient off by {grad_gap:.3g} (the oracle's largest {scale:.3g})"
        else:
            found[impl] = "ok"
    if case.pristine is not None:
        case.restore_all()
    return found


def floor_bytes(op: str, case: Case) -> int:
    logits = case.bytes_of_logits
    if op == "token_logprobs_fwd":
        return logits  # one read
    if case.cfg.is_sequence_level or case.cfg.full_kl:
        return 3 * logits  # read (pass 1), read + write (pass 2); or both logits read, 1 W
    return 2 * logits  # one read, one write of the gradient


def peak_memory_above_inputs(step, device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@functools.cache
def _cuda_extension_error() -> str | None:
    """Build (or load) the CUDA extension now, outside every timed region, once per process."""
    try:
        from fusedrl.kernels import cuda as cuda_ext

        cuda_ext.load()
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:300]}"
    return None


def skip_reason(impl: str, device: torch.device, smoke: bool) -> str | None:
    """Why this machine cannot run `impl` (None: it can). Printed once and kept in the JSON."""
    cpu = device.type != "cuda"
    if impl.startswith("fusedrl-cuda"):
        if cpu:
            return "needs a CUDA device (backend='cuda' is the csrc/ extension)"
        error = _cuda_extension_error()
        if error is not None:
            return f"the CUDA extension did not load: {error}"
    if impl.startswith("fusedrl-triton") and cpu and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton on CPU tensors needs TRITON_INTERPRET=1 (set before triton is imported)"
    if impl == "liger":
        if importlib.util.find_spec("liger_kernel") is None:
            return (
                "liger_kernel is not installed (pip install liger-kernel==0.8.5, or carry its "
                "wheel in .whl/: see bench/run_gpu.sh)"
            )
        if cpu:
            return "liger is timed on CUDA tensors only"
    if impl == "torch-compile" and cpu and smoke:
        return "inductor would spend minutes compiling a CPU smoke run"
    return None


# ------------------------------------------------------------------------------ main
def _git_commit() -> str:
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, text=True
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument(
        "--matrix",
        default="full",
        choices=sorted(MATRICES),
        help="full: N in {4096, 16384, 65536} x V in {32000, 128256, 151936}; "
        "small: N=16384, V=151936 (--N / --V override either)",
    )
    parser.add_argument("--N", nargs="+", type=int, default=None)
    parser.add_argument("--V", nargs="+", type=int, default=None)
    parser.add_argument("--presets", nargs="+", default=["dapo", "grpo", "gspo"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--sequences", type=int, default=16, help="B; T = N / B")
    parser.add_argument("--copy-gib", type=float, default=4.0)
    parser.add_argument("--warmup-ms", type=int, default=100)
    parser.add_argument("--rep-ms", type=int, default=500)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="time CUDA-graph replays of each step: the GPU's time without the host's launches",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes on any device: checks the script runs, measures nothing",
    )
    args = parser.parse_args(argv)
    args.out = results_dir(args.out, args.smoke)
    args.N = args.N or MATRICES[args.matrix]["N"]
    args.V = args.V or MATRICES[args.matrix]["V"]

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.cuda_graph and device.type != "cuda":
        parser.error("--cuda-graph needs a CUDA device (graphs capture GPU launches)")
    if args.smoke:
        args.N, args.V, args.sequences = [16], [263], 4
        args.copy_gib, args.warmup_ms, args.rep_ms = 0.01, 1, 20
        args.tag = args.tag or "smoke"
        if device.type == "cpu":
            os.environ.setdefault("TRITON_INTERPRET", "1")
    skipped = {}
    for impl in args.impls:
        reason = skip_reason(impl, device, args.smoke)
        if reason is not None:
            skipped[impl] = reason
    impls = [impl for impl in args.impls if impl not in skipped]
    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth_gbps(device, args.copy_gib)
    meta = {
        "device": _device_name(device),
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "liger_kernel": package_version("liger-kernel"),
        "commit": _git_commit(),
        "timestamp": datetime.datetime.now().isoformat(timespec="seconds"),
        "copy_bandwidth_gbps": round(bandwidth, 1),
        "smoke": args.smoke,
        "complete": False,
        "skipped": skipped,
    }
    print(
        f"# {meta['device']}  torch {meta['torch']}  triton {meta['triton']}  "
        f"copy bandwidth {bandwidth:.0f} GB/s"
    )
    for impl, reason in skipped.items():
        print(f"# skipped {impl}: {reason}")
    if args.smoke:
        print(f"# {SMOKE_NOTE}")
    header = (
        f"{'op':<20} {'impl':<23} {'preset':<6} {'N':>6} {'V':>7} {'ms':>9} {'p20':>8} "
        f"{'p80':>8} {'GB/s':>7} {'%floor':>7} {'peak MiB':>9}"
    )
    print(header)
    print("-" * len(header))

    rows_by_op: dict[str, list] = {op: [] for op in args.ops}
    meta["verified"] = {}
    for n in args.N:
        for vocab in args.V:
            for preset in args.presets:
                key = f"{preset} V={vocab}"
                if "policy_loss_fwd_bwd" in args.ops and key not in meta["verified"]:
                    # never more tokens than the smallest case timed (a smoke run's 16)
                    meta["verified"][key] = checks = verify_impls(
                        impls,
                        device,
                        dtype,
                        vocab,
                        preset,
                        args.sequences,
                        min(VERIFY_TOKENS, *args.N),
                    )
                    for impl, verdict in checks.items():
                        if verdict != "ok":
                            print(f"# MISMATCH {impl} {key}: {verdict}")
                rows = _run_case(args, impls, device, dtype, n, vocab, preset, bandwidth)
                for row in rows:
                    row["verified"] = meta["verified"].get(key, {}).get(row["impl"])
                    rows_by_op[row["op"]].append(row)
                _write(args, meta, rows_by_op, quiet=True)  # a run cut short keeps its rows
    meta["complete"] = True
    _write(args, meta, rows_by_op)
    if args.smoke:
        print(SMOKE_NOTE)
    return 0


def _write(args, meta: dict, rows_by_op: dict[str, list], quiet: bool = False) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    for op, rows in rows_by_op.items():
        name = f"{op}-{_slug(meta['device'])}-{date}{'-' + args.tag if args.tag else ''}.json"
        path = args.out / name
        path.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
        if not quiet:
            print(f"wrote {path}")


def results_dir(out, smoke: bool) -> Path:
    """Where a run writes: a smoke run aimed at the tracked bench/results/ writes under
    bench/results/smoke/ (git-ignored) instead."""
    out = Path(out)
    return SMOKE_RESULTS if smoke and out.resolve() == RESULTS.resolve() else out


# The versions every one-table JSON records: the compiler, and each peer a benchmark may run.
PEER_DISTRIBUTIONS = {
    "triton": "triton",
    "liger_kernel": "liger-kernel",
    "trl": "trl",
    "transformers": "transformers",
}


def write_run_json(
    out_dir, stem: str, benchmark: str, smoke: bool, device, dtype, rows, started=None, **extra
):
    """The JSON of a one-table benchmark (bench_linear.py, bench_sampling.py): what ran where, then
    its rows, as `<stem>-smoke.json` or `<stem>-<date>-<time>.json` under `out_dir` (`started`, a
    `time.strftime('%Y%m%d-%H%M%S')` stamp, names the file of a run rewritten as it goes)."""
    result = {
        "benchmark": benchmark,
        "smoke": smoke,
        "note": SMOKE_NOTE if smoke else "",
        "device": _device_name(device),
        "dtype": str(dtype),
        **extra,
        # the stack and the peers, from package metadata (null where not installed)
        "torch": torch.__version__,
        **{name: package_version(dist) for name, dist in PEER_DISTRIBUTIONS.items()},
        "commit": _git_commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "rows": rows,
    }
    out = results_dir(out_dir, smoke)
    out.mkdir(parents=True, exist_ok=True)
    stamp = started or time.strftime("%Y%m%d-%H%M%S")
    name = f"{stem}-smoke.json" if smoke else f"{stem}-{stamp}.json"
    (out / name).write_text(json.dumps(result, indent=1))
    print(f"wrote {out / name}")


def one_table_setup(doc: str, argv, add_arguments=None):
    """(args, device, copy bandwidth GB/s) of a one-table benchmark (bench_sampling.py,
    bench_distill.py, sweep_fused.py): --smoke (tiny shapes, any device, not a measurement),
    --out, --warmup-ms, --rep-ms, and the script's own arguments."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: not a measurement")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--warmup-ms", type=int, default=100)
    parser.add_argument("--rep-ms", type=int, default=400)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.warmup_ms, args.rep_ms = 1, 5
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return args, device, copy_bandwidth_gbps(device, 0.01 if args.smoke else 2.0)


def package_version(distribution: str) -> str | None:
    """An installed distribution's version from its metadata (liger_kernel has no
    `__version__`), or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _make_case(args, impls, device, dtype, n, vocab, preset) -> Case:
    """The inputs, with pristine copies when an in-place impl runs (two rotated buffers when both
    they and room for a gradient fit in half the free memory)."""
    logits_bytes = n * vocab * torch.finfo(dtype).bits // 8
    pristine = "policy_loss_fwd_bwd" in args.ops and any(i in INPLACE_IMPLS for i in impls)
    copies = 1
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info()
        per_copy = (2 if pristine else 1) * logits_bytes
        per_copy += logits_bytes if bench_config(preset).full_kl else 0  # the reference's
        copies = 2 if 2 * per_copy + 2 * logits_bytes < free * 0.5 else 1
    try:
        return Case(n, vocab, preset, dtype, device, copies, min(args.sequences, n), pristine)
    except torch.cuda.OutOfMemoryError:
        if not pristine:
            raise
    torch.cuda.empty_cache()
    return Case(n, vocab, preset, dtype, device, 1, min(args.sequences, n), pristine=False)


def _run_case(args, impls, device, dtype, n, vocab, preset, bandwidth) -> list[dict]:
    rows = []
    try:
        case = _make_case(args, impls, device, dtype, n, vocab, preset)
    except torch.cuda.OutOfMemoryError:
        print(f"{'-':<20} inputs do not fit: N={n} V={vocab}")
        return rows
    for op in args.ops:
        if op == "token_logprobs_fwd" and preset != args.presets[0]:
            continue  # no-grad logprobs do not depend on the loss preset
        for impl in impls:
            inplace = impl in INPLACE_IMPLS and op == "policy_loss_fwd_bwd"
            row = {
                "op": op,
                "impl": impl,
                "preset": preset if op != "token_logprobs_fwd" else None,
                "N": n,
                "V": vocab,
                "dtype": str(dtype).replace("torch.", ""),
                "bytes_floor": floor_bytes(op, case),
            }
            try:
                step = make_step(op, impl, case)
                if step is None:
                    continue
                if inplace and case.pristine is None:
                    raise RuntimeError("no memory for the pristine copy an in-place run needs")
                if case.dirty:
                    case.restore_all()  # no impl runs on the gradient an in-place one left
                if inplace:
                    case.dirty = True
                    case.restore_next()
                peak = peak_memory_above_inputs(step, device)
                restore = case.restore_next
                if args.cuda_graph:
                    step, restore = graphed(step, case), case.restore_all
                if inplace:
                    ms, p20, p80 = _bench_restoring(
                        step, restore, device, args.warmup_ms, args.rep_ms
                    )
                else:
                    ms, p20, p80 = _bench(step, device, args.warmup_ms, args.rep_ms)
                floor_ms = row["bytes_floor"] / (bandwidth * 1e9) * 1e3
                row.update(
                    ms=ms,
                    ms_p20=p20,
                    ms_p80=p80,
                    gbps=row["bytes_floor"] / (ms * 1e-3) / 1e9,
                    pct_of_floor=100.0 * floor_ms / ms,
                    peak_mem_bytes=peak,
                    timing=_timing(device, inplace) + ", CUDA-graph replays" * args.cuda_graph,
                )
            except torch.cuda.OutOfMemoryError:
                row.update(ms=None, error="out of memory")
            except Exception as exc:  # a peer that lacks a feature: record, keep going
                row.update(ms=None, error=f"{type(exc).__name__}: {str(exc)[:200]}")
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            _print_row(row)
    del case
    return rows


def graphed(step, case: Case):
    """`step` captured in one CUDA graph per rotated buffer; each call replays the next. The
    replay launches the captured kernels with no Python, dispatcher or autograd in between: the
    GPU's time of the step. (An in-place impl's buffers are then restored whole: a graph always
    writes the buffer it captured.)"""
    copies = len(case.buffers)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compilation, lazy allocations (capture forbids)
        for _ in range(copies):
            step()
    torch.cuda.current_stream().wait_stream(side)
    captured = []
    for _ in range(copies):  # the i-th graph takes the i-th buffer, as the replays cycle
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = step()
        captured.append((graph, outputs))
    replays = itertools.cycle(captured)

    def replay():
        graph, outputs = next(replays)
        graph.replay()
        return outputs  # the captured step's (loss, gradient), rewritten by this replay

    return replay


def _timing(device: torch.device, inplace: bool) -> str:
    if device.type != "cuda":
        return "perf_counter" + (", restored before each call (untimed)" if inplace else "")
    if inplace:
        return "cuda events per call, restored from a pristine copy before each call (untimed)"
    return "triton.testing.do_bench"


def _print_row(row: dict) -> None:
    if row.get("ms") is None:
        print(
            f"{row['op']:<20} {row['impl']:<23} {str(row['preset'] or '-'):<6} {row['N']:>6} "
            f"{row['V']:>7}  {row.get('error', '')}"
        )
        return
    peak = row["peak_mem_bytes"]
    peak_s = f"{peak / 2**20:9.0f}" if peak is not None else f"{'-':>9}"
    print(
        f"{row['op']:<20} {row['impl']:<23} {str(row['preset'] or '-'):<6} {row['N']:>6} "
        f"{row['V']:>7} {row['ms']:9.3f} {row['ms_p20']:8.3f} {row['ms_p80']:8.3f} "
        f"{row['gbps']:7.0f} {row['pct_of_floor']:6.1f}% {peak_s}"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
