"""The fused token-level kernel's launch shape against the memory floor, one run.

    python bench/sweep_fused.py            # GPU: N = 16384, V = 151936, bf16, dapo, in place
    python bench/sweep_fused.py --smoke    # tiny shapes, any device: not a measurement

The first H100 run put `_fused_token_loss_kernel` at 57.8% of its 1R + 1W floor with one
512-thread program per SM (docs/benchmarks.md: ~8 KB of loads in flight per SM where Little's
law wants ~14 KB). This sweep times the kernel, unchanged, under other launch shapes: programs
per SM (the persistent grid; the L2 cap of `persistent_programs` lifted) x warps per program
(the vocab tile follows: 16 bytes a thread), with the register cap that keeps that many programs
resident. No kernel source changes, so the compile cache stays valid; the launcher's choice is
the row `default`. Each row: median ms, % of the 1R + 1W floor at the copy bandwidth measured in
the same run. JSON under bench/results/.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_loss import SMOKE_NOTE, _bench, one_table_setup, write_run_json  # noqa: E402
from bench_sampling import _inputs, make_loss  # noqa: E402  (the DAPO step)

import fusedrl  # noqa: E402

SHAPE = {"N": 16384, "V": 151936}
SMOKE_SHAPE = {"N": 6, "V": 1031}
PROGRAMS_PER_SM = (1, 2, 3, 4)
WARPS = (8, 16)
# Bytes each thread loads per tile: 32 doubles every thread's loads in flight (two 16-byte
# vectors a tile, the prefetched tile's too) at the cost of registers; ncu put the fused kernel
# at 46% of peak DRAM throughput on an H200 with its bytes at the floor (2026-11-28): more
# bytes in flight is the lead. Timed at the shapes that keep enough programs resident.
WIDE_BYTES_PER_THREAD = 32
WIDE_SHAPES = tuple(itertools.product((2, 4), WARPS, (WIDE_BYTES_PER_THREAD,)))
# programs_per_sm = 0: one program per row, not persistent (a grid of N programs, as Liger's
# kernels launch), the hardware scheduler keeping as many resident as the register cap of two
# per SM allows.
ONE_ROW_EACH = 0
ROW_SHAPES = tuple((ONE_ROW_EACH, warps, None) for warps in WARPS)
COPIES = 2
# Every shape is timed in two rounds, the second in reverse order: the first H100 sweep
# (2026-11-26) put the best shape 10% ahead of the default, with a 5% spread between two runs
# of the default a day apart; the rounds show the spread within one run.
ROUNDS = 2


@contextlib.contextmanager
def launch_shape(
    programs_per_sm: int | None, warps: int | None, bytes_per_thread: int | None = None
):
    """The fused kernel launched with `programs_per_sm` programs per SM of `warps` warps, each
    thread loading `bytes_per_thread` a tile (None: the launcher's own choice), by swapping the
    launcher's sizing rules for the call."""
    from fusedrl.kernels import launch, token_loss

    saved = (
        token_loss.persistent_programs,
        launch.MAX_WARPS,
        launch.MIN_CTAS_PER_SM,
        launch.BYTES_PER_THREAD,
    )
    try:
        if programs_per_sm is not None:
            # the register cap: that many resident (one program per row: two, the default's)
            launch.MIN_CTAS_PER_SM = programs_per_sm or saved[2]

            def programs(rows, row_bytes, device, fit_l2=True):
                if device.type != "cuda":
                    return saved[0](rows, row_bytes, device, fit_l2)
                if programs_per_sm == ONE_ROW_EACH:
                    return max(1, rows)
                sms, _ = launch._sms_and_l2(device.index or torch.cuda.current_device())
                return max(1, min(rows, sms * programs_per_sm))

            token_loss.persistent_programs = programs
        if warps is not None:
            launch.MAX_WARPS = warps  # the tile: BYTES_PER_THREAD a thread
        if bytes_per_thread is not None:
            launch.BYTES_PER_THREAD = bytes_per_thread
        yield
    finally:
        (
            token_loss.persistent_programs,
            launch.MAX_WARPS,
            launch.MIN_CTAS_PER_SM,
            launch.BYTES_PER_THREAD,
        ) = saved


def launch_shapes() -> list[tuple[int | None, int | None, int | None]]:
    """(programs per SM, warps, bytes per thread) of every timed shape; (None, None, None): the
    launcher's own choice."""
    plain = [(per_sm, warps, None) for per_sm, warps in itertools.product(PROGRAMS_PER_SM, WARPS)]
    return [(None, None, None), *plain, *WIDE_SHAPES, *ROW_SHAPES]


def main(argv=None) -> int:
    args, device, bandwidth = one_table_setup(__doc__, argv)
    dtype = torch.bfloat16
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    n, v = shape["N"], shape["V"]
    floor_ms = 2 * n * v * dtype.itemsize / (bandwidth * 1e9) * 1e3
    cfg = fusedrl.LossConfig.preset("dapo")
    copies = [_inputs(n, v, dtype, device, seed) for seed in range(COPIES)]
    print(
        f"N={n} V={v} bf16 dapo in place; copy bandwidth {bandwidth:.0f} GB/s, 1R+1W floor "
        f"{floor_ms:.3f} ms" + ("  (smoke run, not a measurement)" * args.smoke)
    )
    print(f"{'round':>5} {'programs/SM':>11} {'warps':>5} {'B/thr':>5} {'ms':>9} {'%floor':>7}")
    rows = []
    shapes = launch_shapes()
    rounds = [(r, shape) for r in range(ROUNDS) for shape in (shapes[::-1] if r else shapes)]
    for round_, (per_sm, warps, width) in rounds:
        where = "default" if per_sm is None else "per row" if per_sm == ONE_ROW_EACH else per_sm
        label = f"{round_:>5} {where:>11} {warps or '-':>5} {width or '-':>5}"
        shape = {"programs_per_sm": per_sm, "warps": warps, "bytes_per_thread": width}
        with launch_shape(per_sm, warps, width):
            steps = itertools.cycle([make_loss(c, cfg, inplace=True) for c in copies])
            try:
                ms = _bench(lambda s=steps: next(s)(), device, args.warmup_ms, args.rep_ms)[0]
            except Exception as err:  # noqa: BLE001 - a shape the compiler refuses is a result
                rows.append({"round": round_, **shape, "error": repr(err)})
                print(f"{label} failed: {err!r}"[:200])
                continue
        pct = 100.0 * floor_ms / ms
        rows.append({"round": round_, **shape, "ms": ms, "pct_of_floor": pct})
        print(f"{label} {ms:>9.3f} {pct:>6.1f}%")
    write_run_json(
        args.out,
        "sweep_fused",
        "fused_token_loss_launch_shape",
        args.smoke,
        device,
        dtype,
        rows,
        copy_bandwidth_gbps=round(bandwidth, 1),
        N=n,
        V=v,
        floor_1r1w_ms=floor_ms,
    )
    if args.smoke:
        print(SMOKE_NOTE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
