"""Every layout of a model on a world size and a global batch that the trainer would accept.

The rules are the trainer's own, by the same functions: ``zero.layout.validate_layout`` (world =
pp x dp, ep dividing dp and the number of experts), ``zero.pipeline.plan_pipeline`` (schedules,
virtual stages, micro-batches, layers per stage), the batch divisibility of
``experiments.training.checks`` (the global batch splits evenly over dp x grad_accum x
micro-batches), offload only with ZeRO >= 1 (``experiments.train.build_engine``) and tied
embeddings only where the embedding and the head land on one pipeline rank
(``moe.model.Transformer.keep_layers``), the MoE dispatch ``parallel.ep_dispatch`` by
``zero.layout.validate_ep_dispatch`` (``node`` only where the ep group spans two or more whole
nodes, so only where the node size is known), and ``parallel.pp_overlap`` by
``zero.pipeline.validate_pp_overlap`` and ``experiments.training.build.build_plan`` (only under a
schedule with overlapped forward-backward pairs, ``OVERLAP_SCHEDULES``, so never without a
pipeline). The tests check the two agree, both ways.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..layout import validate_ep_dispatch, validate_layout
from ..pipeline import OVERLAP_SCHEDULES, SCHEDULES, PipelinePlan, plan_pipeline, validate_pp_overlap

# the keys a layout sets, as the trainer's config names them
KEYS = {
    "pp": "parallel.pp",
    "ep": "parallel.ep",
    "ep_dispatch": "parallel.ep_dispatch",
    "zero_stage": "parallel.zero_stage",
    "zero_offload": "parallel.zero_offload",
    "pp_schedule": "parallel.pp_schedule",
    "pp_virtual_stages": "parallel.pp_virtual_stages",
    "pp_microbatches": "parallel.pp_microbatches",
    "pp_layers": "parallel.pp_layers",
    "pp_overlap": "parallel.pp_overlap",
    "checkpoint_activations": "model.checkpoint_activations",
    "grad_accum": "train.grad_accum",
    "zero_hpz": "parallel.zero_hpz",
    "zero_qwz": "parallel.zero_qwz",
    "zero_qgz": "parallel.zero_qgz",
    "zero_qgz_bits": "parallel.zero_qgz_bits",
}
# ZeRO++ (zero.zeropp): listed only when asked (``zeropp=True``): qwZ and qgZ change the numbers
ZEROPP = ("zero_hpz", "zero_qwz", "zero_qgz")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fmt(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


@dataclass(frozen=True)
class LayoutRecord:
    """One way to run a training step: the parallel sizes and the trainer's keys that set them.
    ``world`` and ``batch_size`` (global sequences per step) are the workload's, the rest the
    layout's; ``mixed_precision`` is ``parallel.zero_mixed_precision``, taken from the config."""

    world: int
    batch_size: int
    pp: int = 1
    ep: int = 1
    # parallel.ep_dispatch: flat (one All-to-All over the ep group, a row per routed slot) or node
    # (a token crosses to each node it needs once, then to its experts inside the node)
    ep_dispatch: str = "flat"
    zero_stage: int = 0
    zero_offload: bool = False
    pp_schedule: str | None = None  # None for pp=1 (no pipeline)
    pp_virtual_stages: int = 1
    pp_microbatches: int = 1
    checkpoint_activations: bool = False
    grad_accum: int = 1
    mixed_precision: str = "fp32"
    zero_hpz: bool = False
    zero_qwz: bool = False
    zero_qgz: bool = False
    zero_qgz_bits: int = 4
    zero_quant_block: int = 256  # parallel.zero_quant_block: elements per fp32 scale (qwZ, qgZ)
    # layers of each pipeline stage in order (parallel.pp_layers); None: the even split
    pp_layers: tuple[int, ...] | None = None
    # parallel.pp_overlap: each of DualPipeV's overlapped forward-backward pairs runs its two passes
    # at once, so that one pass's All-to-All waits beside the other's compute
    pp_overlap: bool = False

    @property
    def zeropp(self) -> bool:
        return self.zero_hpz or self.zero_qwz or self.zero_qgz

    @property
    def dp(self) -> int:
        return self.world // self.pp

    @property
    def edp(self) -> int:
        return self.dp // self.ep

    @property
    def microbatches(self) -> int:
        """Micro-batches through the pipeline per accumulation round (1 without a pipeline)."""
        return self.pp_microbatches if self.pp > 1 else 1

    @property
    def micro_rows(self) -> int:
        """Sequences of one micro-batch on one rank."""
        return self.batch_size // (self.dp * self.grad_accum * self.microbatches)

    def plan(self, num_layers: int) -> PipelinePlan | None:
        if self.pp == 1:
            return None
        return plan_pipeline(
            num_layers,
            pp=self.pp,
            pp_schedule=self.pp_schedule,
            pp_microbatches=self.pp_microbatches,
            pp_virtual_stages=self.pp_virtual_stages,
            pp_layers=None if self.pp_layers is None else list(self.pp_layers),
            pp_overlap=self.pp_overlap,
        )

    def overrides(self) -> list[str]:
        """The trainer's Hydra overrides that run this layout (with ``torchrun --nproc_per_node``
        = ``world`` on one node, or its multi-node equivalent)."""
        names = ["pp", "ep", *(["ep_dispatch"] if self.ep_dispatch != "flat" else []), "zero_stage", "zero_offload"]
        if self.pp > 1:
            names += ["pp_schedule", "pp_virtual_stages", "pp_microbatches"]
            if self.pp_layers is not None:  # the even split is the trainer's default
                names.append("pp_layers")
        if self.pp_overlap:  # off is the trainer's default (and the only value without a pipeline)
            names.append("pp_overlap")
        names += ["checkpoint_activations", "grad_accum"]
        if self.zeropp:  # the ZeRO++ keys only where one is on (off is the trainer's default)
            names += [*ZEROPP, *(["zero_qgz_bits"] if self.zero_qgz else [])]
        # zero_offload: the trainer's none | cpu (the planner does not model nvme)
        value = {"zero_offload": lambda v: "cpu" if v else "none", "pp_layers": lambda v: f"[{','.join(map(str, v))}]"}
        return [f"{KEYS[k]}={value.get(k, _fmt)(getattr(self, k))}" for k in names]

    def label(self) -> str:
        parts = [f"pp{self.pp}"]
        if self.pp > 1:
            v = f"x{self.pp_virtual_stages}" if self.pp_virtual_stages > 1 else ""
            parts.append(f"{self.pp_schedule}{v} m{self.pp_microbatches}" + (" overlap" if self.pp_overlap else ""))
            if self.pp_layers is not None:
                parts.append("layers " + "/".join(map(str, self.pp_layers)))
        parts.append(f"dp{self.dp} ep{self.ep}" + (" epnode" if self.ep_dispatch == "node" else ""))
        parts.append(f"z{self.zero_stage}{'+off' if self.zero_offload else ''}")
        if self.grad_accum > 1:
            parts.append(f"ga{self.grad_accum}")
        if self.checkpoint_activations:
            parts.append("ckpt")
        zpp = [n for n, on in (("hpZ", self.zero_hpz), ("qwZ", self.zero_qwz)) if on]
        zpp += [f"qgZ{self.zero_qgz_bits}"] if self.zero_qgz else []
        if zpp:
            parts.append("+".join(zpp))
        return " ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)


def group_split(rec: LayoutRecord, kind: str, node_size: int) -> tuple[int, int] | None:
    """``(n, k)`` of the first pipeline rank's ``dp`` or ``edp`` group (``zero.Layout``'s
    groups: dp consecutive ranks, edp every ep-th of them): the nodes of ``node_size`` ranks it
    spans and its members on each, or None when nodes hold different numbers of its members."""
    ranks = range(rec.dp) if kind == "dp" else range(0, rec.dp, rec.ep)
    per_node: dict[int, int] = {}
    for r in ranks:
        per_node[r // node_size] = per_node.get(r // node_size, 0) + 1
    counts = set(per_node.values())
    return (len(per_node), counts.pop()) if len(counts) == 1 else None


def zeropp_problem(rec: LayoutRecord, node_size: int | None) -> str | None:
    """Why ``zero.zeropp.check_options`` would refuse ``rec``'s ZeRO++ options (its rules), or None."""
    if (rec.zero_hpz or rec.zero_qwz) and rec.zero_stage != 3:
        return f"parallel.zero_hpz / zero_qwz need parallel.zero_stage=3, got {rec.zero_stage}"
    if rec.zero_qgz and rec.zero_stage == 0:
        return "parallel.zero_qgz=true needs parallel.zero_stage 1, 2 or 3"
    if rec.zero_qgz_bits not in (4, 8):
        return f"parallel.zero_qgz_bits={rec.zero_qgz_bits!r} is invalid: expected 4 or 8"
    if (rec.zero_hpz or rec.zero_qgz) and node_size is not None:
        for kind in ("dp", "edp"):
            if group_split(rec, kind, node_size) is None:
                return f"hpz / qgz need every {kind} group evenly on its nodes; node_size={node_size}, dp={rec.dp}"
    return None


def ep_dispatch_problem(rec: LayoutRecord, node_size: int | None) -> str | None:
    """Why ``zero.layout.validate_ep_dispatch`` would refuse ``rec``'s ``ep_dispatch`` (its own
    message), or None; ``node`` cannot be judged without the node size, so it is refused then."""
    if rec.ep_dispatch == "node" and node_size is None:
        return (
            f"parallel.ep_dispatch=node needs the ranks per node to check that each ep group (ep={rec.ep}) spans "
            "two or more whole nodes: give node_size, or use parallel.ep_dispatch=flat"
        )
    try:
        validate_ep_dispatch(rec.ep_dispatch, rec.ep, 1 if node_size is None else node_size, "parallel.ep_dispatch")
    except ValueError as e:
        return str(e)
    return None


def pp_overlap_problem(rec: LayoutRecord) -> str | None:
    """Why the trainer would refuse ``rec``'s ``pp_overlap`` (``zero.pipeline.validate_pp_overlap``'s
    message, or ``build_plan``'s without a pipeline), or None."""
    if rec.pp_overlap is False:
        return None
    if rec.pp_overlap is True and rec.pp == 1:
        return (
            "parallel.pp_overlap=true overlaps a pipeline's forward-backward pairs, but parallel.pp=1: use "
            "parallel.pp >= 2 with parallel.pp_schedule=dualpipev, or parallel.pp_overlap=false"
        )
    try:
        validate_pp_overlap(rec.pp_schedule, rec.pp_overlap)
    except ValueError as e:
        return f"parallel.{e}"
    return None


def layout_problem(
    rec: LayoutRecord,
    num_layers: int,
    num_experts: int | None = None,
    tied: tuple[int, int] | None = None,
    node_size: int | None = None,
) -> str | None:
    """Why the trainer would refuse ``rec`` (its own message), or None when it accepts it.
    ``node_size``: ranks per node, for the ZeRO++ options' node rules (None: not checked) and
    ``ep_dispatch=node``'s (None: refused, as it cannot be checked)."""
    try:
        validate_layout(rec.world, rec.pp, rec.ep, num_experts)
    except ValueError as e:
        return str(e)
    problem = ep_dispatch_problem(rec, node_size)
    if problem is not None:
        return problem
    if rec.zero_stage not in (0, 1, 2, 3):
        return f"parallel.zero_stage={rec.zero_stage!r} is invalid: expected 0, 1, 2 or 3"
    if rec.zero_offload and rec.zero_stage == 0:
        return "parallel.zero_offload=cpu needs parallel.zero_stage >= 1"
    problem = zeropp_problem(rec, node_size)
    if problem is not None:
        return problem
    problem = pp_overlap_problem(rec)
    if problem is not None:
        return problem
    if rec.grad_accum < 1 or rec.batch_size % (rec.dp * rec.grad_accum):
        return f"train.batch_size={rec.batch_size} must be divisible by dp={rec.dp} x train.grad_accum={rec.grad_accum}"
    try:
        plan = rec.plan(num_layers)
    except ValueError as e:
        return f"parallel.{e}"
    if plan is None:
        return None
    if rec.batch_size % (rec.dp * rec.grad_accum * plan.microbatches):
        return (
            f"train.batch_size={rec.batch_size} must be divisible by dp={rec.dp} x train.grad_accum={rec.grad_accum} "
            f"x parallel.pp_microbatches={plan.microbatches}"
        )
    if tied is not None:
        a, b = (next(s for s, (lo, hi) in enumerate(plan.ranges) if lo <= i < hi) for i in tied)
        if plan.rank_of(a) != plan.rank_of(b):
            return (
                f"tied weights of layers {tied[0]} and {tied[1]} land on pipeline ranks {plan.rank_of(a)} and "
                f"{plan.rank_of(b)}: untie them (model.tie_embeddings=false) or use a V-shaped schedule"
            )
    return None


def enumerate_layouts(
    num_layers: int,
    *,
    world: int,
    batch_size: int,
    num_experts: int | None = None,
    tied: tuple[int, int] | None = None,
    mixed_precision: str = "fp32",
    fixed: dict | None = None,
    max_virtual: int | None = None,
    zeropp: bool = False,
    node_size: int | None = None,
) -> list[LayoutRecord]:
    """Every layout the trainer accepts for ``num_layers`` pipeline layers (the embedding, the
    blocks, the head), ``world`` ranks and ``batch_size`` global sequences, in a fixed order.
    ``num_experts``: the routed experts of the MoE layers (None: a dense model, ep=1); ``tied``:
    the two layers that share weights (tied embeddings); ``fixed``: keys (``LayoutRecord`` field
    names) held at one value, e.g. ``{"pp": 16, "ep": 64}`` (``pp_layers``: only the pipelines of
    that many stages, cut that way; unheld, every pipeline takes the even split, and
    ``zero.plan.balance`` adds the cut its layers' costs ask for); ``max_virtual``: the most virtual
    stages per rank tried for the interleaved schedules (default: as many as the layers allow).
    ``zeropp``: also every valid combination of ZeRO++'s hpZ, qwZ and qgZ (int4) for ZeRO-1 to 3,
    with ``node_size`` ranks per node (needed: hpZ and qgZ need each group evenly on its nodes);
    off by default, since qwZ and qgZ quantize the weights and gradients they move. ``node_size``
    given, every ep that spans two or more whole nodes is also listed with ``ep_dispatch=node``
    (a token crosses to each node once); without it only ``flat``. A schedule with overlapped
    forward-backward pairs (``OVERLAP_SCHEDULES``: dualpipev) is listed with ``pp_overlap`` off,
    then on (the pairs' two passes at once)."""
    if zeropp and (not isinstance(node_size, int) or isinstance(node_size, bool) or node_size < 1):
        raise ValueError(f"zeropp=True needs node_size, the ranks per node (a positive integer), got {node_size!r}")
    for name, v in (("world", world), ("batch_size", batch_size), ("num_layers", num_layers)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r} is invalid: expected a positive integer")
    fixed = dict(fixed or {})
    unknown = sorted(set(fixed) - set(KEYS))
    if unknown:
        raise ValueError(f"fixed keys {unknown} are not layout keys; valid: {sorted(KEYS)}")
    if fixed.get("ep_dispatch") == "node" and node_size is None:
        raise ValueError("fixed ep_dispatch='node' needs node_size, the ranks per node (node needs whole nodes)")
    # a split held (parallel.pp_layers): the pipelines of that many stages, cut that way
    split = fixed.pop("pp_layers", None)
    if split is not None:
        split = tuple(split)
        if not split or any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in split):
            raise ValueError(f"pp_layers={list(split)} is invalid: expected a list of positive integers")

    def allowed(key, values):
        return [v for v in values if key not in fixed or fixed[key] == v]

    out = []
    for pp in allowed("pp", _divisors(world)):
        if split is not None and pp == 1:
            continue
        dp = world // pp
        eps = [e for e in _divisors(dp) if num_experts is not None and num_experts % e == 0] or [1]
        pipelines: list[tuple] = [(None, 1, 1, False)] if allowed("pp_overlap", [False]) else []
        if pp > 1:
            pipelines = []
            for schedule in allowed("pp_schedule", list(SCHEDULES)):
                style = SCHEDULES[schedule][1]
                vs = {"single": [1], "v": [2]}.get(style) or list(range(2, num_layers // pp + 1))
                if style == "loop" and max_virtual is not None:
                    vs = [v for v in vs if v <= max_virtual]
                # each schedule with overlapped pairs both ways: the pairs one pass after the other, and at once
                overlaps = allowed("pp_overlap", [False, True] if schedule in OVERLAP_SCHEDULES else [False])
                for v in allowed("pp_virtual_stages", vs):
                    for m in allowed("pp_microbatches", _divisors(batch_size // dp) if batch_size % dp == 0 else []):
                        pipelines += [(schedule, v, m, overlap) for overlap in overlaps]
        for ep, dispatch in [(e, d) for e in allowed("ep", eps) for d in _dispatch_choices(e, node_size, allowed)]:
            for schedule, v, m, overlap in pipelines:
                for ga in allowed("grad_accum", _divisors(batch_size)):
                    base = LayoutRecord(
                        world=world,
                        batch_size=batch_size,
                        pp=pp,
                        ep=ep,
                        ep_dispatch=dispatch,
                        pp_schedule=schedule,
                        pp_virtual_stages=v,
                        pp_microbatches=m,
                        pp_overlap=overlap,
                        grad_accum=ga,
                        mixed_precision=mixed_precision,
                        pp_layers=split if pp > 1 else None,
                    )
                    if layout_problem(base, num_layers, num_experts, tied, node_size) is not None:
                        continue
                    for stage in allowed("zero_stage", [0, 1, 2, 3]):
                        for off in allowed("zero_offload", [False, True] if stage else [False]):
                            for ckpt in allowed("checkpoint_activations", [False, True]):
                                rec = replace(base, zero_stage=stage, zero_offload=off, checkpoint_activations=ckpt)
                                for opts in _zeropp_choices(rec, zeropp, node_size, allowed):
                                    out.append(replace(rec, **opts))
    return out


def _dispatch_choices(ep: int, node_size: int | None, allowed) -> list[str]:
    """``flat`` always; ``node`` too where the node size is known and the trainer takes it."""
    rec = LayoutRecord(world=ep, batch_size=1, ep=ep, ep_dispatch="node")
    node = [] if node_size is None or ep_dispatch_problem(rec, node_size) is not None else ["node"]
    return allowed("ep_dispatch", ["flat", *node])


def _zeropp_choices(rec: LayoutRecord, zeropp: bool, node_size: int | None, allowed) -> list[dict]:
    if not zeropp:
        return [{}]
    out = []
    for hpz in allowed("zero_hpz", [False, True]):
        for qwz in allowed("zero_qwz", [False, True]):
            for qgz in allowed("zero_qgz", [False, True]):
                opts = {"zero_hpz": hpz, "zero_qwz": qwz, "zero_qgz": qgz}
                if zeropp_problem(replace(rec, **opts), node_size) is None:
                    out.append(opts)
    return out
