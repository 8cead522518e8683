"""The thin GRPO-family trainer, installed as `fusedrl.trainer` (CLI `fusedrl-train`).

    from fusedrl.trainer import TrainConfig, train
    train(TrainConfig(preset="dapo", max_steps=20, out="runs/demo"))

The loop and the exact algorithm it runs are documented in `fusedrl.trainer.loop`.
"""

from .config import TrainConfig, parse_config


def train(cfg: TrainConfig):
    """Run a training job (imports vLLM and transformers on first use)."""
    from .loop import train as _train

    return _train(cfg)


__all__ = ["TrainConfig", "parse_config", "train"]
