"""The parallel layout: one object that builds and hands out every process group.

world = pp x dp. Within a pipeline stage, the dp ranks form dp/ep expert-parallel groups of ep
consecutive ranks; ranks at the same position of different ep groups hold the same experts and form
an expert-data-parallel (edp) group of size dp/ep. Global rank = pp_rank * dp + dp_rank.

The node tier: a node is ``node_size`` consecutive global ranks (torchrun numbers the ranks of one
agent consecutively; ``node_size`` defaults to its ``LOCAL_WORLD_SIZE``). A dp or edp group whose
members sit k to a node on n nodes has two sub-groups for ZeRO++ (``zero.zeropp``): its intra-node
part (this rank's node's k members; hpZ's secondary partition, qgZ's first all-to-all) and its
inter-node part (the n members at this rank's position on each node; qgZ's second all-to-all).
``zero.comm`` counts every collective's bytes by the same tiers. With ``ep_dispatch="node"`` an ep
group spanning whole nodes has the same two parts (``ep_intra_group``, ``ep_inter_group``), which
``moe.dispatch.NodeDispatcher`` sends each token over once per node it needs.

A group of one process is ``None`` (the single-process path), never a module global: pass the layout
(or its groups) to whoever needs them.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import re
import shutil
import subprocess
import warnings
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
        raise ValueError(
            f"ep={ep} does not divide num_experts={num_experts}; each rank must hold the same number of experts"
        )
    return dp


EP_DISPATCH = ("flat", "node")


def validate_ep_dispatch(ep_dispatch, ep: int, node_size: int, source: str = "ep_dispatch") -> str:
    """Check the MoE dispatch against the layout before any collective; ``source`` names the key.

    ``flat``: one All-to-All over the ep group, a row for every routed slot. ``node``: each token
    crosses to a node at most once (then to its experts inside the node), so the ep group must span
    two or more whole nodes: ep a multiple of ``node_size`` and larger than it (ep groups are ep
    consecutive ranks starting at multiples of ep, hence on node boundaries)."""
    if ep_dispatch not in EP_DISPATCH:
        raise ValueError(
            f"{source}={ep_dispatch!r} is invalid: expected 'flat' (one All-to-All, a row per routed slot) or "
            f"'node' (a token crosses to each node it needs once)"
        )
    if ep_dispatch == "node" and not (ep > node_size and ep % node_size == 0):
        raise ValueError(
            f"{source}=node needs each ep group to span two or more whole nodes (ep a multiple of node_size and "
            f"larger than it); got ep={ep}, node_size={node_size}: use {source}=flat, or an ep among "
            f"{[node_size * m for m in range(2, 5)]}..."
        )
    return ep_dispatch


def validate_node_size(world: int, node_size, source: str = "node_size") -> int:
    """Check a node size before any collective; ``source`` names where it came from."""
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
        raise ValueError(f"{source}={node_size!r} must be a positive integer: the ranks of one node")
    if world % node_size:
        valid = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(
            f"{source}={node_size} does not divide the world size {world}: a node is node_size consecutive "
            f"ranks, so valid node sizes are the divisors of {world}: {valid}"
        )
    return node_size


def node_parts(ranks: list[int], node_size: int) -> list[list[int]] | None:
    """``ranks`` (one group's, ascending) cut by node, in node order; None when nodes hold
    different numbers of them (no intra/inter sub-groups then)."""
    parts: dict[int, list[int]] = {}
    for r in ranks:
        parts.setdefault(r // node_size, []).append(r)
    out = [parts[n] for n in sorted(parts)]
    return out if len({len(p) for p in out}) == 1 else None


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
    node_size: int = 1
    # the node tier of the dp and edp groups (see the module docstring): None where it would hold
    # this rank alone; the group itself where the group lies inside one node (intra) or has one
    # member per node (inter); both None when the group's nodes hold different numbers of members
    dp_intra_group: object = None
    dp_inter_group: object = None
    edp_intra_group: object = None
    edp_inter_group: object = None
    # ep_dispatch="node" (validate_ep_dispatch): the ep group's members on this rank's node (None:
    # this rank alone) and the members at this rank's position on each node the group spans
    ep_dispatch: str = "flat"
    ep_intra_group: object = None
    ep_inter_group: object = None

    @property
    def ep_node_groups(self) -> tuple[object, object] | None:
        """``(ep_intra_group, ep_inter_group)`` under ``ep_dispatch="node"`` (what ``MoELayer``'s
        ``ep_node_groups`` takes), else None: the flat dispatch."""
        return (self.ep_intra_group, self.ep_inter_group) if self.ep_dispatch == "node" else None

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

    @property
    def node_rank(self) -> int:
        return self.rank // self.node_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.node_size

    def group_ranks(self, kind: str) -> list[int]:
        """The global ranks of this rank's ``"dp"`` or ``"edp"`` group, ascending (its group-rank order)."""
        base = self.pp_rank * self.dp
        if kind == "dp":
            return list(range(base, base + self.dp))
        if kind == "edp":
            return list(range(base + self.ep_rank, base + self.dp, self.ep))
        raise ValueError(f"kind={kind!r} must be 'dp' or 'edp'")

    def node_split(self, kind: str) -> tuple[int, int] | None:
        """``(n, k)`` of this rank's ``"dp"`` or ``"edp"`` group: the nodes it spans and its members on
        each; None when its nodes hold different numbers of members."""
        parts = node_parts(self.group_ranks(kind), self.node_size)
        return None if parts is None else (len(parts), len(parts[0]))

    @classmethod
    def single(cls) -> Layout:
        return cls()

    @classmethod
    def build(
        cls,
        *,
        ep: int = 1,
        pp: int = 1,
        num_experts: int | None = None,
        timeout_s: float | None = None,
        node_size: int | None = None,
        ep_dispatch: str = "flat",
    ) -> Layout:
        """Create every group from the initialised default process group (all ranks must call).

        Each group's collectives fail after ``timeout_s`` seconds (default: the collective timeout
        ``init_distributed`` was given, else torch's default): a new group does not inherit the
        default group's timeout, so without this a rank that dies in an expert-parallel exchange
        would leave its peers waiting torch's 30 minutes.

        ``node_size``: ranks per node (default: ``LOCAL_WORLD_SIZE`` from torchrun's environment, else
        the whole world as one node); it must divide the world size. ``ep_dispatch``: ``flat`` or
        ``node`` (``validate_ep_dispatch``; ``node`` builds the ep group's node sub-groups)."""
        if not dist.is_initialized():
            validate_layout(1, pp, ep, num_experts)
            if node_size is not None:
                validate_node_size(1, node_size)
            validate_ep_dispatch(ep_dispatch, ep, 1 if node_size is None else node_size)
            return cls.single()
        world, rank = dist.get_world_size(), dist.get_rank()
        if node_size is None:
            local = os.environ.get("LOCAL_WORLD_SIZE", "")
            node_size = validate_node_size(world, int(local), "LOCAL_WORLD_SIZE") if local.isdigit() else world
        validate_node_size(world, node_size)
        dp = validate_layout(world, pp, ep, num_experts)
        validate_ep_dispatch(ep_dispatch, ep, node_size)
        timeout_s = _collective_timeout_s if timeout_s is None else timeout_s
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0 seconds")
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)

        def new_group(ranks):
            return dist.new_group(ranks, timeout=timeout)

        layout = cls(world=world, rank=rank, pp=pp, dp=dp, ep=ep, node_size=node_size, ep_dispatch=ep_dispatch)
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
        # the node tier last, so the groups above are created in the order they always were
        for stage in range(pp):
            base = stage * dp
            dp_ranks = list(range(base, base + dp))
            tier = _node_tier(new_group, dp_ranks, node_size, rank, layout.dp_group)
            if rank in dp_ranks:
                layout.dp_intra_group, layout.dp_inter_group = tier
            for offset in range(ep):
                ranks = list(range(base + offset, base + dp, ep))
                # ep=1: the edp group has the dp group's ranks, and so its sub-groups
                sub = tier if ep == 1 else _node_tier(new_group, ranks, node_size, rank, layout.edp_group)
                if rank in ranks:
                    layout.edp_intra_group, layout.edp_inter_group = sub
            if ep_dispatch == "node":
                for start in range(0, dp, ep):
                    ranks = list(range(base + start, base + start + ep))
                    mine = layout.ep_group if rank in ranks else None
                    sub = _node_tier(new_group, ranks, node_size, rank, mine)
                    if rank in ranks:
                        layout.ep_intra_group, layout.ep_inter_group = sub
        return layout

    def twin_groups(self, timeout_s: float | None = None) -> dict:
        """Every process group of this layout created once more (all ranks must call, together): a
        map from each of this rank's groups to its twin, the same ranks on a group of its own. A
        second lane of collectives runs on the twins (``routing_kernels.runtime.comm_lane``) while the
        first runs on the originals: a pipeline's overlapped forward and backward
        (``zero.pipeline.Pipeline``). Empty for one process."""
        if not dist.is_initialized() or self.world == 1:
            return {}
        twin = Layout.build(
            ep=self.ep, pp=self.pp, node_size=self.node_size, ep_dispatch=self.ep_dispatch, timeout_s=timeout_s
        )
        out = {}
        for f in dataclasses.fields(self):
            g = getattr(self, f.name)
            if f.name.endswith("_group") and g is not None:
                out[g] = getattr(twin, f.name)
        return out

    def describe(self) -> str:
        return (
            f"world={self.world} pp={self.pp} dp={self.dp} ep={self.ep} edp={self.edp} node_size={self.node_size} "
            f"rank={self.rank} (pp_rank={self.pp_rank} dp_rank={self.dp_rank} ep_rank={self.ep_rank} "
            f"edp_rank={self.edp_rank} node_rank={self.node_rank})"
        )


def _node_tier(new_group, ranks: list[int], node_size: int, rank: int, whole) -> tuple[object, object]:
    """``(intra, inter)`` sub-groups of the group of ``ranks`` for ``rank`` (``whole``: that group,
    when ``rank`` is a member). Every rank runs this for every group, creating the same groups in the
    same order; only those with two or more members and other than the whole group are created."""
    parts = node_parts(ranks, node_size)
    if parts is None or len(ranks) == 1:
        return None, None
    n, k = len(parts), len(parts[0])
    intra = inter = None
    if n == 1:
        intra = whole
    elif k == 1:
        inter = whole
    else:
        for part in parts:
            g = new_group(part)
            if rank in part:
                intra = g
        for j in range(k):
            column = [part[j] for part in parts]
            g = new_group(column)
            if rank in column:
                inter = g
    return intra, inter


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


# MASTER_PORT of a SLURM step when none is given: one port per job id, in a range below Linux's
# ephemeral ports (32768-60999), so that two jobs sharing a node rarely pick the same one
SLURM_PORT_BASE, SLURM_PORT_SPAN = 15000, 10000


def _first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``scontrol show hostnames`` when scontrol is installed,
    else the list read here (``gpu[003-005,9],cpu1`` -> ``gpu003``: the first entry, each bracket
    replaced by its first number, zero padding kept)."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
            ).stdout.split()
            if out:
                return out[0]
        except (OSError, subprocess.SubprocessError):
            pass  # the list is read below
    depth, end = 0, len(nodelist)
    for i, c in enumerate(nodelist):
        depth += (c == "[") - (c == "]")
        if c == "," and depth == 0:
            end = i
            break
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], nodelist[:end].strip())


def _env_int(env, name: str, *fallbacks: str) -> int:
    for key in (name, *fallbacks):
        if env.get(key, "") != "":
            value = env[key]
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{key}={value!r} in the environment is not an integer") from None
    raise ValueError(f"{' or '.join((name, *fallbacks))} is not set; a task of an srun step has it")


def slurm_environment(env=None) -> dict[str, str] | None:
    """torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) for this process
    from SLURM's, or None when it is not a task of an srun step or when torchrun's RANK is set
    (torchrun wins). ``env``: default ``os.environ``.

    A task of a step has SLURM_STEP_ID: a batch script or an salloc shell also has SLURM_PROCID=0
    and SLURM_NTASKS=N, but no peers will ever join it. RANK = SLURM_PROCID, WORLD_SIZE =
    SLURM_STEP_NUM_TASKS (else SLURM_NTASKS), LOCAL_RANK = SLURM_LOCALID. MASTER_ADDR: the
    environment's if set, else the first host of the step's node list (SLURM_STEP_NODELIST, else
    SLURM_JOB_NODELIST), which holds task 0 under SLURM's block and cyclic distributions, else
    SLURM_LAUNCH_NODE_IPADDR (where srun ran: the first node in a batch job, but a login node
    under salloc). MASTER_PORT: the environment's if set, else ``SLURM_PORT_BASE + SLURM_JOB_ID %
    SLURM_PORT_SPAN``, the same on every task of the job."""
    env = os.environ if env is None else env
    if "RANK" in env or "SLURM_PROCID" not in env or not (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")):
        return None
    rank = _env_int(env, "SLURM_PROCID")
    world = _env_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    if not 0 <= rank < world:
        raise ValueError(f"SLURM_PROCID={rank} is not a rank of the step's {world} tasks (valid: 0 to {world - 1})")
    local = _env_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        addr = _first_host(nodelist) if nodelist else env.get("SLURM_LAUNCH_NODE_IPADDR")
    if not addr:
        raise ValueError(
            "cannot tell the address of rank 0: none of MASTER_ADDR, SLURM_STEP_NODELIST, "
            "SLURM_JOB_NODELIST or SLURM_LAUNCH_NODE_IPADDR is set; export MASTER_ADDR"
        )
    port = env.get("MASTER_PORT") or str(
        SLURM_PORT_BASE + _env_int(env, "SLURM_JOB_ID", "SLURM_JOBID") % SLURM_PORT_SPAN
    )
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local),
        "MASTER_ADDR": addr,
        "MASTER_PORT": port,
    }


def init_distributed(timeout_s: float = 300.0, backend: str | None = None, rendezvous_timeout_s: float = 900.0) -> bool:
    """Initialise torch.distributed (``join_process_group``) from torchrun's environment or, when
    not under torchrun, from SLURM's (a task of an srun step: ``slurm_environment``, whose
    variables are then exported to this process's environment); False for a single process. NCCL
    when CUDA is available, gloo otherwise."""
    if dist.is_initialized():
        return True
    slurm = slurm_environment()
    if slurm is not None:
        if int(slurm["WORLD_SIZE"]) > 1:
            os.environ.update(slurm)
    elif "RANK" not in os.environ and int(os.environ.get("SLURM_NTASKS") or 1) > 1:
        warnings.warn(
            f"SLURM_NTASKS={os.environ['SLURM_NTASKS']} but this process is not a task of an srun step (no "
            f"SLURM_STEP_ID: a batch script or an salloc shell): running as one process; start every task "
            f"with srun to train on all of them",
            stacklevel=2,
        )
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
        raise RuntimeError(
            f"the {what} differs between ranks: ranks {differing} disagree with rank 0; "
            f"launch every rank with the same arguments"
        )
