"""What both ``moe`` and ``zero`` need from the process they run in, kept in one place below both.

- Collectives where ``group=None`` means one process (a no-op or the identity), so every caller
  has the single-process path for free; the All-to-All is differentiable, its backward the same
  exchange with the split sizes swapped.
- Lanes (``comm_lane``): a thread that runs one pass while another thread runs another (a
  pipeline's overlapped forward-backward pair) issues its collectives on process groups of its own,
  given as a map from each group to its twin; every collective here resolves its group through
  ``lane_group``. Two passes on one group would interleave their collectives in whatever order
  the threads reach them, which differs from rank to rank.
- ``in_backward()``: whether autograd is running a backward pass (activation checkpointing re-runs
  forwards there; statistics and ZeRO's forward hooks must not count those twice).
- The expert-parameter mark: the experts module tags each of its parameters with the global index
  of its first expert and the number of experts in the model (dimension 0 runs over the experts
  this process holds). ZeRO shards, reduces and names parameters by this mark, never by module type.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist

# --- collectives ---------------------------------------------------------------------------------

_lane = threading.local()


@contextlib.contextmanager
def comm_lane(twins: Mapping):
    """Within, this thread's collectives run on ``twins[group]`` instead of ``group`` (groups not in
    the map stay as they are); other threads are not affected."""
    before = getattr(_lane, "twins", None)
    _lane.twins = twins
    try:
        yield
    finally:
        _lane.twins = before


def lane_group(group):
    """The group this thread's collectives on ``group`` run on (``comm_lane``)."""
    if group is None or torch.compiler.is_compiling():
        return group
    twins = getattr(_lane, "twins", None)
    return group if not twins else twins.get(group, group)


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=lane_group(group))
    return t


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    """Every rank's ``inp`` concatenated into ``out`` (``all_gather_single`` where this torch has it,
    the older ``all_gather_into_tensor`` otherwise)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=lane_group(group), async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    """The sum over ranks of ``inp``, this rank's 1/W slice into ``out``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=lane_group(group), async_op=async_op)


def gather_rows(t: torch.Tensor, group) -> tuple[torch.Tensor, int]:
    """Every rank's rows in rank order (counts may differ), and where this rank's rows start. Not
    differentiable: used for routing decisions over a whole batch, not for values."""
    if group_size(group) == 1:
        return t, 0
    n, me = group_size(group), group_rank(group)
    sizes = torch.zeros(n, dtype=torch.long, device=t.device)
    sizes[me] = t.shape[0]
    dist.all_reduce(sizes, group=lane_group(group))
    sizes_l = sizes.tolist()
    pad = max(sizes_l)
    buf = t.new_zeros((pad,) + tuple(t.shape[1:]))
    buf[: t.shape[0]] = t
    out = t.new_empty((n * pad,) + tuple(t.shape[1:]))
    all_gather_into(out, buf, group)
    parts = [out[i * pad : i * pad + s] for i, s in enumerate(sizes_l)]
    return torch.cat(parts), sum(sizes_l[:me])


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, output_splits, input_splits, group, async_op=False):
    """``torch.distributed.all_to_all_single`` on this thread's lane of ``group`` (``lane_group``)."""
    return dist.all_to_all_single(out, inp, output_splits, input_splits, group=lane_group(group), async_op=async_op)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.group = group
        ctx.output_splits = output_splits
        ctx.input_splits = input_splits
        x = x.contiguous()
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        all_to_all_single(out, x, output_splits, input_splits, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = grad.new_empty((sum(ctx.input_splits),) + tuple(grad.shape[1:]))
        # the group's twin where the backward runs in a lane (``comm_lane``), not the forward's
        all_to_all_single(out, grad, ctx.input_splits, ctx.output_splits, ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Rows ``x[sum(input_splits[:r]) : ...]`` go to rank r; returns the rows received, by source rank."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group)


# --- autograd ------------------------------------------------------------------------------------

_recomputing = 0  # depth of recomputation() contexts
_replays = threading.local()  # .stack: this thread's (replay, replaying) of the checkpoints it is inside


class _Replay:
    """What one checkpointed forward's ``replayed`` collectives returned, in order, for its
    recomputations to take back instead of running them again."""

    def __init__(self):
        self.results: list = []
        self.next = 0


class _ReplayContext:
    """Pushes ``replay`` on this thread's stack: recording (the first forward) or replaying (a
    recomputation, from its first result again each time)."""

    def __init__(self, replay: _Replay, replaying: bool):
        self.replay, self.replaying = replay, replaying

    def __enter__(self):
        self.replay.next = 0
        stack = getattr(_replays, "stack", None)
        if stack is None:
            stack = _replays.stack = []
        stack.append((self.replay, self.replaying))
        return self

    def __exit__(self, *exc):
        _replays.stack.pop()
        return False


class recomputation:
    """Marks a forward re-run during backward (activation checkpointing's recomputation), for code
    that ``torch.compile`` traces: there ``in_backward()`` cannot ask autograd and reads this mark
    instead (pass ``context_fn=recompute_context`` to ``torch.utils.checkpoint.checkpoint``).
    Re-entrant: torch's checkpoint enters the same object for every recomputation of one forward
    (one per backward pass that unpacks its saved tensors; ``moe.recompute.checkpoint_once``, which
    a split backward uses, recomputes once).
    ``replay``: the first forward's recorded collectives (``replayed``), taken back in the re-run."""

    def __init__(self, replay: _Replay | None = None):
        self.replay = None if replay is None else _ReplayContext(replay, replaying=True)

    def __enter__(self):
        global _recomputing
        _recomputing += 1
        if self.replay is not None:
            self.replay.__enter__()
        return self

    def __exit__(self, *exc):
        global _recomputing
        _recomputing -= 1
        if self.replay is not None:
            self.replay.__exit__(*exc)
        return False


def recompute_context():
    """``context_fn`` for non-reentrant ``torch.utils.checkpoint.checkpoint``: around the first
    forward a record of its ``replayed`` collectives, around the re-run ``recomputation()``, which
    takes them back instead of running them again."""
    replay = _Replay()
    return _ReplayContext(replay, replaying=False), recomputation(replay)


def replayed(collective):
    """``collective()``, a collective whose result a recomputation may reuse: the same inputs give
    the same result (the MoE layer's statistics all-reduce, whose routing the re-run repeats exactly).
    Inside a checkpoint run with ``recompute_context``, the first forward records what it returned
    and each recomputation takes that back in order, so the backward runs no collective for it: no
    wait behind the gradient reductions in flight on the same group, no latency on the backward's
    path. Elsewhere (no such checkpoint, or traced by ``torch.compile``, or a re-run whose forward
    recorded nothing) it runs. The record lives as long as the checkpoint's saved inputs."""
    if torch.compiler.is_compiling():
        return collective()
    stack = getattr(_replays, "stack", None)
    if not stack:
        return collective()
    replay, replaying = stack[-1]
    if not replaying:
        out = collective()
        replay.results.append(out)
        return out
    if replay.next < len(replay.results):
        out = replay.results[replay.next]
        replay.next += 1
        return out
    return collective()


def in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. activation checkpointing's recomputation).

    Under ``torch.compile`` the autograd query is no traceable op (a graph break), so traced code
    reads the ``recomputation()`` mark instead; dynamo guards on its value, so a recomputation runs
    a graph compiled for it. A checkpoint around compiled code without ``recompute_context`` is
    therefore not seen as a recomputation."""
    if torch.compiler.is_compiling():
        return _recomputing > 0
    return torch._C._current_graph_task_id() != -1


def first_pass_weight() -> float:
    """1.0 in a forward, 0.0 in its recomputation (``in_backward()``): the factor for statistics a
    forward accumulates in place. Multiplying rather than skipping keeps a compiled recomputation's
    graph the forward's, which ``torch.utils.checkpoint`` requires (the same tensors saved)."""
    return 0.0 if in_backward() else 1.0


# --- the expert-parameter mark -------------------------------------------------------------------


class ExpertShard(NamedTuple):
    """What a process holds of an expert parameter: experts ``[offset, offset + shape[0])`` of
    ``num_experts``."""

    offset: int
    num_experts: int


_MARK = "expert_shard"


def mark_expert_params(params: Iterable[torch.Tensor], offset: int, num_experts: int) -> None:
    """Tag expert parameters (dimension 0 runs over this process's experts) with their place in the
    model; the tag survives ``p.data`` swaps (ZeRO's flat buffers) since it lives on the Parameter."""
    for p in params:
        if not (0 <= offset and offset + p.shape[0] <= num_experts):
            raise ValueError(f"experts [{offset}, {offset + p.shape[0]}) do not lie within the model's {num_experts}")
        setattr(p, _MARK, ExpertShard(int(offset), int(num_experts)))


def expert_shard(p: torch.Tensor) -> ExpertShard | None:
    """The mark ``mark_expert_params`` set, or None for a dense parameter."""
    return getattr(p, _MARK, None)


def is_expert_param(p: torch.Tensor) -> bool:
    return expert_shard(p) is not None
