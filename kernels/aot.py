"""Ahead-of-time compile of every Triton launch variant for a GPU target, with no GPU.

The Triton interpreter (how the tests run the kernels on CPU) accepts code that the compiler
rejects, so a kernel can pass every CPU test and fail on its first call on a GPU. This module
compiles each variant the launchers can produce down to a cubin for sm_80 / sm_90 / sm_100 /
sm_120, with the ptxas Triton ships, and reads its registers, local memory (spills) and SASS with
the cuobjdump Triton ships. `tests/test_kernels_compile.py` asserts on the result; kernel
engineers read the table:

    python -m fusedrl.kernels.aot [--arch 80 90 100 120] [--json out.json] [--quick]

(`--quick`: each kernel's base configuration only, the check `make test-install` runs.)

Variants come from the launchers themselves, never from a copied list:
- each launcher (`EXAMPLE_LAUNCHES`) is called once on small CPU tensors with its kernel swapped
  for a recorder, which yields the exact argument list, types and launch options it passes;
- every constexpr of the kernel is then varied: a `<NAME>_CODES` table in the kernel's module
  gives the values of a code (LOSS, KL); BLOCK_V takes what `block_size()` picks on a CUDA device
  for each vocab in `VOCABS` (launch options follow through `launch_options()`); any other is a
  switch, compiled on and off around the base configuration. Code pairs (LOSS x KL) are crossed,
  and so are the switch pairs a module lists in `CROSSED_SWITCHES` (both on).
- the logits/gradient dtype is crossed with the base configuration.

Must run without TRITON_INTERPRET (under the interpreter `@triton.jit` builds no JITFunction).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

# Vocab sizes of the models people train (Llama-2/Mistral, Llama-3, Qwen2.5, Gemma-3): the GPU
# tile sizes are those block_size() picks for them. 32003 is odd: no divisibility specialisation.
VOCABS = (32000, 128256, 151936, 262144, 32003)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Ampere, Hopper, and Blackwell: datacenter (B200/GB200, sm_100) and consumer/workstation (RTX 50,
# RTX PRO 6000, sm_120). The ptxas of every supported Triton (3.6: CUDA 12.8) targets all four.
ARCHS = (80, 90, 100, 120)
# The shape the example launches use: strides and vocab are then those of a real model's logits.
EXAMPLE_VOCAB = 151936
# Constexprs a launcher derives from the device: the example launches run on CPU tensors, so the
# base configuration takes the value a CUDA device gets (the sweep still compiles both).
CUDA_CONSTEXPRS = {"FAST_EXP2": True, "UPCAST_DOT": False}


@dataclasses.dataclass
class Launch:
    """One recorded launch: the kernel object, its bound arguments and launch options."""

    kernel: object
    args: tuple
    kwargs: dict


class _Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` records instead of running."""

    def __init__(self, kernel, sink: list[Launch]):
        self.kernel, self.sink = kernel, sink

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.sink.append(Launch(self.kernel, args, kwargs))


def launch_kernels() -> dict[str, object]:
    """Every launch kernel (a JITFunction named `_*_kernel`) of fusedrl.kernels, by name."""
    from triton.runtime.jit import JITFunction

    import fusedrl.kernels

    found = {}
    for info in pkgutil.iter_modules(fusedrl.kernels.__path__):
        module_name = f"fusedrl.kernels.{info.name}"
        module = importlib.import_module(module_name)
        for name, obj in vars(module).items():
            if name.endswith("_kernel") and obj.__module__ == module_name:
                if not isinstance(obj, JITFunction):
                    raise RuntimeError(
                        f"{module_name}.{name} is {type(obj).__name__}, not a JITFunction: "
                        "unset TRITON_INTERPRET to compile ahead of time"
                    )
                found[name] = obj
    return found


def _example_launches() -> Iterator[Callable[[], None]]:
    """Calls of each public launcher on [2, 3, EXAMPLE_VOCAB] bf16 logits (CPU tensors: nothing
    runs). Per-token inputs are all present; the constexpr sweep switches them off again."""
    from fusedrl.kernels import (
        linear_loss,
        logprobs,
        loss_sums,
        sampling,
        scale,
        sequence_terms,
        split_rows,
        token_args,
        token_loss,
        two_rows,
    )

    batch, time, vocab = 2, 3, EXAMPLE_VOCAB
    logits = torch.zeros(batch, time, vocab, dtype=torch.bfloat16)
    labels = torch.zeros(batch, time, dtype=torch.long)
    valid = torch.ones(batch, time, dtype=torch.bool)
    rows = torch.zeros(batch, time)
    yield lambda: logprobs.logprobs_forward(logits, labels, valid, 1.0)
    yield lambda: logprobs.logits_backward(
        logits, labels, rows, rows, rows, rows, 1.0, torch.empty_like(logits)
    )
    yield lambda: scale.scale_rows_unless_one(logits, torch.ones(()))
    yield lambda: sampling.write_sampled_set(logits, labels, logits, 1.0, 50, 0.9, 0.05, rows)
    every_input = token_args.TokenLossArgs(  # (mask None: the kernels read `valid`)
        labels, valid, rows, token_args.LossVariant(), rows, None, rows, rows, rows, rows, rows
    )
    yield lambda: token_loss.fused_token_loss(logits, torch.empty_like(logits), every_input)
    # The split-row kernel as a GPU launches it: the exchange in one launch (the sweep compiles
    # the two-launch phases and the one-slice form too), and its merge's test harness.
    yield lambda: split_rows.split_row_loss(
        logits, torch.empty_like(logits), every_input, two_launches=False
    )
    yield lambda: split_rows.merge_partials_rows(
        torch.zeros(2, split_rows.MAX_SLICES.value, split_rows.PARTIAL.value), 2
    )
    yield lambda: loss_sums.token_loss_sums(torch.zeros(4, loss_sums.SUM_WIDTH.value))
    yield lambda: loss_sums.aggregation_weights(rows, "seq-mean-token-mean", None, None)
    yield lambda: loss_sums.aggregation_weights(valid, "token-mean", None, None)  # a bool mask
    # The two-pass terms: GSPO's sequence ratio with every per-token input and the bonus, and
    # the token ratio with the clip options and a device entropy coefficient.
    gspo = token_args.LossVariant(kl="k3", beta=0.1, entropy_coef=0.01)
    yield lambda: sequence_terms.sequence_terms(
        rows,
        rows,
        every_input._replace(variant=gspo, mask=valid),
        sequence_ratio=True,
        vocab=vocab,
    )
    clipped = token_args.LossVariant(dual_clip_c=3.0, delta=2.0, low_bound=0.8, high_bound=1.2)
    token_ratio = token_args.TokenLossArgs(
        labels, valid, rows, clipped, rows, rows, rows, entropy_coef_tensor=torch.ones(())
    )
    yield lambda: sequence_terms.sequence_terms(
        rows, rows, token_ratio, sequence_ratio=False, vocab=vocab
    )
    # Two distributions per token (distill_loss): the teacher's logits beside the student's.
    yield lambda: two_rows.two_rows_forward(logits, logits, labels, valid, 1.0, "jsd", 0.5)
    yield lambda: two_rows.two_rows_backward(
        logits,
        logits,
        rows,
        rows,
        rows,
        rows,
        rows,
        1.0,
        "jsd",
        0.5,
        torch.empty_like(logits),
        labels,
        rows,
        rows,
        rows,
    )
    # The LM-head loss: [2, 3, H] hidden states and a [V, H] head (H = 64 keeps the example
    # small; a real H only changes integers that are multiples of 16 just the same).
    hidden = torch.zeros(batch, time, 64, dtype=torch.bfloat16)
    head = torch.zeros(vocab, 64, dtype=torch.bfloat16)
    yield lambda: linear_loss.linear_stats(hidden, head, head[:, 0], labels, valid, 1.0)
    yield lambda: linear_loss.linear_logits_grad(
        hidden,
        head,
        head[:, 0],
        labels,
        rows,
        rows,
        rows,
        rows,
        1.0,
        0,
        torch.empty(batch * time, vocab, dtype=torch.bfloat16),
    )


def record_launches() -> list[Launch]:
    """The launches of every example call, each with its kernel object restored."""
    kernels = launch_kernels()
    modules = {name: sys.modules[k.__module__] for name, k in kernels.items()}
    sink: list[Launch] = []
    for name, kernel in kernels.items():
        setattr(modules[name], name, _Recorder(kernel, sink))
    try:
        for call in _example_launches():
            call()
    finally:
        for name, kernel in kernels.items():
            setattr(modules[name], name, kernel)
    missing = set(kernels) - {launch.kernel.__name__ for launch in sink}
    if missing:
        raise RuntimeError(
            f"kernels {sorted(missing)} are never launched by aot._example_launches(): add a "
            "call of their launcher there so that their variants are compiled"
        )
    return sink


@dataclasses.dataclass(frozen=True)
class Variant:
    kernel: str
    dtype: str
    constexprs: tuple[tuple[str, object], ...]
    options: tuple[tuple[str, int], ...]  # launch options: num_warps, maxnreg
    vocab: int

    @property
    def num_warps(self) -> int:
        return dict(self.options)["num_warps"]

    def describe(self) -> str:
        switches = ",".join(
            f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in self.constexprs
        )
        options = ",".join(f"{k}={v}" for k, v in self.options)
        return f"{self.kernel}[{self.dtype} V={self.vocab} {switches} {options}]"


def constexpr_values(kernel, name: str) -> list[object]:
    """The values the launchers can give constexpr `name` (BLOCK_V follows the vocab)."""
    codes = getattr(sys.modules[kernel.__module__], f"{name}_CODES", None)
    if codes is not None:
        return sorted(set(codes.values()))
    return [False, True]


def variants(launch: Launch) -> list[Variant]:
    """The base configuration at every vocab (bf16) and every dtype (the example vocab); at the
    example vocab in bf16, every constexpr on its own and every pair of codes crossed."""
    kernel = launch.kernel
    module = sys.modules[kernel.__module__]
    if "BLOCK_V" not in {p.name for p in kernel.params}:
        # A kernel that reads no rows (the loss's sums and weights: fp32, no vocab): its launch
        # as recorded, and each of its codes' values on its own.
        base = {p.name: launch.kwargs[p.name] for p in kernel.params if p.is_constexpr}
        configs = [base] + [
            {**base, name: value}
            for name in base
            if getattr(module, f"{name}_CODES", None) is not None
            for value in constexpr_values(kernel, name)
        ]
        options = (("num_warps", launch.kwargs["num_warps"]),)
        found = [
            Variant(kernel.__name__, "fp32", tuple(c.items()), options, EXAMPLE_VOCAB)
            for c in configs
        ]
        return list(dict.fromkeys(found))
    # Constexprs that follow the dtype (a module's `DTYPE_CONSTEXPRS`: name -> function of the
    # torch dtype; the LM-head kernels' tiles and fp32 products) take each dtype's GPU value, as
    # the launcher gives it, and are not swept.
    follows_dtype = getattr(module, "DTYPE_CONSTEXPRS", {})
    names = [
        p.name
        for p in kernel.params
        if p.is_constexpr and p.name != "BLOCK_V" and p.name not in follows_dtype
    ]
    base = {n: CUDA_CONSTEXPRS.get(n, launch.kwargs[n]) for n in names}
    choices = {n: constexpr_values(kernel, n) for n in names}
    configs = [(base, vocab, "bf16") for vocab in VOCABS]
    configs += [(base, EXAMPLE_VOCAB, dtype) for dtype in DTYPES]
    for name, values in choices.items():
        configs += [({**base, name: v}, EXAMPLE_VOCAB, "bf16") for v in values]
    for pair in getattr(module, "CROSSED_SWITCHES", ()):
        if set(pair) <= set(names):  # (a module's pairs name the switches its kernels have)
            configs.append(({**base, **{n: True for n in pair}}, EXAMPLE_VOCAB, "bf16"))
    codes = [n for n in names if getattr(module, f"{n}_CODES", None) is not None]
    for a, b in itertools.combinations(codes, 2):
        configs += [
            ({**base, a: va, b: vb}, EXAMPLE_VOCAB, "bf16")
            for va in choices[a]
            for vb in choices[b]
        ]
    out = []
    for config, vocab, dtype in configs:
        elem_bytes = DTYPES[dtype].itemsize
        block = module.block_size(vocab, torch.device("cuda"), elem_bytes)
        by_dtype = tuple((n, rule(DTYPES[dtype])) for n, rule in follows_dtype.items())
        constexprs = tuple(config.items()) + by_dtype + (("BLOCK_V", block),)
        options = tuple(module.launch_options(block, elem_bytes).items())
        out.append(Variant(kernel.__name__, dtype, constexprs, options, vocab))
    return list(dict.fromkeys(out))


def _bound(launch: Launch, variant: Variant) -> tuple[tuple, dict]:
    """The launch's arguments with the variant's dtype, vocab and constexprs substituted."""
    dtype = DTYPES[variant.dtype]

    def resize(arg):
        # The compiler sees a tensor's dtype and pointer alignment only: a small one will do.
        if isinstance(arg, torch.Tensor) and arg.dtype == torch.bfloat16:
            return torch.zeros(16, dtype=dtype)
        return arg

    args = tuple(resize(a) for a in launch.args)
    # Integers equal to the example's vocab or row strides follow the new vocab.
    args = tuple(
        a // EXAMPLE_VOCAB * variant.vocab
        if isinstance(a, int) and not isinstance(a, bool) and a and a % EXAMPLE_VOCAB == 0
        else a
        for a in args
    )
    kwargs = {**launch.kwargs, **dict(variant.constexprs), **dict(variant.options)}
    return args, kwargs


def compile_variant(launch: Launch, variant: Variant, arch: int):
    """triton.compile of one variant for sm_<arch>, through the kernel's own argument binder (the
    signature, divisibility attributes and constexprs a real launch would produce)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    args, kwargs = _bound(launch, variant)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound_args, specialization, options
    )
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=target, options=options.__dict__)


def _cuobjdump() -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(path) if path.exists() else "cuobjdump"


def cubin_report(cubin: bytes) -> dict:
    """Registers, local memory (spills) and the SASS instruction mix of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run(
            [_cuobjdump(), "--dump-resource-usage", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        sass = subprocess.run(
            [_cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    opcodes = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)

    def count(prefix: str) -> dict[str, int]:
        return dict(Counter(op for op in opcodes if op.startswith(prefix)))

    return {
        "registers": int(fields.get("REG", -1)),
        "local_bytes": int(fields.get("LOCAL", 0)),
        "stack_bytes": int(fields.get("STACK", 0)),
        "sass_instructions": len(opcodes),
        "global_loads": count("LDG"),
        "global_stores": count("STG"),
        "sass": sass,
    }


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def sass_instructions(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of every instruction of a cuobjdump -sass listing."""
    return [(int(a, 16), op, rest.strip()) for a, _, op, rest in _SASS_LINE.findall(sass)]


def sass_loops(sass: str) -> list[dict]:
    """The innermost loops of a kernel (a backward branch and the code it jumps back over), each
    with its instruction count, opcode mix and the widths of its global loads and stores.

    Counted statically: a loop body's instructions run once per trip in every warp; a branch
    inside the body (a remainder mask, say) is counted whole."""
    code = sass_instructions(sass)
    spans = []
    for addr, op, rest in code:
        if op.startswith("BRA") and (m := re.match(r"(?:\S+,\s*)?`?\(?(0x[0-9a-f]+)", rest)):
            target = int(m.group(1), 16)
            if target < addr:  # (a branch to itself is the trap after EXIT)
                spans.append((target, addr))
    innermost = [
        s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)
    ]
    loops = []
    for start, end in sorted(innermost):
        body = [op for addr, op, _ in code if start <= addr <= end]
        loops.append(
            {
                "start": start,
                "instructions": len(body),
                "mufu": sum(op.startswith("MUFU") for op in body),
                "barriers": sum(op.startswith("BAR") for op in body),
                "loads": dict(Counter(op for op in body if op.startswith("LDG"))),
                "stores": dict(Counter(op for op in body if op.startswith("STG"))),
                # shared memory: the CUDA one-read kernel's sweep 2 reads the row from there
                "shared_loads": dict(Counter(op for op in body if op.startswith("LDS"))),
            }
        )
    return loops


_REGISTER = re.compile(r"\b(U?R)(\d+)(\.64)?\b")
# Opcodes that write a register pair: IMAD.WIDE, IADD.64, IMNMX.S64, ...
_WIDE_DEST = re.compile(r"\.WIDE\b|\.[SU]?64\b")
_BRANCH_TARGET = re.compile(r"(?:\S+,\s*)?`?\(?(0x[0-9a-f]+)")


def _registers(text: str) -> set[tuple[str, int]]:
    """Registers named in an operand list, general (R) and uniform (UR): R6.64 names R6, R7."""
    regs = set()
    for kind, number, pair in _REGISTER.findall(text):
        regs.add((kind, int(number)))
        if pair:
            regs.add((kind, int(number) + 1))
    return regs


def label_gather(sass: str) -> int | None:
    """Index (in `_SASS_LINE` order) of the load of the label's logit: the first global load
    whose address derives from the 64-bit labels load, by forward register data flow in program
    order (a register written from untainted sources is clean again). None if there is none."""
    code = _SASS_LINE.findall(sass)
    tainted: set[tuple[str, int]] = set()
    for i, (_, _, op, rest) in enumerate(code):
        operands = rest.split(",")
        if op.startswith("LDG") and tainted:
            address = rest[rest.rfind("[") :]  # not the cache-policy desc[URx]
            if _registers(address) & tainted:
                return i
        if op.startswith("LDG") and ".64" in op and not tainted:
            # the labels (int64, a register pair): the gather's index
            tainted = {(kind, n + d) for kind, n in _registers(operands[0]) for d in (0, 1)}
            continue
        # Stores and branches write no register; compares (xSETP) and R2P write predicates only.
        if not tainted or op.startswith(("ST", "BRA", "BAR", "EXIT", "R2P")) or "SETP" in op:
            continue
        # The destination is the first register operand: some opcodes name predicates first
        # (sm_120's `IMNMX.S64 PT, PT, R2, RZ, R24, ...`).
        first = next((i for i, o in enumerate(operands) if _registers(o)), None)
        if first is None:
            continue
        dest = _registers(operands[first])
        if _WIDE_DEST.search(op):
            dest |= {(kind, number + 1) for kind, number in dest}
        if _registers(",".join(operands[first + 1 :])) & tainted:
            tainted |= dest
        else:
            tainted -= dest
    return None


def stores_before_barrier(sass: str, start: int) -> list[int]:
    """Addresses of the global stores that some path from instruction `start` reaches without
    passing a barrier (BAR.SYNC), walking the control flow (fall-through, branch targets)."""
    code = _SASS_LINE.findall(sass)
    index = {int(addr, 16): i for i, (addr, _, _, _) in enumerate(code)}
    seen, pending, hits = set(), [start + 1], []
    while pending:
        i = pending.pop()
        if i in seen or i >= len(code):
            continue
        seen.add(i)
        addr, predicate, op, rest = code[i]
        if op.startswith("BAR.SYNC") and not predicate:
            continue
        if op.startswith(("STG", "ST.")):
            hits.append(int(addr, 16))
        if op.startswith("BRA") and (m := _BRANCH_TARGET.match(rest.strip())):
            pending.append(index.get(int(m.group(1), 16), len(code)))
            if not predicate:
                continue
        if op in ("EXIT", "RET") and not predicate:
            continue
        pending.append(i + 1)
    return sorted(hits)


def label_store_order(sass: str) -> dict:
    """The in-place hazard check of a row kernel: when the gradient overwrites the logits, the
    label's logit must be read by every thread before any thread stores into the row, i.e. no
    path from the label's load reaches a global store without a barrier in between."""
    gather = label_gather(sass)
    if gather is None:
        return {"label_load": None, "stores_before_barrier": []}
    address = int(_SASS_LINE.findall(sass)[gather][0], 16)
    return {"label_load": address, "stores_before_barrier": stores_before_barrier(sass, gather)}


# Issue budget of the main loops, in warp-instructions per row element (loop body / elements per
# thread per trip / 32). The floor of the fused loss moves 4 bytes per bf16 element (1R + 1W); at
# an H100's ~3 TB/s that is 0.75e12 elements/s, against 132 SMs x 4 schedulers x ~1.75 GHz =
# ~0.92e12 warp-instructions/s: 1.2 per element would keep the schedulers as busy as the memory.
# Half of that (0.6 for both sweeps) leaves them idle half the time, so memory stays the bound.
# tests/test_kernels_compile.py (Triton) and tests/test_cuda_build.py (csrc/) hold the kernels
# to it.
SWEEP_BUDGET = {"stats": 0.30, "grad": 0.32, "grad_unaligned_out": 0.30}
FUSED_BUDGET = 0.60
# The log-prob kernel's stats sweep with SUM_PI_SQUARED keeps one more running sum: one FFMA per
# element, 1/32 warp-instruction. That sweep alone reads 2 bytes per bf16 element (1R): 1.5e12
# elements/s against the same ~0.92e12 warp-instructions/s, so 0.61 would keep the schedulers as
# busy as the memory; 0.34 leaves them idle 44 % of the time.
SQUARES_STATS_BUDGET = 0.34
# A soft cap (SOFTCAP: the row read as tanh(a x), `rows.capped`) costs every element one exp2,
# one reciprocal and ~5 FP instructions more in each sweep: Triton 3.6 / 3.9 on sm_90 issue
# 0.47-0.50 (stats) and 0.48-0.56 (grad) against the plain 0.26 / 0.20; both sweeps of the fused
# kernel up to 1.0, 1.09 with the entropy bonus or per-token temperatures (Triton 3.6, sm_120:
# its grad loop 0.60): under the 1.2 at which the schedulers are as busy as the memory.
# Its 3 MUFU per element and sweep are the tighter bound: an H100's 16 MUFU/clk/SM (~3.7e12/s)
# against the 6 per element of both sweeps caps the fused loss near 0.62e12 elements/s, ~80 % of
# its 1R + 1W floor (the GPU issue measures it). Exact tanh, not tanh.approx (2^-11 relative).
# (sm_80, whose SASS is not held to the budgets, issues 0.56 in the stats sweep.) With
# SUM_PI_SQUARED the stats sweep may add what the squares add without the cap.
SOFTCAP_BUDGET = {"stats": 0.52, "grad": 0.62, "grad_unaligned_out": 0.62}
SOFTCAP_FUSED_BUDGET = 1.10
SOFTCAP_MUFU_PER_ELEMENT = 3


def loop_role(loop: dict) -> str:
    """What a row-sweep loop does, from its memory instructions: `stats` (reads the row),
    `grad` (reads it and writes the gradient, both 128-bit), `grad_unaligned_out` (the gradient
    does not share the logits' alignment: the tiles follow the gradient's, whose stores stay
    128-bit, and the loads are 16-bit), `zeros`, or `remainder` (masked tiles)."""
    wide_load = any(op.endswith(".128") for op in {**loop["loads"], **loop.get("shared_loads", {})})
    wide_stores = bool(loop["stores"]) and all(op.endswith(".128") for op in loop["stores"])
    if wide_load and not loop["stores"]:
        return "stats"
    if wide_load and wide_stores:
        return "grad"
    if wide_load or (wide_stores and loop["loads"]):
        return "grad_unaligned_out"
    if not loop["loads"] and wide_stores:
        return "zeros"
    return "remainder"


def with_costs(loops: list[dict], elements_per_thread: int, elem_bytes: int) -> list[dict]:
    """Each loop with its role and its cost per row element. A trip of a main loop moves 16 bytes
    per thread per 128-bit load (ptxas may unroll several tiles into one trip), so it covers
    16 x loads / elem_bytes elements in every thread; a remainder trip covers one tile
    (elements_per_thread). Thread-instructions per element = body / elements per trip, and
    warp-instructions per element (what the SM's schedulers issue) = that / 32."""
    out = []
    for loop in loops:
        loads = {**loop["loads"], **loop.get("shared_loads", {})}
        wide = sum(n for op, n in loads.items() if op.endswith(".128"))
        wide = wide or sum(n for op, n in loop["stores"].items() if op.endswith(".128"))
        role = loop_role(loop)
        per_trip = 16 * wide // elem_bytes if role != "remainder" else elements_per_thread
        out.append(
            {
                **loop,
                "role": role,
                "elements_per_thread_per_trip": per_trip,
                "warp_instructions_per_element": loop["instructions"] / per_trip / 32,
                "mufu_per_element": loop["mufu"] / per_trip,
            }
        )
    return out


def _family(kernel, warps: int) -> dict:
    """A kernel module's `KERNEL_FAMILY` ("row_sweep" unless it says otherwise: the LM-head
    kernels are "gemm", whose loops the row sweeps' SASS budgets do not describe) and its
    register budget (its own `max_registers`, else the row sweeps')."""
    from fusedrl.kernels import launch

    module = sys.modules[kernel.__module__]
    budget = getattr(module, "max_registers", launch.max_registers)(warps)
    return {"family": getattr(module, "KERNEL_FAMILY", "row_sweep"), "register_budget": budget}


def base_variant(launch: Launch) -> Variant:
    """The launch's base configuration: bf16 at the example vocab, every constexpr as a CUDA
    device gets it (the first such entry of `variants`)."""
    candidates = variants(launch)
    return next(
        (v for v in candidates if v.dtype == "bf16" and v.vocab == EXAMPLE_VOCAB), candidates[0]
    )


def compile_all(
    archs=ARCHS,
    keep_sass: Callable[[Variant, int], bool] = lambda v, a: False,
    quick: bool = False,
):
    """Compile every variant of every launch kernel (`quick`: its base configuration only);
    yields one result dict per (variant, arch). A variant that fails to compile yields its error
    instead of raising."""
    import triton

    for launch in record_launches():
        for variant in [base_variant(launch)] if quick else variants(launch):
            for arch in archs:
                result = {
                    "kernel": variant.kernel,
                    "variant": variant.describe(),
                    "dtype": variant.dtype,
                    "vocab": variant.vocab,
                    "constexprs": {k: v for k, v in variant.constexprs},
                    **dict(variant.options),
                    "arch": f"sm_{arch}",
                    "triton": triton.__version__,
                    **_family(launch.kernel, variant.num_warps),
                }
                try:
                    compiled = compile_variant(launch, variant, arch)
                except Exception as exc:  # noqa: BLE001 - reported per variant, asserted by tests
                    text = f"{type(exc).__name__}: {exc}".strip()
                    # A CompilationError is "at L:C:" and the source; its cause says what failed.
                    root = exc
                    while root.__cause__ is not None:  # nested jit calls nest the errors
                        root = root.__cause__
                    # ... and the innermost one's last line is what the compiler objected to.
                    cause = str(root).strip().splitlines()[-1] if root is not exc else ""
                    result["error"] = f"{text.splitlines()[0]} {cause}"[:600]
                    result["error_full"] = text[-8000:]
                    yield result
                    continue
                report = cubin_report(compiled.asm["cubin"])
                block = dict(variant.constexprs).get("BLOCK_V")
                if block:
                    per_thread = max(1, block // (32 * variant.num_warps))
                    elem_bytes = DTYPES[variant.dtype].itemsize
                    loops = sass_loops(report["sass"])
                    report["loops"] = with_costs(loops, per_thread, elem_bytes)
                if result["family"] in ("row_sweep", "split_row"):
                    report["label_store_order"] = label_store_order(report["sass"])
                if not keep_sass(variant, arch):
                    report.pop("sass")
                result.update(report)
                result["shared_bytes"] = int(getattr(compiled.metadata, "shared", 0))
                yield result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=list(ARCHS))
    parser.add_argument("--json", type=Path, help="write every result here")
    parser.add_argument(
        "--sass-vocab",
        type=int,
        default=EXAMPLE_VOCAB,
        help="keep the SASS of the base bf16 variants at this vocab (in the JSON)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the base configuration of each kernel only (bf16, example vocab): an install check",
    )
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the interpreter compiles nothing")

    def keep(variant: Variant, arch: int) -> bool:
        return variant.dtype == "bf16" and variant.vocab == args.sass_vocab

    results = []
    failures = 0
    print(f"{'kernel variant':<110} {'arch':>5} {'regs':>4} {'local':>5}  loads/stores")
    for r in compile_all(tuple(args.arch), keep, quick=args.quick):
        results.append(r)
        if "error" in r:
            failures += 1
            print(f"{r['variant']:<110} {r['arch']:>5} FAILED {r['error'].splitlines()[0][:200]}")
            continue
        io = " ".join(f"{k}x{n}" for k, n in {**r["global_loads"], **r["global_stores"]}.items())
        print(f"{r['variant']:<110} {r['arch']:>5} {r['registers']:>4} {r['local_bytes']:>5}  {io}")
    print(f"{len(results) - failures} compiled, {failures} failed")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
