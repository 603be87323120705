"""Checkpoints in the trainer (``train.checkpoint.*``, ``train.resume``, preemption). The storage
format and its guarantees are ``zero.checkpoint``'s; ``experiments.checkpoint`` is the command that
consolidates and exports what the trainer saves.

``TrainCheckpoints`` is what the training loop calls: ``resume()`` before the loop,
``stop_flag()`` into each optimizer step and ``stop_requested()`` after it (SIGTERM or SIGUSR1 on
any rank, agreed by all through the step's gradient-norm all-reduce), ``due()`` /
``save()``, ``close()``, and for a preempted run ``hand_over()`` last (submitit's requeue).
"""

from __future__ import annotations

from pathlib import Path

import zero
from experiments.training.preemption import Preemption
from zero import checkpoint as zc


def is_checkpoint(path: Path) -> bool:
    """True if ``path`` is one checkpoint (rather than a directory of them)."""
    return any((path / n).exists() for n in (zc.META, zc.MANIFEST, ".metadata"))


class TrainCheckpoints:
    """The trainer's checkpointing, from ``cfg.train.checkpoint`` and ``cfg.train.resume`` (checked
    by ``checks.check_config`` before any collective). On several ranks a gloo group is created for
    DCP (an async save runs its collectives in a background thread); the per-step preemption flag
    rides in the optimizer step's all-reduce."""

    def __init__(self, cfg, engine: zero.ZeroEngine, layout: zero.Layout, run_dir: Path | None):
        c = cfg.train.checkpoint
        self.dir = Path(c.dir) if c.dir else (run_dir / "checkpoints" if run_dir is not None else None)
        self.resume_from = str(cfg.train.resume)
        self.every = int(c.every) if self.dir is not None else 0
        self.layout = layout
        self.rank0 = layout.rank == 0
        multi = layout.world > 1
        self.ckpt = zc.Checkpointer(
            engine,
            self.dir if self.dir is not None else ".",
            keep_last=int(c.keep_last),
            async_save=bool(c.async_save),
            group=zc.new_group() if multi else None,
        )
        self.preemption = Preemption()
        self.last_saved_step: int | None = None

    def resume(self) -> dict | None:
        """Load the checkpoint ``train.resume`` asks for into the engine (weights, optimizer, buffers,
        RNG); returns the trainer state saved with it (``step``, ``logged_losses``, ...) or None
        for a fresh start."""
        if self.resume_from == "none":
            return None
        if self.resume_from == "auto":
            if self.dir is None:
                return None
            path, check = self.ckpt.latest(), False  # latest() verified it
        else:
            given = Path(self.resume_from)
            path, check = (given, True) if is_checkpoint(given) else (self.ckpt.latest(root=given), False)
            if path is None:
                raise ValueError(f"train.resume={self.resume_from!r} holds no complete checkpoint")
        if path is None:
            return None
        meta = self.ckpt.load(path, check=check)
        self.last_saved_step = int(meta["step"])
        if self.rank0:
            w = meta["layout"]
            print(
                f"resumed from {path} at step {meta['step']} (saved by world={w['world']} pp={w['pp']} dp={w['dp']} "
                f"ep={w['ep']} ZeRO-{w['stage']})",
                flush=True,
            )
        return dict(meta["extra"], step=int(meta["step"]))

    def due(self, done: int, last: bool) -> bool:
        """A periodic save (or the final one) after step ``done``."""
        return self.every > 0 and (done % self.every == 0 or last) and done != self.last_saved_step

    def stop_flag(self):
        """This rank's preemption flag, for ``engine.step(extra_sums=...)``."""
        return self.preemption.flag()

    def stop_requested(self, ranks_flagged: float) -> bool:
        """Whether any rank has had a preemption signal, from ``stop_flag()`` summed over every rank
        by the step just taken."""
        return self.preemption.requested(ranks_flagged)

    def save(self, done: int, state: dict, config_yaml: str) -> Path | None:
        """Save after step ``done`` with the trainer's ``state`` (JSON) and the resolved config."""
        if self.every == 0 or done == self.last_saved_step:  # every=0 (or no dir): never, preempted or not
            return None
        path = self.ckpt.save(done, extra=state, files={"config.yaml": config_yaml})
        self.last_saved_step = done
        return path

    def close(self) -> None:
        try:
            self.ckpt.close()
        finally:
            self.preemption.close()

    def hand_over(self) -> None:
        """After a preempted run's save, close() and summary: to the signal's previous handler
        (``Preemption.hand_over``); it may exit the process."""
        self.preemption.hand_over()
