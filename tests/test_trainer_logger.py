"""plots.png panels and TensorBoard tags of a run's metrics."""

from __future__ import annotations

import json

import pytest

from fusedrl.trainer.logger import (
    MetricsLogger,
    drawn_values,
    plot,
    plotted_panels,
    read_metrics,
)

matplotlib = pytest.importorskip("matplotlib")


def _rows(steps=6):
    rows = []
    for step in range(steps):
        rows.append(
            {
                "step": step,
                "reward_mean": 0.5 + 0.01 * step,
                "accuracy": 0.3 + 0.05 * step,
                "reward/arith": 0.5 + 0.01 * step,
                "reward/format": 0.1,
                "frac_zero_std": 0.1,
                "entropy": None if step == 2 else 0.5,
                "response_len_mean": 3.0,
                "truncated_frac": 0.0,
                "clipfrac": 0.001 * step,
                "clip_high": 0.002,
                "clip_low": 0.0,
                "kl": 0.0,
                "is_weight_mean": 1.0 + 1e-4 * step,
                "loss": 0.1,
                "step_time": 0.2,
                "lr": 2e-4,
                "mismatch_kl_k1": 1e-3 * step,
                "mismatch_kl_k3": 2e-3,
                "is_masked": 0.0,
                "entropy_masked": 0.8,
            }
        )
    return rows


def test_panels_show_what_the_run_has(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    panels = dict(plotted_panels(read_metrics(tmp_path)))
    assert panels["accuracy"] == ["accuracy"]
    assert panels["reward"] == ["reward_mean", "reward/arith", "reward/format"]
    assert panels["clip fractions"] == ["clipfrac", "clip_high"]  # clip_low stays at its default
    assert "IS weight mean" in panels and "KL to the reference" not in panels
    assert "truncated share" not in panels and "entropy" in panels  # a None is skipped
    mismatch = panels["train/inference mismatch: KL(sampler || trainer)"]
    assert mismatch == ["mismatch_kl_k1", "mismatch_kl_k3"]
    assert not any("vLLM" in title for title in panels)  # (an hf run has no vLLM)
    assert panels["tokens dropped by a correction"] == ["entropy_masked"]  # is_masked: default
    assert (plot(tmp_path) or tmp_path / "missing").stat().st_size > 10_000


def test_divergences_of_float_noise_are_flat_and_never_negative(tmp_path):
    """A sampler that agrees with the trainer up to float noise: its KL and chi-square
    estimates (+-1e-8) get no panel; real ones get theirs, an estimate below 0 drawn at 0."""
    rows = _rows()
    for i, row in enumerate(rows):
        row.update(mismatch_kl_k1=(-1) ** i * 1e-8, mismatch_kl_k3=1e-9, mismatch_chi2_token=-3e-8)
    panels = dict(plotted_panels(rows))
    assert not any(title.startswith("train/inference mismatch") for title in panels), panels
    for i, row in enumerate(rows):
        row.update(mismatch_kl_k1=0.01 * (i - 2), mismatch_chi2_token=0.02 * i)
    panels = dict(plotted_panels(rows))
    assert panels["train/inference mismatch: KL(sampler || trainer)"] == ["mismatch_kl_k1"]
    assert drawn_values(rows, "mismatch_kl_k1")[:4] == [0.0, 0.0, 0.0, 0.01]
    assert drawn_values(rows, "entropy")[2] != drawn_values(rows, "entropy")[2]  # a gap: NaN


def test_no_offset_notation_on_small_ranges(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", lambda fig: figures.append(fig))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    plot(tmp_path)
    (fig,) = figures
    fig.canvas.draw()
    for ax in fig.axes:
        if ax.get_visible():
            assert ax.yaxis.get_major_formatter().get_offset() == "", ax.get_title()


def test_tensorboard_tags_are_grouped(tmp_path):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    logger = MetricsLogger(tmp_path, tensorboard=True, resume_step=None)
    for row in _rows(2):
        logger.log(row)
    logger.close()
    events = accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "rollout/reward_mean",
        "rollout/accuracy",
        "rollout/reward_arith",
        "loss/clipfrac",
        "loss/kl",
        "perf/step_time",
        "perf/lr",
    } <= tags
    assert all(tag.split("/")[0] in ("rollout", "loss", "perf") for tag in tags)
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["reward/arith"]


def test_a_resumed_run_shows_every_step_once(tmp_path):
    """Steps 1-4 logged, the run resumed from its checkpoint at step 2 and steps 3-5 logged
    again: metrics.jsonl and TensorBoard both hold 1-5 once (the checkpoint's step kept)."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    rows = _rows(6)
    logger = MetricsLogger(tmp_path, tensorboard=True, resume_step=None)
    for step in (1, 2, 3, 4):
        logger.log({**rows[step], "step": step})
    logger.close()
    logger = MetricsLogger(tmp_path, tensorboard=True, resume_step=2)
    for step in (3, 4, 5):
        logger.log({**rows[step], "step": step, "reward_mean": 10.0 + step})
    logger.close()
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    events = accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    shown = events.Scalars("rollout/reward_mean")
    assert [event.step for event in shown] == [1, 2, 3, 4, 5]
    assert [event.value for event in shown][2:] == pytest.approx([13.0, 14.0, 15.0])


def test_config_and_samples_as_text(tmp_path):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    logger = MetricsLogger(tmp_path, tensorboard=True, resume_step=None)
    logger.log_config({"preset": "dapo", "lr": None, "group_size": 8, "nested": {"x": 1}})
    logger.log_samples(3, [("1+2=", "3", 1.0), ("a|b", "x\ny", 0.25)])
    logger.close()
    events = accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tensors = set(events.Tags()["tensors"])
    assert {"config/text_summary", "samples/text_summary"} <= tensors
    (sample,) = events.Tensors("samples/text_summary")
    text = sample.tensor_proto.string_val[0].decode()
    assert sample.step == 3 and "| 1+2= | 3 | 1.000 |" in text and "a\\|b" in text
    assert "_hparams_/experiment" in events.summary_metadata  # TensorBoard's HPARAMS tab
