"""The launch policy of the row kernels: vocab tile sizes, warps, the register cap, and how many
programs a persistent kernel runs. One home for what every row-sweep launcher decides the same
way (logprobs, token_loss, scale, sampling, two_rows import it from here).
"""

from __future__ import annotations

import functools

import torch

# Vocab tiles. On a GPU a tile is one 16-byte vector per thread of a 16-warp program (4096 bf16
# or 2048 fp32 elements): sweep 1 keeps two fp32 running sums per element slot in registers and
# prefetches the next tile, so a wider tile costs registers, not speed (the loop has no barrier to
# amortise). Under the interpreter every tile is a numpy array; tests lower the CPU cap to force
# many tiles and a partial last one.
BYTES_PER_THREAD = 16
MAX_WARPS = 16
MAX_BLOCK_V_INTERPRETED = 2048


def next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 in plain Python: Triton 3.6's is a constexpr function, whose call
    from host code unwraps its arguments (microseconds a launch, at a host-bound micro-batch)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def block_size(vocab: int, device: torch.device, elem_bytes: int = 2) -> int:
    if device.type == "cuda":
        cap = MAX_WARPS * 32 * BYTES_PER_THREAD // elem_bytes
    else:
        cap = MAX_BLOCK_V_INTERPRETED
    return min(next_power_of_2(vocab), cap)


def num_warps(block: int, elem_bytes: int = 2) -> int:
    return max(4, min(MAX_WARPS, block * elem_bytes // (32 * BYTES_PER_THREAD)))


def fast_exp2(device: torch.device) -> bool:
    """ex2.approx.ftz through inline PTX: compiled kernels only (the interpreter runs no PTX)."""
    return device.type == "cuda"


# Registers per SM on sm_80 and sm_90 (and the most one thread may hold).
REGISTERS_PER_SM = 65536
MAX_REGISTERS_PER_THREAD = 255
MIN_CTAS_PER_SM = 2


def max_registers(warps: int) -> int:
    """The register cap (ptxas .maxnreg) that keeps MIN_CTAS_PER_SM programs resident per SM:
    while one row's program waits on a block reduction, the other's loads keep HBM busy. Without
    it ptxas gives some variants (odd V on sm_90: 72) more than 64 registers at 16 warps, which
    halves the rows in flight. tests/test_kernels_compile.py checks that no variant spills."""
    return min(MAX_REGISTERS_PER_THREAD, REGISTERS_PER_SM // (MIN_CTAS_PER_SM * 32 * warps))


# Programs of a persistent kernel under the interpreter: a few, so that tests run the row loop.
INTERPRETED_PROGRAMS = 3


@functools.cache
def _sms_and_l2(device_index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(device_index)
    return props.multi_processor_count, props.L2_cache_size


def persistent_programs(
    rows: int, row_bytes: int, device: torch.device, fit_l2: bool = True
) -> int:
    """Programs of a two-sweep kernel: as many rows in flight as L2 holds, one per SM at least;
    `fit_l2=False`: MIN_CTAS_PER_SM per SM whatever L2 holds.

    Sweep 2 re-reads the row that sweep 1 just streamed, back to front, with its own loads and
    the gradient stores marked evict-first: a line is still in L2 when sweep 2 comes back for it
    if every row in flight fits there, i.e. programs x row_bytes <= L2. On an H100 (50 MB, 132
    SMs) bf16 rows of V = 151936 (297 KB) get one program per SM (39 MB), V = 32000 two (17 MB).
    Fewer than one per SM would leave SMs idle, so V = 262144 (512 KB rows, 67 MB) overflows L2
    and re-reads part of each row from HBM (docs/benchmarks.md has the traffic model).

    The fused token-level kernel takes `fit_l2=False`: at V = 151936 bf16 two 16-warp programs
    per SM beat the one that L2 allows on both GPUs measured (bench/sweep_fused.py: H100 5.80 ->
    5.41 ms, H200 4.79 -> 4.06 ms; bench/results/*sweep_fused*): the second row's loads in flight
    are worth more than the sweep-2 re-reads they push out of L2.
    """
    if device.type != "cuda":
        return max(1, min(rows, INTERPRETED_PROGRAMS))
    # A tensor's device always has an index; a bare torch.device("cuda") means the current one.
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms, l2_bytes = _sms_and_l2(index)
    per_sm = MIN_CTAS_PER_SM
    if fit_l2:
        per_sm = max(1, min(per_sm, l2_bytes // max(1, row_bytes * sms)))
    return max(1, min(rows, sms * per_sm))


def launch_options(block: int, elem_bytes: int = 2) -> dict[str, int]:
    """num_warps and maxnreg of a row kernel with vocab tile `block` of elem_bytes elements."""
    warps = num_warps(block, elem_bytes)
    return {"num_warps": warps, "maxnreg": max_registers(warps)}
