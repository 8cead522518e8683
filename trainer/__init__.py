"""The thin GRPO-family trainer, installed as `fusedrl.trainer` (CLI `fusedrl-train`).

    from fusedrl.trainer import TrainConfig, train
    train(TrainConfig(preset="dapo", max_steps=20, out="runs/demo"))

The loop and the exact algorithm it runs are documented in `fusedrl.trainer.loop`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import TrainConfig, parse_config


def __getattr__(name: str):
    # TrainConfig and parse_config load on first use, so that `fusedrl-train` (fusedrl.trainer.cli)
    # can say which extra to install when the trainer's dependencies (pyyaml, ...) are missing.
    if name in ("TrainConfig", "parse_config"):
        import fusedrl.trainer.config as config

        return getattr(config, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def train(cfg: TrainConfig):
    """Run a training job (imports vLLM and transformers on first use)."""
    from .loop import train as _train

    return _train(cfg)


__all__ = ["TrainConfig", "parse_config", "train"]
