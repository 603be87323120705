"""The checkpoint's process group: this process's rank in it, a gloo group of its own, and the
agreement that makes every rank raise together."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def _rank(group) -> int:
    """This process's rank in the checkpoint's group (every process of the group takes part)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def _distributed(group) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1


def _agree(
    problem: str | BaseException | None,
    group,
    elsewhere: str = "another rank could not load its part of the checkpoint (see its error)",
    *,
    count: int | tuple[int, ...] = 0,
):
    """Raise on every rank if any rank has a problem (its own message, or exception, where it has
    one), so no rank enters a collective the others have left. ``count``: this rank's number (or
    numbers), summed over the ranks in the same all-reduce, e.g. the bytes each rank will write;
    the sum is returned (a tuple for a tuple)."""
    numbers = [int(c) for c in (count if isinstance(count, tuple) else (count,))]
    if _distributed(group):
        # one SUM all-reduce carries both: the flag counts the ranks with a problem
        box = torch.tensor([0 if problem is None else 1, *numbers], dtype=torch.int64)
        dist.all_reduce(box, group=group)
        flagged, *numbers = box.tolist()
        if flagged and problem is None:
            problem = elsewhere
    if isinstance(problem, BaseException):
        raise problem
    if problem is not None:
        raise ValueError(problem)
    return tuple(numbers) if isinstance(count, tuple) else numbers[0]


def new_group(timeout_s: float | None = None):
    """A gloo group over every rank for checkpoint traffic (None on one process): DCP's planning
    collectives then never interleave with the training's, which an async save needs, and work on
    CPU tensors whatever the training backend. A collective: every rank must call it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    from ..layout import _collective_timeout_s

    t = timeout_s if timeout_s is not None else _collective_timeout_s
    return dist.new_group(backend="gloo", timeout=None if t is None else datetime.timedelta(seconds=t))
