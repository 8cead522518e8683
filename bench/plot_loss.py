"""Plot bench_loss.py results: ms vs N per impl, one panel per (preset, V), the floor dashed.

python bench/plot_loss.py bench/results/policy_loss_fwd_bwd-*.json --out docs/bench_loss.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(args.results[-1].read_text())  # the newest run when several match
    rows = [r for r in data["rows"] if r.get("ms") is not None]
    if not rows:
        print("no measured rows to plot")
        return 1
    bandwidth = data["copy_bandwidth_gbps"] * 1e9
    presets = sorted({r["preset"] or "-" for r in rows})
    vocabs = sorted({r["V"] for r in rows})
    fig, axes = plt.subplots(
        len(presets), len(vocabs), figsize=(4.2 * len(vocabs), 3.4 * len(presets)), squeeze=False
    )
    for ax, (preset, vocab) in zip(axes.flat, [(p, v) for p in presets for v in vocabs]):
        sel = [r for r in rows if (r["preset"] or "-") == preset and r["V"] == vocab]
        if not sel:
            ax.set_visible(False)
            continue
        for impl in sorted({r["impl"] for r in sel}):
            pts = sorted((r["N"], r["ms"]) for r in sel if r["impl"] == impl)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        floor = sorted({(r["N"], r["bytes_floor"] / bandwidth * 1e3) for r in sel})
        ax.plot([f[0] for f in floor], [f[1] for f in floor], "k--", label="memory floor")
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="N (tokens)",
            ylabel="ms",
            title=f"{sel[0]['op']} {preset} V={vocab}",
        )
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(
        f"{data['device']} - copy bandwidth {data['copy_bandwidth_gbps']:.0f} GB/s", fontsize=9
    )
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
