"""The parallel layout: one object that builds and hands out every process group.

world = pp x dp. Within a pipeline stage, the dp ranks form dp/ep expert-parallel groups of ep
consecutive ranks; ranks at the same position of different ep groups hold the same experts and form
an expert-data-parallel (edp) group of size dp/ep. Global rank = pp_rank * dp + dp_rank.

A group of one process is ``None`` (the single-process path), never a module global: pass the layout
(or its groups) to whoever needs them.
"""
from __future__ import annotations

import datetime
import hashlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from routing_kernels.runtime import all_gather_into


def validate_layout(world: int, pp: int = 1, ep: int = 1, num_experts: int | None = None) -> int:
    """Check the sizes before any collective; returns dp. Raises ValueError naming the numbers."""
    for name, v in (("world size", world), ("pp", pp), ("ep", ep)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if world % pp:
        raise ValueError(f"world size {world} is not divisible by pp={pp}: world size must equal pp x dp")
    dp = world // pp
    if dp % ep:
        raise ValueError(f"ep={ep} does not divide dp={dp} (world size {world} / pp={pp}); valid ep values divide {dp}")
    if num_experts is not None and num_experts % ep:
        raise ValueError(f"ep={ep} does not divide num_experts={num_experts}; each rank must hold the same number of experts")
    return dp


@dataclass
class Layout:
    world: int = 1
    rank: int = 0
    pp: int = 1
    dp: int = 1
    ep: int = 1
    dp_group: object = None
    ep_group: object = None
    edp_group: object = None
    pp_group: object = None

    @property
    def edp(self) -> int:
        return self.dp // self.ep

    @property
    def pp_rank(self) -> int:
        return self.rank // self.dp

    @property
    def dp_rank(self) -> int:
        return self.rank % self.dp

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.ep

    @property
    def edp_rank(self) -> int:
        return self.dp_rank // self.ep

    @property
    def is_single(self) -> bool:
        return self.world == 1

    @classmethod
    def single(cls) -> "Layout":
        return cls()

    @classmethod
    def build(cls, *, ep: int = 1, pp: int = 1, num_experts: int | None = None, timeout_s: float | None = None) -> "Layout":
        """Create every group from the initialised default process group (all ranks must call).

        Each group's collectives fail after ``timeout_s`` seconds (default: the collective timeout
        ``init_distributed`` was given, else torch's default): a new group does not inherit the
        default group's timeout, so without this a rank that dies in an expert-parallel exchange
        would leave its peers waiting torch's 30 minutes."""
        if not dist.is_initialized():
            validate_layout(1, pp, ep, num_experts)
            return cls.single()
        world, rank = dist.get_world_size(), dist.get_rank()
        dp = validate_layout(world, pp, ep, num_experts)
        timeout_s = _collective_timeout_s if timeout_s is None else timeout_s
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0 seconds")
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)

        def new_group(ranks):
            return dist.new_group(ranks, timeout=timeout)

        layout = cls(world=world, rank=rank, pp=pp, dp=dp, ep=ep)
        # every rank creates every group, in the same order (a torch.distributed requirement)
        for stage in range(pp):
            base = stage * dp
            ranks = list(range(base, base + dp))
            g = new_group(ranks) if dp > 1 else None
            if stage == layout.pp_rank:
                layout.dp_group = g
            for start in range(0, dp, ep):
                ranks = list(range(base + start, base + start + ep))
                g = new_group(ranks) if ep > 1 else None
                if rank in ranks:
                    layout.ep_group = g
            for offset in range(ep):
                ranks = list(range(base + offset, base + dp, ep))
                g = new_group(ranks) if dp // ep > 1 else None
                if rank in ranks:
                    layout.edp_group = g
        for d in range(dp):
            ranks = list(range(d, world, dp))
            g = new_group(ranks) if pp > 1 else None
            if rank in ranks:
                layout.pp_group = g
        return layout

    def describe(self) -> str:
        return f"world={self.world} pp={self.pp} dp={self.dp} ep={self.ep} edp={self.edp} rank={self.rank} (pp_rank={self.pp_rank} dp_rank={self.dp_rank} ep_rank={self.ep_rank} edp_rank={self.edp_rank})"


_collective_timeout_s: float | None = None  # what join_process_group was given; Layout.build's default


def join_process_group(backend: str, timeout_s: float, rendezvous_timeout_s: float = 900.0, **kwargs) -> None:
    """``torch.distributed.init_process_group(backend, **kwargs)`` whose ranks may take up to
    ``rendezvous_timeout_s`` to meet (a rank that starts late on a loaded machine is no error), and
    whose collectives, like those of every group ``Layout.build`` creates later, then fail after
    ``timeout_s`` instead of hanging on a dead rank."""
    global _collective_timeout_s
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be > 0 seconds")
    # torch's own way to change a group's timeout after its rendezvous (torchelastic uses it); a
    # torch without it rendezvouses under the collective timeout
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    rendezvous = max(rendezvous_timeout_s, timeout_s) if set_timeout is not None else timeout_s
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=rendezvous), **kwargs)
    if rendezvous != timeout_s:
        dist.barrier()  # every rank has joined: from here on a wait means a dead or stuck rank
        set_timeout(datetime.timedelta(seconds=timeout_s), None)
    _collective_timeout_s = float(timeout_s)


def init_distributed(timeout_s: float = 300.0, backend: str | None = None, rendezvous_timeout_s: float = 900.0) -> bool:
    """Initialise torch.distributed from torchrun's environment (``join_process_group``); False when
    not launched by it. NCCL when CUDA is available, gloo otherwise."""
    if dist.is_initialized():
        return True
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return False
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    join_process_group(backend, timeout_s, rendezvous_timeout_s)
    return True


def check_same_on_all_ranks(text: str, what: str = "config", group=None) -> None:
    """Raise on every rank if ``text`` differs between ranks (e.g. a config overridden on one rank)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    digest = hashlib.sha256(text.encode()).digest()[:8]
    mine = torch.tensor(list(digest), dtype=torch.uint8)
    if dist.get_backend(group) == "nccl":
        mine = mine.cuda()
    n = dist.get_world_size(group)
    everyone = mine.new_empty(n * mine.numel())
    all_gather_into(everyone, mine, group)
    rows = everyone.view(n, -1).cpu()
    differing = [r for r in range(n) if not torch.equal(rows[r], rows[0])]
    if differing:
        raise RuntimeError(f"the {what} differs between ranks: ranks {differing} disagree with rank 0; launch every rank with the same arguments")
