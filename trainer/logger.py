"""Per-step metrics: `metrics.jsonl` (one object per step), TensorBoard, and `plots.png`."""

from __future__ import annotations

import json
import math
from pathlib import Path

PLOTTED = (("reward_mean", "reward"), ("entropy", "entropy"),
           ("response_len_mean", "response length"), ("clipfrac", "clip fraction"))


class MetricsLogger:
    def __init__(self, run_dir: Path, tensorboard: bool, resume_step: int | None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            # A resumed run rewrites history from its checkpoint on: drop steps logged after it,
            # and a line torn by a crash or a full disk mid-write (the checkpoint is intact).
            kept = []
            for number, line in enumerate(self.path.read_text().splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    print(f"fusedrl-train: warning: {self.path} line {number} is torn (a crash "
                          f"mid-write?): dropped")
                    continue
                if row.get("step", resume_step) < resume_step:
                    kept.append(line)
            self.path.write_text("".join(line + "\n" for line in kept))
        elif resume_step is None:
            self.path.write_text("")
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # pragma: no cover - tensorboard is in the train extra
                print("tensorboard is not installed: TensorBoard logging is off")
            else:
                # purge_step: TensorBoard hides the events of steps >= resume_step written before
                # the resume, so a resumed run does not show those steps twice.
                self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"),
                                            purge_step=resume_step)

    def log(self, metrics: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in metrics.items()}
        from .checkpoint import _writing

        with _writing(self.path), open(self.path, "a") as handle:
            handle.write(json.dumps(clean) + "\n")
        if self.writer is not None:
            for name, value in metrics.items():
                if name != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(name, value, metrics["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(run_dir: str | Path) -> Path | None:
    """reward, entropy, response length and clip fraction per step, as DIR/plots.png."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is in the train extra
        print("matplotlib is not installed: no plots.png")
        return None
    rows = read_metrics(run_dir)
    fig, axes = plt.subplots(1, len(PLOTTED), figsize=(4 * len(PLOTTED), 3.2))
    steps = [r["step"] for r in rows]
    for ax, (key, title) in zip(axes, PLOTTED):
        values = [r.get(key) if r.get(key) is not None else float("nan") for r in rows]
        ax.plot(steps, values, marker=".", linewidth=1)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(run_dir) / "plots.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
