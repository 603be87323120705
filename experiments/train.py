"""Train a mixture-of-experts language model: ``python -m experiments.train [overrides]`` (installed
as ``switchyard-train``). This module is the Hydra entry point only; the trainer is
``experiments.training`` (``train`` is ``experiments.training.loop.train``).
"""

from __future__ import annotations

import atexit

import hydra
from omegaconf import DictConfig

from experiments.training import schema  # noqa: F401  (registers the config schema and the ${div:} resolver)
from experiments.training.loop import train

__all__ = ["main", "train"]


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig

    summary = train(cfg, run_dir=HydraConfig.get().runtime.output_dir)
    release_process_group_at_exit()
    return summary["final_val_loss"]  # what a Hydra sweeper (e.g. Optuna) minimises


_release_registered = False


def release_process_group_at_exit() -> None:
    """After a run that finished: destroy the process group when the process exits, while the
    interpreter is still whole (an ``atexit`` handler). A process that exits holding a gloo group
    can abort in the interpreter's finalization, SIGABRT ("terminate called without an active
    exception") after a run that succeeded: gloo's worker threads still hold finished work whose
    tensors then need the GIL. At exit rather than now, so that Hydra's multirun jobs in one
    process keep the one group (a group joined again in the same process would meet the old one's
    keys in the rendezvous store); and only after a finished run, since after an error a peer may
    be gone and the exit must not wait for it."""
    global _release_registered
    if _release_registered:
        return
    _release_registered = True

    def release():
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    atexit.register(release)


if __name__ == "__main__":
    main()
