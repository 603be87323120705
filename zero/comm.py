"""Every collective ``ZeroEngine`` issues, through one place that counts its bytes per link tier.

A node is ``node_size`` consecutive global ranks (``zero.Layout.node_size``: torchrun's
``LOCAL_WORLD_SIZE`` by default). ``CommCounter`` wraps the collectives of
``routing_kernels.runtime`` and adds, at the moment each is issued, the bytes *this rank sends*
over intra-node links (``intra``) and over links that leave its node (``inter``), under a label
saying what moved (``param_gather``, ``grad_reduce``, ...). The engine closes a step's count at the
end of ``step()``: ``engine.comm_bytes()`` is the last optimizer step's, from the end of the step
before (so the forward and backward gathers, the gradient reduction, the norm's all-reduce and
stages 1-2's weight gather after the update all fall in the step they serve).

The byte model (bytes this rank sends; receiving is not counted, a rank's own part never moves).
A group of W ranks whose members sit k to a node on n nodes (W = n k, "regular") runs every
all-gather and reduce-scatter as the two-level algorithm:

    all-gather, output N bytes (N/W from each rank): across nodes among the ranks at the same
        position of each node, then within the node:  inter = (n - 1) N / W,  intra = (k - 1) N / k
    reduce-scatter, input N bytes: within the node, then across:  the same two numbers

Their sum is (W - 1) N / W, what each rank of a ring sends, split by where it goes. (A ring in
node-contiguous order sends the same total; its n node-crossing links carry (W - 1) N / W each, so
per rank it averages n (W - 1) N / W^2 across nodes against the model's (n - 1) N / W: the same
for many nodes, and per rank uneven where the model is exact on every rank.) Everything else:

    all-reduce of N bytes: a reduce-scatter and an all-gather of N rounded up to a multiple of W
    broadcast of N bytes: a scatter from the source (the source alone sends each other member its
        N/W, N rounded up as above) and an all-gather of the pieces (every rank)
    all-to-all: each destination's bytes, intra when it sits on this rank's node, else inter
    a group that is not regular (nodes holding different numbers of its members): all-gather,
        reduce-scatter and all-reduce count each rank's N/W to each other member directly, by
        where that member sits (its total is the same (W - 1) N / W)

Every number is an integer (an all-gather's output and a reduce-scatter's input are W times a
chunk), so a test checks the counters against these formulas exactly. Not counted: collectives the
model issues itself (the MoE layer's token All-to-All, the pipeline's point-to-point sends) and
those of ``zero.checkpoint``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from routing_kernels.runtime import all_gather_into, group_size, lane_group, reduce_scatter_into

LABELS = (
    "setup",  # the construction's broadcast of the initial weights (reported apart, never per step)
    "param_gather",  # stage 3's weight all-gather over the sharding group (forward; backward without hpZ)
    "param_gather_secondary",  # hpZ: the gather from the node-local secondary partition
    "param_update_gather",  # stages 1-2: the updated slices back into every replica after the step
    "grad_reduce",  # reduce-scatter (stages 1-3) or all-reduce (stage 0) of the gradients
    "grad_reduce_intra",  # qgZ: the quantized all-to-all inside the node
    "grad_reduce_inter",  # qgZ: the quantized all-to-all across nodes
    "grad_norm",  # the all-reduce of the squared norm and the finiteness flags
    "inspect",  # full_parameters(), full_gradients(), weights_finite()
)


@dataclass(frozen=True)
class Tiers:
    """Where the members of one group sit: their global ranks in group-rank order, this
    process's global rank, and the node size."""

    ranks: tuple[int, ...]
    me: int
    node_size: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    def node_of(self, rank: int) -> int:
        return rank // self.node_size

    @property
    def split(self) -> tuple[int, int] | None:
        """``(n, k)``: nodes the group spans and members on each, or None when nodes hold different
        numbers of members."""
        per_node: dict[int, int] = {}
        for r in self.ranks:
            per_node[self.node_of(r)] = per_node.get(self.node_of(r), 0) + 1
        counts = set(per_node.values())
        return (len(per_node), counts.pop()) if len(counts) == 1 else None

    def same_node_others(self) -> int:
        mine = self.node_of(self.me)
        return sum(1 for r in self.ranks if r != self.me and self.node_of(r) == mine)


# --- the byte model: pure arithmetic, (intra, inter) bytes this rank sends ---------------------


def gather_bytes(nbytes: int, t: Tiers) -> tuple[int, int]:
    """All-gather with an output of ``nbytes`` (also a reduce-scatter with that input)."""
    W = t.size
    if W <= 1:
        return 0, 0
    if nbytes % W:
        raise ValueError(f"an all-gather of {nbytes} bytes over {W} ranks: the bytes must be W equal chunks")
    chunk = nbytes // W
    split = t.split
    if split is None:
        same = t.same_node_others()
        return same * chunk, (W - 1 - same) * chunk
    n, k = split
    return (k - 1) * (nbytes // k), (n - 1) * chunk


def _padded(nbytes: int, W: int) -> int:
    return -(-nbytes // W) * W


def all_reduce_bytes(nbytes: int, t: Tiers) -> tuple[int, int]:
    intra, inter = gather_bytes(_padded(nbytes, t.size), t)
    return 2 * intra, 2 * inter


def broadcast_bytes(nbytes: int, t: Tiers, src: int) -> tuple[int, int]:
    """``src``: the source's global rank."""
    W = t.size
    if W <= 1:
        return 0, 0
    padded = _padded(nbytes, W)
    intra, inter = gather_bytes(padded, t)
    if t.me == src:
        same = t.same_node_others()
        intra, inter = intra + same * (padded // W), inter + (W - 1 - same) * (padded // W)
    return intra, inter


def all_to_all_bytes(split_bytes: list[int], t: Tiers) -> tuple[int, int]:
    """``split_bytes[i]``: what goes to the group's i-th member."""
    intra = inter = 0
    mine = t.node_of(t.me)
    for r, b in zip(t.ranks, split_bytes):
        if r == t.me:
            continue
        if t.node_of(r) == mine:
            intra += b
        else:
            inter += b
    return intra, inter


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CommCounter:
    """The engine's collectives, counted (see the module docstring). ``current``: the step in
    progress; ``last``: the last closed step; ``setup``: the construction's; ``asides``: what ran
    inside ``aside()``. Each maps a label to ``[intra, inter]`` bytes."""

    def __init__(self, node_size: int = 1, rank: int = 0):
        if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
            raise ValueError(f"node_size={node_size!r} must be a positive integer (ranks per node)")
        self.node_size = node_size
        self.rank = rank
        self.current: dict[str, list[int]] = {}
        self.last: dict[str, list[int]] = {}
        self.setup: dict[str, list[int]] = {}
        self.asides: dict[str, list[int]] = {}
        self._tiers: dict[int, tuple[object, Tiers]] = {}

    @classmethod
    def for_layout(cls, layout) -> CommCounter:
        return cls(node_size=layout.node_size, rank=layout.rank)

    # ----- bookkeeping ------------------------------------------------------------------------
    def tiers(self, group) -> Tiers:
        if group is None:
            return Tiers((self.rank,), self.rank, self.node_size)
        hit = self._tiers.get(id(group))
        if hit is None:
            ranks = tuple(dist.get_process_group_ranks(group))
            hit = (group, Tiers(ranks, self.rank, self.node_size))  # the group is held: its id stays unique
            self._tiers[id(group)] = hit
        return hit[1]

    def add(self, label: str, intra: int, inter: int) -> None:
        if label not in LABELS:
            raise ValueError(f"unknown communication label {label!r}; known: {LABELS}")
        entry = self.current.setdefault(label, [0, 0])
        entry[0] += intra
        entry[1] += inter

    @contextlib.contextmanager
    def aside(self):
        """Count the collectives inside into ``asides`` instead of the step in progress: an
        evaluation's forward between optimizer steps (stage 3 gathers for it) is no part of a step."""
        saved, self.current = self.current, self.asides
        try:
            yield
        finally:
            self.asides, self.current = self.current, saved

    def end_setup(self) -> None:
        self.setup, self.current = self.current, {}

    def end_step(self) -> None:
        self.last, self.current = self.current, {}

    @staticmethod
    def totals(counts: dict[str, list[int]]) -> dict[str, int]:
        return {"intra": sum(v[0] for v in counts.values()), "inter": sum(v[1] for v in counts.values())}

    @staticmethod
    def breakdown(counts: dict[str, list[int]]) -> dict[str, dict[str, int]]:
        return {k: {"intra": v[0], "inter": v[1]} for k, v in counts.items()}

    # ----- the collectives --------------------------------------------------------------------
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group, *, label: str, async_op: bool = False):
        """Every rank's ``inp`` concatenated into ``out``."""
        if group_size(group) == 1:
            out.copy_(inp)
            return None
        self.add(label, *gather_bytes(_nbytes(out), self.tiers(group)))
        return all_gather_into(out, inp, group, async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group, *, label: str, async_op: bool = False):
        """The sum over ranks of ``inp``, this rank's 1/W slice into ``out``."""
        if group_size(group) == 1:
            out.copy_(inp)
            return None
        self.add(label, *gather_bytes(_nbytes(inp), self.tiers(group)))
        return reduce_scatter_into(out, inp, group, async_op=async_op)

    def all_reduce(self, t: torch.Tensor, group, *, label: str, async_op: bool = False):
        if group_size(group) == 1:
            return None
        self.add(label, *all_reduce_bytes(_nbytes(t), self.tiers(group)))
        return dist.all_reduce(t, group=lane_group(group), async_op=async_op)

    def broadcast(self, t: torch.Tensor, src: int, group, *, label: str):
        """``src``: a global rank, as ``torch.distributed.broadcast`` takes it."""
        if group_size(group) == 1:
            return None
        self.add(label, *broadcast_bytes(_nbytes(t), self.tiers(group), src))
        return dist.broadcast(t, src=src, group=lane_group(group))

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group, *, label: str, async_op: bool = False):
        """Equal splits along dimension 0: ``inp``'s i-th 1/W goes to the group's i-th member."""
        W = group_size(group)
        if W == 1:
            out.copy_(inp)
            return None
        if inp.shape[0] % W:
            raise ValueError(f"all_to_all of {inp.shape[0]} rows over {W} ranks needs equal splits")
        self.add(label, *all_to_all_bytes([_nbytes(inp) // W] * W, self.tiers(group)))
        return dist.all_to_all_single(out, inp, group=lane_group(group), async_op=async_op)
