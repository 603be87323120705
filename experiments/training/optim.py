"""The optimizer of ``optim.*``: the factory the ZeRO engine builds it with over its shards, and the
learning-rate schedule. ``optimizer_factory`` is where ``optim.*`` is checked.
"""

from __future__ import annotations

import math

import torch

import routing_kernels

_OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
_IMPLS = ("auto", "fused", "foreach", "switchyard")


def optimizer_factory(ocfg):
    """``groups -> torch.optim.Optimizer`` for ``optim.name`` (``adamw``, ``adam`` or ``sgd`` with
    ``optim.momentum``, default 0.9) and ``optim.impl``: ``fused`` (torch's fused kernel), ``foreach``,
    ``auto`` (fused where the optimizer's device supports it, else foreach), or ``switchyard``
    (``routing_kernels.FusedAdamW``: our Triton kernel on CUDA, its reference elsewhere; adamw only).
    The engine calls it over its shard tensors; weight decay comes with each param group."""
    name, impl = ocfg.name, ocfg.impl
    if name not in _OPTIMIZERS:
        raise ValueError(f"optim.name={name!r} is invalid: expected one of {tuple(_OPTIMIZERS)}")
    if impl not in _IMPLS:
        raise ValueError(f"optim.impl={impl!r} is invalid: expected one of {_IMPLS}")
    if name == "sgd":
        kw = dict(lr=float(ocfg.lr), momentum=float(ocfg.momentum))
    else:
        kw = dict(lr=float(ocfg.lr), betas=tuple(float(b) for b in ocfg.betas), eps=float(ocfg.eps))
    if impl == "switchyard":
        if name != "adamw":
            raise ValueError(
                f"optim.impl=switchyard is routing_kernels.FusedAdamW, an AdamW; optim.name={name!r} "
                f"needs optim.impl=auto, fused or foreach"
            )
        return lambda groups: routing_kernels.FusedAdamW(groups, **kw)
    cls = _OPTIMIZERS[name]

    def build(groups):
        if impl in ("auto", "fused"):
            try:
                return cls(groups, fused=True, **kw)
            except (RuntimeError, ValueError) as e:
                if impl == "fused":
                    raise ValueError(
                        f"optim.impl=fused is not supported here ({e}); use optim.impl=foreach or auto"
                    ) from e
        return cls(groups, foreach=True, **kw)

    return build


def lr_at(step: int, ocfg, total_steps: int) -> float:
    """Linear warmup over ``warmup_steps`` then cosine to ``lr * min_lr_ratio`` at ``total_steps``;
    ``step`` counts from 0 (the step about to be taken)."""
    lr, warmup = float(ocfg.lr), int(ocfg.warmup_steps)
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(total_steps - warmup, 1)
    floor = lr * float(ocfg.min_lr_ratio)
    return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
