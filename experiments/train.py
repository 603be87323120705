"""Train a mixture-of-experts language model: ``python -m experiments.train [overrides]`` (installed
as ``switchyard-train``). This module is the Hydra entry point only; the trainer is
``experiments.training`` (``train`` is ``experiments.training.loop.train``).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from experiments.training import schema  # noqa: F401  (registers the config schema and the ${div:} resolver)
from experiments.training.loop import train

__all__ = ["main", "train"]


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig

    summary = train(cfg, run_dir=HydraConfig.get().runtime.output_dir)
    return summary["final_val_loss"]  # what a Hydra sweeper (e.g. Optuna) minimises


if __name__ == "__main__":
    main()
