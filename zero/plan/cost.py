"""The cost model: per-rank peak memory and step time of a layout, from each block's costs and a
machine profile. A pure function: nothing runs the model.

Inputs. ``ModelCosts``: one ``BlockCost`` per pipeline layer (the embedding, each block, the head)
with its parameters (dense and expert), its forward matrix products, and its bytes per token
(saved for backward, handed to the next layer, moved by All-to-All); ``moe.costs`` builds them
from a ``TransformerConfig``. ``LayoutRecord``: the layout (``zero.plan.enumerate``). ``Profile``:
the machine (``zero.plan.profile``).

Memory per rank (``memory_parts``, adding up to ``memory_bytes``), the busiest pipeline rank:
    model_states    weights, gradients and optimizer state: ``zero.memory.predict_memory`` of the
                    layers the rank holds, exactly
    gathered_params ZeRO-3: the full weights of the blocks gathered at once: the block computing
                    and the one prefetched (``zero.gather``: two at most), plus a tied weight (the
                    root unit, gathered for the whole pass); under a pipeline the engine keeps a
                    stage's blocks gathered for the whole step, so all of them
    grad_buffers    ZeRO-2/3: the full-size local gradient buffers; ``zero.flat`` frees them only
                    once the step's reductions are waited for, so during a backward they add to the
                    shards ``predict_memory`` counts
    activations     saved for backward, per micro-batch times the number the schedule keeps alive
                    (from the schedule's own order: forwards whose backward has not run; 1 without
                    a pipeline), at the mean expert load
    expert_rows     the routed rows beyond the mean load, at the worst case: under a capacity
                    E_local x capacity bounds them exactly; dropless takes ``skew`` (default the
                    worst case: every token of the ep group routed to this rank's experts)
    a2a_buffers     one MoE layer's send and receive buffers of rows (worst case)
    workspace       the backward's working memory of one layer (the loss's fp32 logits at the
                    head), and with activation checkpointing the recomputed block's activations

Step time. Each matrix product at the profile's FLOP/s for its size, each elementwise byte at its
memory bandwidth, each operator a fixed overhead, and each collective by the α-β model of its link
tier (a group inside one node: ``intra``; else ``inter``; All-to-All splits its bytes between the
two). The overlaps are the engine's: ZeRO-3 prefetches the next block's gather while a block
computes (max per block, the first gather exposed); gradient reductions start per block as soon as
its gradients are complete (overlapping the rest of that backward) without a pipeline, and after a
rank's last backward with one (``Pipeline`` calls ``start_reduction``); the MoE layer's
All-to-All, its statistics all-reduce and the capacity gather are synchronous (summed). The
pipeline's length comes from simulating the schedule's own order with each stage's forward,
backward-input and backward-weight durations and the point-to-point time of an activation between
ranks; every accumulation round runs a whole pipeline (fill and drain). Then the optimizer: Adam's
passes over this rank's shard at memory bandwidth, or with offload the host's rate plus the copies
over the host link, and ZeRO-1/2's all-gather of the updated weights.

What it leaves out: computation overlapping an All-to-All (DeepEP, DualPipe's overlapped pairs as
a speed-up: they are run one after the other, as torch's runtime does), FP8, tensor and sequence
parallelism, kernel fusion beyond a fixed per-operator cost, network contention between groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..memory import predict_memory
from .enumerate import LayoutRecord
from .profile import Profile, bus_factor, steps
from .schedule import live_plan, simulate_plan

# Adam (torch's foreach/fused AdamW) per parameter of this rank's shard, bytes through memory:
# the master weight, both moments read and written (3 x 4 x 2), the gradient read, scaled by 1/dp
# and clip in place (c x 3), the compute weight written back (c), the norm's read (c)
_ADAM_FP32_BYTES = 24


@dataclass(frozen=True)
class MatMul:
    """One matrix product of a block's forward, per token: ``[rows, k] @ [k, n]``."""

    k: int
    n: int
    rows_per_token: float = 1.0  # rows per token (top_k for the routed experts)
    expert: bool = False  # the routed experts' product: rows spread over the experts
    weight: bool = True  # False: attention's scores and weighted values (no weight gradient)
    fixed_rows: int | None = None  # the rows of one product when they are not tokens (attention: L)
    work: float = 1.0  # share of the product computed (causal attention skips the upper half)
    count: int = 1  # products of this shape per token (attention: the heads)

    def flops_per_token(self) -> float:
        return 2.0 * self.k * self.n * self.rows_per_token * self.count * self.work


@dataclass(frozen=True)
class BlockCost:
    """One pipeline layer's costs. Counts are of the whole model (``params_expert``: every
    expert of the layer); bytes are per token and in the dtypes the model runs in."""

    name: str
    params_dense: int = 0
    params_expert: int = 0
    matmuls: tuple[MatMul, ...] = ()
    elementwise_bytes: float = 0.0  # forward: bytes the non-matmul operators read and write
    ops: int = 0  # forward operators launched (the backward launches about twice as many)
    act_bytes: float = 0.0  # saved for backward
    act_bytes_checkpointed: float = 0.0  # saved under activation checkpointing (the block's input)
    wgrad_bytes: float = 0.0  # of act_bytes: what the weight pass still needs after the input pass
    transient_bytes: float = 0.0  # the backward's working memory beyond what is saved
    boundary_bytes: float = 0.0  # handed to the next layer (a pipeline's point-to-point)
    # MoE layers
    num_experts: int = 0
    top_k: int = 0
    capacity_factor: float | None = None
    expert_row_bytes: float = 0.0  # saved per routed row (part of act_bytes at top_k rows per token)
    row_bytes: float = 0.0  # one routed row as the All-to-All moves it
    stats_bytes: float = 0.0  # the routing statistics all-reduced over dp each forward
    routing_bytes: float = 0.0  # per token, what a capacity's decision gathers over dp (ids and weights)
    shares_params_with: int | None = None  # tied: the layer whose weight this one uses (held once)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


@dataclass(frozen=True)
class ModelCosts:
    blocks: tuple[BlockCost, ...]
    seq_len: int
    act_dtype: str = "fp32"  # what the matrix products run in: fp32 or bf16
    name: str = ""

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    @property
    def num_experts(self) -> int | None:
        es = {b.num_experts for b in self.blocks if b.is_moe}
        if len(es) > 1:
            raise ValueError(f"MoE layers with different expert counts {sorted(es)}: one ep cannot divide all")
        return es.pop() if es else None

    @property
    def tied(self) -> tuple[int, int] | None:
        for i, b in enumerate(self.blocks):
            if b.shares_params_with is not None:
                return (b.shares_params_with, i)
        return None

    def param_counts(self) -> dict[str, int]:
        return {
            "dense": sum(b.params_dense for b in self.blocks),
            "expert": sum(b.params_expert for b in self.blocks),
        }

    def model_flops_per_token(self) -> float:
        """Training FLOPs per token, forward and backward (3x the forward's matrix products), the
        MFU convention: causal attention not discounted, no recomputation."""
        total = 0.0
        for b in self.blocks:
            for mm in b.matmuls:
                total += 3 * mm.flops_per_token() / mm.work
        return total


@dataclass(frozen=True)
class Prediction:
    memory_bytes: float  # the busiest rank's device peak
    memory_parts: dict[str, float]  # adds up to memory_bytes
    step_s: float
    time_parts: dict[str, float] = field(default_factory=dict)  # seconds, a breakdown (not a sum)
    host_bytes: float = 0.0  # per rank: ZeRO-Offload's optimizer state in host memory
    fits: bool = True
    tokens_per_s: float = 0.0  # global
    bubble: float = 0.0  # the pipeline's idle fraction (0 without a pipeline)
    live_microbatches: int = 1  # the most micro-batches' activations alive at once on a rank

    def to_dict(self) -> dict:
        return {
            "memory_bytes": self.memory_bytes,
            "memory_parts": dict(self.memory_parts),
            "step_s": self.step_s,
            "time_parts": dict(self.time_parts),
            "host_bytes": self.host_bytes,
            "fits": self.fits,
            "tokens_per_s": self.tokens_per_s,
            "bubble": self.bubble,
            "live_microbatches": self.live_microbatches,
        }


PARTS = ("model_states", "gathered_params", "grad_buffers", "activations", "expert_rows", "a2a_buffers", "workspace")


class _Groups:
    """The process groups of one rank (the first of its pipeline stage), as ``zero.Layout`` builds
    them, and which link tier each one's collectives cross."""

    def __init__(self, rec: LayoutRecord, node_size: int, pp_rank: int = 0):
        dp, ep, base = rec.dp, rec.ep, pp_rank * rec.dp
        self.node_size = node_size
        self.dp = list(range(base, base + dp))
        self.ep = list(range(base, base + ep))
        self.edp = list(range(base, base + dp, ep))

    def nodes(self, ranks) -> int:
        # groups are runs of ranks with one stride: count the nodes from the ends
        if len(ranks) < 2:
            return 1
        first, stride = ranks[0], ranks[1] - ranks[0]
        if stride >= self.node_size:
            return len(ranks)
        return ranks[-1] // self.node_size - first // self.node_size + 1


class _Costing:
    """Times and bytes of one layout on one profile (the pieces ``predict`` combines)."""

    def __init__(self, rec: LayoutRecord, costs: ModelCosts, profile: Profile, skew: float | None):
        self.rec, self.costs, self.profile, self.skew = rec, costs, profile, skew
        self.c_w = 2 if rec.mixed_precision == "bf16" else 4  # the engine's compute weights and gradients
        self.dtype = "bf16" if (costs.act_dtype == "bf16" or rec.mixed_precision == "bf16") else "fp32"
        self.tokens = rec.micro_rows * costs.seq_len  # of one micro-batch on one rank
        self.groups = _Groups(rec, profile.node_size)
        # ranks of one node share its compute slots (a CPU's cores) with each other and with the
        # node's other work: each gets slots / (ranks + background) of one when that is below 1
        per_node = min(rec.world, profile.node_size)
        self.contention = max(1.0, (per_node + profile.background_load) / profile.slots)

    # ----- collectives ---------------------------------------------------------------------------
    def coll(self, op: str, nbytes: float, ranks) -> float:
        n = len(ranks)
        if n <= 1 or nbytes < 0:
            return 0.0
        p = self.profile
        nodes = self.groups.nodes(ranks)
        if nodes == 1:
            return p.link("intra", op).time(op, nbytes, n)
        if op != "all_to_all":
            return p.link("inter", op).time(op, nbytes, n)
        # All-to-All: the bytes to peers of this node go over the intra links, the rest over the
        # inter ones, both at once; the steps are paid on the slower tier
        local = n // nodes
        intra, inter = p.link("intra", op), p.link("inter", op)
        t_intra = bus_factor(op, n) * nbytes * (local - 1) / (n - 1) / intra.beta
        t_inter = bus_factor(op, n) * nbytes * (n - local) / (n - 1) / inter.beta
        return steps(op, n) * inter.alpha + max(t_intra, t_inter)

    def p2p(self, nbytes: float, a: int, b: int) -> float:
        tier = "intra" if a // self.profile.node_size == b // self.profile.node_size else "inter"
        return self.profile.link(tier, "p2p").time("p2p", nbytes, 2)

    # ----- one layer -----------------------------------------------------------------------------
    def rows(self, b: BlockCost) -> tuple[float, float]:
        """(mean, worst case) routed rows this rank's experts take in one micro-batch."""
        rec, T = self.rec, self.tokens
        X = b.num_experts // rec.ep
        mean = T * b.top_k
        bound = rec.ep * T * min(b.top_k, X)  # every token of the ep group sent here, once per local expert
        if b.capacity_factor is not None:
            # capacity decides over the whole dp batch (moe.router), ceil(cf k T_dp / E) per expert
            cap = math.ceil(b.capacity_factor * b.top_k * T * rec.dp / b.num_experts)
            worst = min(X * cap, bound)
            return min(mean, worst), worst
        worst = bound if self.skew is None else min(self.skew * mean, bound)
        return mean, max(worst, mean)

    def compute(self, b: BlockCost) -> dict[str, float]:
        """Seconds of one micro-batch's F, I and W passes of layer ``b`` on this rank, compute only."""
        p, rec, T = self.profile, self.rec, self.tokens
        f = i = w = 0.0
        for mm in b.matmuls:
            if mm.expert:
                X = b.num_experts // rec.ep
                rows = T * mm.rows_per_token * rec.ep / b.num_experts  # per local expert, mean load
                flops = 2.0 * mm.k * mm.n * rows * X * mm.work
            else:
                rows = mm.fixed_rows or T * mm.rows_per_token
                flops = mm.flops_per_token() * T
            t = flops / p.matmul_rate(self.dtype, rows, mm.k, mm.n)
            if mm.weight:  # the roofline: a thin product is bound by its operands' bytes
                c = 2 if self.dtype == "bf16" else 4
                products = b.num_experts // rec.ep if mm.expert else 1
                t = max(t, c * products * (rows * mm.k + mm.k * mm.n + rows * mm.n) / p.memory_bandwidth)
            f += t
            if mm.weight:
                i += t
                w += t
            else:  # attention's backward: dQ, dK, dV and the recomputed scores, ~2.5x its forward
                i += 2.5 * t
        held = b.params_dense + b.params_expert / rec.ep
        weights = held * self.c_w / p.memory_bandwidth  # each pass reads the weights once
        elem = T * b.elementwise_bytes / p.memory_bandwidth
        # the backward dispatches ~1.7x the forward's operators (counted: 1.5x for an MoE block,
        # 1.9x for a dense one) and moves ~2.3x its bytes, most of both for the input gradient
        f += elem + weights + b.ops * p.op_overhead_s
        i += 1.6 * elem + weights + 1.2 * b.ops * p.op_overhead_s
        w += 0.7 * elem + weights + 0.5 * b.ops * p.op_overhead_s
        k = self.contention
        return {"F": f * k, "I": i * k, "W": w * k}

    def moe_comm(self, b: BlockCost) -> dict[str, float]:
        """Synchronous communication of an MoE layer per micro-batch: F and I (the backward)."""
        if not b.is_moe:
            return {"F": 0.0, "I": 0.0}
        rec, g = self.rec, self.groups
        f = i = 0.0
        if rec.dp > 1:
            f += self.coll("all_reduce", b.stats_bytes, g.dp)
            if b.capacity_factor is not None:
                f += self.coll("all_gather", b.routing_bytes * self.tokens * rec.dp, g.dp)
        if rec.ep > 1:
            mean, _ = self.rows(b)
            a2a = self.coll("all_to_all", mean * b.row_bytes, g.ep)
            counts = self.coll("all_to_all", 8 * b.num_experts, g.ep)
            f += 2 * a2a + counts  # dispatch and combine, and the counts before them
            i += 2 * a2a
        return {"F": f, "I": i}

    def gather(self, b: BlockCost) -> float:
        """ZeRO-3: the all-gather of one layer's weights."""
        rec, g = self.rec, self.groups
        if rec.zero_stage != 3 or b.shares_params_with is not None:
            return 0.0
        t = self.coll("all_gather", b.params_dense * self.c_w, g.dp)
        if rec.edp > 1:
            t += self.coll("all_gather", b.params_expert / rec.ep * self.c_w, g.edp)
        return t

    def reduce(self, b: BlockCost) -> float:
        """The gradient reduction of one layer: all-reduce (ZeRO-0) or reduce-scatter (1-3), dense
        over dp and expert over edp."""
        rec, g = self.rec, self.groups
        op = "all_reduce" if rec.zero_stage == 0 else "reduce_scatter"
        return self.coll(op, b.params_dense * self.c_w, g.dp) + self.coll(
            op, b.params_expert / rec.ep * self.c_w, g.edp
        )

    def post_step_gather(self, layers) -> float:
        rec, g = self.rec, self.groups
        if rec.zero_stage not in (1, 2):
            return 0.0
        dense = sum(b.params_dense for b in layers)
        expert = sum(b.params_expert for b in layers) / rec.ep
        return self.coll("all_gather", dense * self.c_w, g.dp) + self.coll("all_gather", expert * self.c_w, g.edp)

    def optimizer(self, layers) -> float:
        rec, p = self.rec, self.profile
        dense = sum(b.params_dense for b in layers)
        expert = sum(b.params_expert for b in layers) / rec.ep
        n = dense / (rec.dp if rec.zero_stage else 1) + expert / (rec.edp if rec.zero_stage else 1)
        if rec.zero_offload:
            # gradients out to the host and the updated compute weights back, one direction each
            copies = 2 * n * self.c_w / p.host_link_bandwidth
            return n / p.host_adam_params_per_s + copies
        return n * (_ADAM_FP32_BYTES + 3 * self.c_w) / p.memory_bandwidth * self.contention


# per-layer terms depend on fewer keys than a layout has (not on offload, checkpointing, the
# schedule): cached across the thousands of layouts one enumeration predicts. The key holds the
# costs and profile objects themselves, so their ids cannot be reused while an entry lives
_TERMS: dict = {}


def _layer_terms(cst: _Costing):
    rec = cst.rec
    key = (id(cst.costs), id(cst.profile), rec.world, rec.dp, rec.ep, rec.micro_rows, rec.zero_stage)
    key += (rec.mixed_precision, cst.skew)
    hit = _TERMS.get(key)
    if hit is not None and hit[0] is cst.costs and hit[1] is cst.profile:
        return hit[2]
    blocks = cst.costs.blocks
    terms = (
        [cst.compute(b) for b in blocks],
        [cst.moe_comm(b) for b in blocks],
        [cst.gather(b) for b in blocks],
        [cst.reduce(b) for b in blocks],
    )
    if len(_TERMS) > 4096:
        _TERMS.clear()
    _TERMS[key] = (cst.costs, cst.profile, terms)
    return terms


def _stream(compute: list[float], comm: list[float]) -> float:
    """A chain of layers whose communication runs one ahead of the compute (ZeRO-3's prefetch:
    the next layer's gather starts when the current layer starts): the first gather is exposed,
    then each layer takes the longer of its compute and the next gather."""
    if not compute:
        return 0.0
    t_comm = comm[0]
    t = t_comm
    for j, c in enumerate(compute):
        start = t
        t = start + c
        if j + 1 < len(comm):
            t_comm = max(t_comm, start) + comm[j + 1]
            t = max(t, t_comm)
    return t


def _overlapped_reduction(compute_rev: list[float], reduce_rev: list[float]) -> float:
    """A backward over layers (in backward order) whose reductions start as each layer's gradients
    are complete, one at a time: the end of the last reduction."""
    t = t_red = 0.0
    for c, r in zip(compute_rev, reduce_rev):
        t += c
        t_red = max(t_red, t) + r
    return max(t, t_red)


def predict(rec: LayoutRecord, costs: ModelCosts, profile: Profile, *, skew: float | None = None) -> Prediction:
    """Peak memory per rank and step time of layout ``rec`` (see the module docstring). ``skew``:
    the dropless MoE layers' worst rows over the mean (default: the worst case possible)."""
    blocks = costs.blocks
    L = len(blocks)
    plan = rec.plan(L)
    cst = _Costing(rec, costs, profile, skew)
    T = cst.tokens
    if T < 1:
        raise ValueError(f"layout {rec.label()}: a micro-batch has no rows (batch_size={rec.batch_size})")
    ckpt = rec.checkpoint_activations
    stages = [(0, L)] if plan is None else list(plan.ranges)

    # per layer: passes, communication, memory per token
    comp, moe, gath, red = _layer_terms(cst)

    def layer_f(j):
        return comp[j]["F"] + moe[j]["F"]

    def layer_i(j):
        return comp[j]["I"] + moe[j]["I"] + (layer_f(j) if ckpt else 0.0)  # recomputation

    def layer_w(j):
        return comp[j]["W"]

    def saved(j):
        b = blocks[j]
        return (b.act_bytes_checkpointed if ckpt else b.act_bytes) * T

    def extra_rows(j):
        b = blocks[j]
        if not b.is_moe or ckpt:
            return 0.0
        mean, worst = cst.rows(b)
        return (worst - mean) * b.expert_row_bytes

    def keep(j):
        b = blocks[j]
        return 0.0 if ckpt else min(b.wgrad_bytes, b.act_bytes) * T

    # ----- memory: each pipeline rank --------------------------------------------------------
    ranks = range(rec.pp)
    rank_stages = [[0] for _ in ranks] if plan is None else [plan.stages_of(r) for r in ranks]
    rank_layers = [[j for s in rank_stages[r] for j in range(*stages[s])] for r in ranks]
    if plan is not None:
        stage_act = [sum(saved(j) for j in range(*stages[s])) for s in range(len(stages))]
        stage_keep = [sum(keep(j) for j in range(*stages[s])) for s in range(len(stages))]
        stage_extra = [sum(extra_rows(j) for j in range(*stages[s])) for s in range(len(stages))]
        live = live_plan(plan, stage_act, stage_keep, stage_extra)
    per_rank = []
    for r in ranks:
        layers = rank_layers[r]
        # a tied weight is counted once, in the layer that owns it (the head's cost leaves it out)
        counts = {
            "dense": sum(blocks[j].params_dense for j in layers),
            "expert": sum(blocks[j].params_expert for j in layers),
        }
        ms = predict_memory(
            counts,
            dp=rec.dp,
            ep=rec.ep,
            stage=rec.zero_stage,
            mixed_precision=rec.mixed_precision,
            offload=rec.zero_offload,
        )
        parts = dict.fromkeys(PARTS, 0.0)
        parts["model_states"] = ms["device_total"]
        # the full size of each layer's sharded weights (and gradients), where the group shards them
        full = [
            (blocks[j].params_dense * (rec.dp > 1) + blocks[j].params_expert / rec.ep * (rec.edp > 1)) * cst.c_w
            for j in layers
        ]
        # stages 2-3: full-size local gradients beside the shards until the reductions are waited for
        grad_full = full if rec.zero_stage >= 2 else [0.0] * len(layers)
        if rec.zero_stage == 3:
            if plan is not None:  # keep_gathered_across_microbatches: the stage's blocks, all step
                parts["gathered_params"] = sum(full)
            else:
                # a weight two blocks share is the engine's root unit, gathered for the whole pass;
                # of the others, the block computing and the one prefetched
                root = sum(f for j, f in zip(layers, full) if _is_tied(blocks, j))
                own = [0.0 if _is_tied(blocks, j) else f for j, f in zip(layers, full)]
                pairs = [own[a] + own[a + 1] for a in range(len(own) - 1)] or own
                parts["gathered_params"] = max(pairs) + root
        if plan is None:
            acts = [saved(j) for j in layers]
            xs = [extra_rows(j) for j in layers]
            if rec.grad_accum == 1:
                # one backward: activations drain layer by layer as gradient buffers fill
                best, arg = -1.0, 0
                for k in range(len(layers)):
                    v = sum(acts[: k + 1]) + sum(xs[: k + 1]) + sum(grad_full[k:])
                    if v > best:
                        best, arg = v, k
                parts["activations"] = sum(acts[: arg + 1])
                parts["expert_rows"] = sum(xs[: arg + 1])
                parts["grad_buffers"] = sum(grad_full[arg:])
            else:  # earlier micro-batches' gradients are all there while the last one runs
                parts["activations"], parts["expert_rows"] = sum(acts), sum(xs)
                parts["grad_buffers"] = sum(grad_full)
            count = 1
        else:
            parts["activations"], parts["expert_rows"] = live.peak_bytes[r], live.peak_extra[r]
            parts["grad_buffers"] = sum(grad_full)  # under no_sync the whole step
            count = live.peak_count[r]
        moe_layers = [blocks[j] for j in layers if blocks[j].is_moe]
        if rec.ep > 1 and moe_layers:
            parts["a2a_buffers"] = max(2 * cst.rows(b)[1] * b.row_bytes for b in moe_layers)
        work = [blocks[j].transient_bytes * T for j in layers]
        if ckpt:
            work = [w + blocks[j].act_bytes * T + _extra_rows_ckpt(cst, blocks[j]) for w, j in zip(work, layers)]
        parts["workspace"] = max(work, default=0.0)
        per_rank.append((sum(parts.values()), parts, ms["host_total"], count))
    mem, parts, host, _ = max(per_rank, key=lambda x: x[0])
    count = max(x[3] for x in per_rank)

    # ----- time --------------------------------------------------------------------------------
    tp: dict[str, float] = {}
    if plan is None:
        layers = rank_layers[0]
        f_c = [layer_f(j) for j in layers]
        b_c = [layer_i(j) + layer_w(j) for j in layers][::-1]
        g = [gath[j] for j in layers]
        fwd = _stream(f_c, g) if rec.zero_stage == 3 else sum(f_c)
        bwd = _stream(b_c, g[::-1]) if rec.zero_stage == 3 else sum(b_c)
        # the last micro-batch's backward overlaps each layer's reduction with the layers before it
        r_rev = [red[j] for j in layers][::-1]
        last_bwd = max(bwd, _overlapped_reduction(b_c, r_rev)) if rec.dp > 1 else bwd
        pipeline = rec.grad_accum * fwd + (rec.grad_accum - 1) * bwd + last_bwd
        tp.update(forward=rec.grad_accum * fwd, backward=rec.grad_accum * bwd, reduction_exposed=last_bwd - bwd)
        bubble = 0.0
        finish = [pipeline]
        reduce_after = [0.0]
    else:
        n_st = len(stages)
        dur = {
            "F": [sum(layer_f(j) for j in range(*stages[s])) for s in range(n_st)],
            "I": [sum(layer_i(j) for j in range(*stages[s])) for s in range(n_st)],
            "W": [sum(layer_w(j) for j in range(*stages[s])) for s in range(n_st)],
        }
        dur["B"] = [a + b for a, b in zip(dur["I"], dur["W"])]
        stage_rank = [plan.rank_of(s) for s in range(n_st)]
        latency = []
        for s in range(n_st):
            lo, hi = stages[s]
            a, b = stage_rank[s], stage_rank[(s + 1) % n_st]
            latency.append(cst.p2p(T * blocks[hi - 1].boundary_bytes, a * rec.dp, b * rec.dp) if a != b else 0.0)
        plain = simulate_plan(plan, stage_rank, dur, latency)
        first_round = plain
        if rec.zero_stage == 3 and any(gath):
            # the step's first forward of each stage gathers its blocks (kept until the step)
            first = {
                "F": {
                    s: _stream([layer_f(j) for j in range(*stages[s])], [gath[j] for j in range(*stages[s])])
                    for s in range(n_st)
                }
            }
            first_round = simulate_plan(plan, stage_rank, dur, latency, first)
        # every accumulation round is a whole pipeline; the reduction follows the last one
        if rec.grad_accum == 1:
            offset, last = 0.0, first_round
        else:
            offset, last = first_round.makespan + (rec.grad_accum - 2) * plain.makespan, plain
        finish = [offset + f for f in last.finish]
        reduce_after = [sum(red[j] for j in rank_layers[r]) for r in ranks]
        pipeline = max(finish)
        bubble = last.bubble
        tp.update(pipeline=pipeline, bubble=bubble)
    opt = [cst.optimizer([blocks[j] for j in rank_layers[r]]) for r in ranks]
    post = [cst.post_step_gather([blocks[j] for j in rank_layers[r]]) for r in ranks]
    # the clip norm's all-reduce over dp (and pp) and the step's one host sync
    norm = cst.coll("all_reduce", 8, list(range(rec.dp))) + cst.coll("all_reduce", 8, list(range(0, rec.world, rec.dp)))
    ends = [finish[r] + reduce_after[r] + opt[r] + post[r] for r in range(len(finish))]
    step = max(ends) + norm
    # the busiest rank's share of each, per step
    passes = rec.grad_accum * rec.microbatches
    tp.update(
        reduction=max(sum(red[j] for j in layers) for layers in rank_layers),
        optimizer=max(opt),
        weight_gather=max(post),
        gathers=max(sum(gath[j] for j in layers) for layers in rank_layers) * (1 if plan is not None else 2 * passes),
        moe_comm=max(sum(moe[j]["F"] + moe[j]["I"] for j in layers) for layers in rank_layers) * passes,
    )
    per_node = min(rec.world, profile.node_size)
    device = mem * (per_node if profile.memory_shared_by_node else 1)
    fits = device <= profile.device_memory_bytes and host * per_node <= profile.host_memory_bytes
    return Prediction(
        memory_bytes=mem,
        memory_parts=parts,
        step_s=step,
        time_parts=tp,
        host_bytes=host,
        fits=fits,
        tokens_per_s=rec.batch_size * costs.seq_len / step,
        bubble=bubble,
        live_microbatches=count,
    )


def _is_tied(blocks, j) -> bool:
    return any(b.shares_params_with == j for b in blocks)


def _extra_rows_ckpt(cst: _Costing, b: BlockCost) -> float:
    """The recomputed MoE block's rows beyond the mean load (its activations are the workspace)."""
    if not b.is_moe:
        return 0.0
    mean, worst = cst.rows(b)
    return (worst - mean) * b.expert_row_bytes
