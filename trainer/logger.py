"""Per-step metrics: `metrics.jsonl` (one object per step), TensorBoard, and `plots.png`."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

# The panels of plots.png: (title, metric keys); a key absent from the run is left out, and a
# panel with no key left is not drawn. reward/<fn> joins the reward panel by itself.
PANELS = (
    ("accuracy", ("accuracy",)),
    ("reward", ("reward_mean",)),
    ("groups with zero reward spread", ("frac_zero_std",)),
    ("entropy", ("entropy",)),
    ("response length (tokens)", ("response_len_mean",)),
    ("truncated share", ("truncated_frac",)),
    ("clip fractions", ("clipfrac", "clip_low", "clip_high", "dual_clipfrac")),
    ("KL to the reference", ("kl",)),
    ("IS weight mean", ("is_weight_mean",)),
    ("train/inference mismatch: KL(sampler || trainer)", ("mismatch_kl_k1", "mismatch_kl_k3")),
    ("train/inference mismatch: chi-square", ("mismatch_chi2_token", "mismatch_chi2_seq")),
    ("IS weights: effective sample size", ("is_ess",)),
    (
        "tokens dropped by a correction",
        ("is_masked", "off_policy_masked", "entropy_masked", "rs_masked"),
    ),
    ("VESPO weight mean", ("vespo_phi_mean",)),
)
# Values the loop fills in when a run has no such term: a metric that never leaves its default
# is not plotted (a flat KL of 0 in a run without KL says nothing).
DEFAULTS = {
    "kl": 0.0,
    "is_weight_mean": 1.0,
    "dual_clipfrac": 0.0,
    "clip_low": 0.0,
    "clip_high": 0.0,
    "truncated_frac": 0.0,
    "is_masked": 0.0,
}
# Divergences (>= 0) whose estimates are float noise around 0 when the sampler and the trainer
# agree (the same weights, the same numerics): within NOISE of 0 on every step they are flat (no
# panel), and an estimate below 0 (k1, chi-square's sample mean) is drawn at 0, never as a
# negative KL or chi-square.
DIVERGENCES = ("kl", "mismatch_kl_k1", "mismatch_kl_k3", "mismatch_chi2_token", "mismatch_chi2_seq")
NOISE = 1e-6
# TensorBoard groups by the tag's prefix; metrics.jsonl keeps the flat names.
TB_GROUPS = {
    "rollout": (
        "reward_mean",
        "reward_std",
        "accuracy",
        "frac_zero_std",
        "response_len_mean",
        "truncated_frac",
        "gen_rounds",
    ),
    "perf": ("step_time", "gen_time", "train_time", "lr"),
}


def tensorboard_tag(name: str) -> str:
    """rollout/..., perf/... or loss/... (everything the update reports)."""
    if name.startswith("reward/"):
        return "rollout/reward_" + name[len("reward/") :]
    for group, names in TB_GROUPS.items():
        if name in names or (group == "perf" and name.endswith("_time")):
            return f"{group}/{name}"
    return f"loss/{name}"


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
                    print(
                        f"fusedrl-train: warning: {self.path} line {number} is torn (a crash "
                        f"mid-write?): dropped"
                    )
                    continue
                if row.get("step", resume_step) <= resume_step:  # (steps count from 1)
                    kept.append(line)
            # A new file moved over the old one: a crash mid-write loses nothing.
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)
        elif resume_step is None:
            self.path.write_text("")
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # pragma: no cover - tensorboard is in the train extra
                print("tensorboard is not installed: TensorBoard logging is off")
            else:
                # purge_step: TensorBoard hides the events of the steps after the checkpoint
                # (resume_step, which metrics.jsonl keeps) written before the resume, so a
                # resumed run shows each step once and none goes missing.
                purge = None if resume_step is None else resume_step + 1
                self.writer = SummaryWriter(
                    log_dir=str(Path(run_dir) / "tensorboard"), purge_step=purge
                )

    def log(self, metrics: dict) -> None:
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in metrics.items()
        }
        from .checkpoint import writing

        with writing(self.path), open(self.path, "a") as handle:
            handle.write(json.dumps(clean) + "\n")
        if self.writer is not None:
            for name, value in metrics.items():
                if name != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(tensorboard_tag(name), value, metrics["step"])

    def log_config(self, config: dict) -> None:
        """The run's options: TensorBoard's hparams (scalars and strings) and a text table."""
        if self.writer is None:
            return
        from torch.utils.tensorboard.summary import hparams

        flat = {
            k: ("none" if v is None else v)
            for k, v in config.items()
            if v is None or isinstance(v, (str, int, float, bool))
        }
        for summary in hparams(flat, {}):
            self.writer.file_writer.add_summary(summary)
        table = "| option | value |\n|---|---|\n" + "".join(
            f"| {k} | {_cell(v)} |\n" for k, v in flat.items()
        )
        self.writer.add_text("config", table, 0)

    def log_samples(self, step: int, samples: list[tuple[str, str, float]]) -> None:
        """A few (prompt, completion, reward) of a step, as a TensorBoard text table."""
        if self.writer is None or not samples:
            return
        table = "| prompt | completion | reward |\n|---|---|---|\n" + "".join(
            f"| {_cell(p)} | {_cell(c)} | {r:.3f} |\n" for p, c, r in samples
        )
        self.writer.add_text("samples", table, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _cell(value) -> str:
    """A markdown table cell: pipes escaped, newlines shown as a symbol."""
    return str(value).replace("|", "\\|").replace("\n", "⏎")


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plotted_panels(rows: list[dict]) -> list[tuple[str, list[str]]]:
    """(title, keys) of the panels a run gets: absent or always-default metrics left out."""

    def present(key: str) -> bool:
        values = [r.get(key) for r in rows if r.get(key) is not None]
        if key in DIVERGENCES:
            return any(abs(v) > NOISE for v in values)
        return bool(values) and any(v != DEFAULTS.get(key, object()) for v in values)

    functions = sorted({k for r in rows for k in r if k.startswith("reward/")})
    panels = []
    for title, keys in PANELS:
        keys = [k for k in keys if present(k)]
        if title == "reward" and len(functions) > 1:  # one function's line is the mean's
            keys += [k for k in functions if present(k)]
        if keys:
            panels.append((title, keys))
    return panels


def drawn_values(rows: list[dict], key: str) -> list[float]:
    """A metric's line: NaN where a step lacks it, a divergence's estimates below 0 at 0."""
    values = [r.get(key) if r.get(key) is not None else float("nan") for r in rows]
    if key in DIVERGENCES:
        values = [max(v, 0.0) for v in values]  # (max(NaN, 0.0) is NaN: a gap stays one)
    return values


def plot(run_dir: str | Path) -> Path | None:
    """Every panel of PANELS the run has, per step, as DIR/plots.png."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is in the train extra
        print("matplotlib is not installed: no plots.png")
        return None
    rows = read_metrics(run_dir)
    panels = plotted_panels(rows)
    if not panels:
        return None
    columns = min(4, len(panels))
    lines = -(-len(panels) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(4 * columns, 3.2 * lines), squeeze=False)
    steps = [r["step"] for r in rows]
    for ax, (title, keys) in zip(axes.flat, panels):
        for key in keys:
            ax.plot(steps, drawn_values(rows, key), marker=".", linewidth=1, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        # Plain numbers on the axes: an offset ("+1e-3" in a corner) hides the scale.
        ax.ticklabel_format(axis="y", useOffset=False, style="plain")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.tight_layout()
    out = Path(run_dir) / "plots.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
