"""Non-finite steps in the trainer: what a step checks besides its gradients, and when a run stops.

Each step, the trainer hands ``zero.ZeroEngine.step`` one bool per quantity it computed on this
rank (``StepGuard.flags``: every MoE layer's aux_loss and z_loss of the whole model, in layer order,
then the loss; under pipeline stages a rank passes what it computed and finite values for the rest,
so every rank hands over the same length),
and the engine folds them into the all-reduce of the gradient norm: a step in which any of them,
or the norm, is non-finite on any rank is skipped on every rank (``engine.last_step_skipped``).
``StepGuard.update`` counts consecutive skipped steps and ``StepGuard.check`` raises
``NonFiniteError`` once there are ``train.max_bad_steps`` of them, naming the step and the first
non-finite quantity in the order a step computes them (a layer's aux loss, the loss, the gradient
norm), with the number of ranks on which it was non-finite.
"""

from __future__ import annotations

import torch

import zero


class NonFiniteError(RuntimeError):
    """``train.max_bad_steps`` consecutive optimizer steps were skipped for non-finite values."""


class StepGuard:
    def __init__(self, model: torch.nn.Module, max_bad_steps: int, world: int):
        # ``model``: the whole model, before a pipeline drops the other stages' layers. Only the
        # names are kept: a reference to a layer would keep a dropped stage's weights alive
        name_of = {m: n for n, m in model.named_modules()}
        # one name per entry of flags(), in the same order
        self.names = [
            f"the {q} of MoE layer {name_of[layer]}" for layer in model.moe_layers() for q in ("aux_loss", "z_loss")
        ]
        self.names.append("the loss")
        self.max_bad_steps = max_bad_steps
        self.world = world
        self.streak: list[tuple[int, str]] = []  # (step, first non-finite quantity) of the current run of skipped steps

    def flags(self, loss: torch.Tensor, aux_M: torch.Tensor, z_M: torch.Tensor) -> torch.Tensor:
        """What ``engine.step(extra_finite=...)`` takes: True where a quantity is finite on this rank,
        in ``self.names``' order (each MoE layer's aux loss then its z-loss, then the loss)."""
        aux_z_M2 = torch.stack([aux_M, z_M], dim=1)
        return torch.isfinite(torch.cat([aux_z_M2.reshape(-1).to(loss.device), loss.reshape(1).float()]))

    def first_nonfinite(self, engine: zero.ZeroEngine) -> str:
        for name, ranks in zip(self.names, engine.last_nonfinite):
            if ranks:
                return f"{name} (non-finite on {ranks} of {self.world} ranks)"
        return f"the gradient norm ({engine.last_grad_norm})"

    def update(self, engine: zero.ZeroEngine, step: int) -> bool:
        """After ``engine.step``: whether step ``step`` (counted from 1) was skipped."""
        if not engine.last_step_skipped:
            self.streak = []
            return False
        self.streak.append((step, self.first_nonfinite(engine)))
        return True

    @property
    def stopping(self) -> bool:
        return len(self.streak) >= self.max_bad_steps

    def check(self, lr: float) -> None:
        """Raise ``NonFiniteError`` after ``max_bad_steps`` consecutive skipped steps (the same
        decision on every rank: the engine's is)."""
        if not self.stopping:
            return
        (first, first_what), (last, last_what) = self.streak[0], self.streak[-1]
        since = f"; it began at step {first} with {first_what}" if first != last else ""
        raise NonFiniteError(
            f"training stopped at step {last}: {len(self.streak)} consecutive optimizer steps were skipped because "
            f"of non-finite values (train.max_bad_steps={self.max_bad_steps}); at step {last} the first non-finite "
            f"quantity was {last_what}{since}. The weights are still those after step {first - 1}. A "
            f"diverging run usually needs a lower learning rate (optim.lr={lr:g} at this step)"
        )

    def discard_load(self, model: torch.nn.Module) -> None:
        """A skipped step's routed load must not move the aux-loss-free expert biases either
        (``model``: this rank's, whose layers ran)."""
        for layer in model.moe_layers():
            layer.load_since_update.zero_()
