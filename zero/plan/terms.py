"""The per-layer terms of one layout on one profile (``_Costing``): each layer's compute time per
pass, its MoE layer's synchronous communication, ZeRO-3's gather and the gradient reduction, the
optimizer, and which link tier a group's collectives cross (``_Groups``); ``_layer_terms`` caches
them across the layouts of one enumeration. ``zero.plan.cost.predict`` combines them."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from .enumerate import LayoutRecord
from .profile import AlphaBeta, Profile, bus_factor, steps
from .records import BlockCost, ModelCosts


def qrow_bytes(m: float, bits: int, block: int) -> float:
    """Bytes ``m`` elements take block-quantized on the wire (``zero.zeropp.row_bytes``, unrounded)."""
    return m * bits / 8 + 4 * m / block


def expected_nodes(
    num_experts: int, top_k: int, nodes: int, num_groups: int | None = None, topk_groups: int | None = None
) -> float:
    """The expected number of distinct nodes a token's ``top_k`` slots land on, the experts split
    evenly over ``nodes`` nodes in order (what ``ep_dispatch=node`` sends a token to: once each).

    With group-limited routing whose groups sit whole on the nodes (``num_groups`` a multiple of
    ``nodes``: each node holds num_groups / nodes groups), the token's ``topk_groups`` groups taken
    as uniform without replacement: a node is missed when all of them fall in the other nodes'
    groups, so d = N (1 - C(G - G/N, TG) / C(G, TG)), capped at ``top_k`` (each picked group is
    assumed to get one of the token's slots at least, which top_k < TG cannot give). Otherwise
    (no groups, or groups that straddle nodes) the slots as uniform over the experts without
    replacement: d = N (1 - C(E - E/N, K) / C(E, K)). Uniform choice is the assumption: a trained
    router's choices are correlated, which can put a token's slots on fewer nodes or more."""
    N, E, K = nodes, num_experts, top_k
    if N <= 1:
        return float(min(N, K))
    if num_groups is not None and topk_groups is not None and num_groups % N == 0:
        G, TG = num_groups, topk_groups
        return min(float(K), N * (1 - math.comb(G - G // N, TG) / math.comb(G, TG)))
    return N * (1 - math.comb(E - E // N, K) / math.comb(E, K))


# Adam (torch's foreach/fused AdamW) per parameter of this rank's shard, bytes through memory:
# the master weight, both moments read and written (3 x 4 x 2), the gradient read, scaled by 1/dp
# and clip in place (c x 3), the compute weight written back (c), the norm's read (c)
_ADAM_FP32_BYTES = 24


class _Groups:
    """The process groups of one rank (the first of its pipeline stage), as ``zero.Layout`` builds
    them, and which link tier each one's collectives cross."""

    def __init__(self, rec: LayoutRecord, node_size: int, pp_rank: int = 0):
        dp, ep, base = rec.dp, rec.ep, pp_rank * rec.dp
        self.node_size = node_size
        self.dp = list(range(base, base + dp))
        self.ep = list(range(base, base + ep))
        self.edp = list(range(base, base + dp, ep))

    def local(self, ranks) -> list[int]:
        """The members of group ``ranks`` on the first member's node."""
        node = ranks[0] // self.node_size
        return [r for r in ranks if r // self.node_size == node]

    def across(self, ranks) -> list[int]:
        """The members of group ``ranks`` at the first member's position on each node."""
        k = len(self.local(ranks))
        return list(ranks[::k])

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

    def __init__(
        self, rec: LayoutRecord, costs: ModelCosts, profile: Profile, skew: float | None, time_skew: float = 1.0
    ):
        self.rec, self.costs, self.profile, self.skew = rec, costs, profile, skew
        # the busiest ep rank's routed rows over the mean, as the step's pace: every synchronous
        # All-to-All waits for the rank whose experts compute the most (at most all of the group's)
        self.time_skew = min(max(1.0, time_skew), rec.ep)
        self.c_w = 2 if rec.mixed_precision == "bf16" else 4  # the engine's compute weights and gradients
        self.dtype = "bf16" if (costs.act_dtype == "bf16" or rec.mixed_precision == "bf16") else "fp32"
        self.tokens = rec.micro_rows * costs.seq_len  # of one micro-batch on one rank
        self.groups = _Groups(rec, profile.node_size)
        # ranks of one node share its compute slots (a CPU's cores) with each other and with the
        # node's other work: each gets slots / (ranks + background) of one when that is below 1
        # (a CPU profile's rates are measured with every core busy: what sharing caches and memory
        # bandwidth costs is in them)
        per_node = min(rec.world, profile.node_size)
        busy = per_node + profile.background_load
        slots = profile.slots
        self.contention = max(1.0, busy / slots)
        # the experts' products run between two exchanges of their ep group: the lighter ranks
        # reach the next exchange first and wait there asleep, leaving the busiest their share of
        # the cores. Its rows take the node's cores either alone (beside the node's other work) or
        # as long as the node's mean load needs them all, whichever is longer
        alone = max(1.0, (1 + profile.background_load) / slots)
        self.expert_contention = max(alone, self.contention / self.time_skew)
        # collectives overlap computation only where something else runs them: a GPU's copy
        # engines and network (no compute_slots), or a core no rank computes on; on a CPU whose
        # cores all compute, gloo's threads take their time from the ranks' (one after the other)
        self.overlap = profile.compute_slots is None or busy + 1 <= slots

    # ----- collectives ---------------------------------------------------------------------------
    def coll(self, op: str, nbytes: float, ranks) -> float:
        n = len(ranks)
        # nothing to move issues no collective (a layer without experts has no expert flat)
        if n <= 1 or nbytes <= 0:
            return 0.0
        p = self.profile
        nodes = self.groups.nodes(ranks)
        if nodes == 1:
            return p.link("intra", op).time(op, nbytes, n)
        if op in ("all_gather", "reduce_scatter", "all_reduce") and n % nodes == 0 and n > nodes:
            # k members on each of the n nodes: the two-level algorithm zero.comm counts the bytes
            # of, across nodes among the ranks at one position ((n - 1) N / W each), then inside
            # the node ((k - 1) N / k); an all-reduce is a reduce-scatter and an all-gather
            k = n // nodes
            times = 2 if op == "all_reduce" else 1
            intra, inter = p.link("intra", op), p.link("inter", op)
            across = (nodes - 1) * inter.alpha + (nodes - 1) * nbytes / n / inter.beta
            inside = (k - 1) * intra.alpha + (k - 1) * nbytes / k / intra.beta
            return times * (across + inside)
        if op != "all_to_all":  # one member a node (or uneven): every step crosses nodes
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
    def recomputes(self, b: BlockCost) -> bool:
        """Whether layer ``b`` runs its forward again in its backward: a checkpointed block under
        activation checkpointing (the embedding and the head run once)."""
        return self.rec.checkpoint_activations and b.checkpointed

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

    def _rows_mode(self, b: BlockCost) -> bool:
        """Whether layer ``b``'s experts take rows in expert order between flat exchanges: ep > 1
        (flat dispatch, and node dispatch's exchange inside a node), but not node dispatch with one
        rank a node, whose experts run in tokens mode over the rows received."""
        if not b.is_moe or self.rec.ep == 1:
            return False
        return self.rec.ep_dispatch != "node" or len(self.node_split(b)[1]) > 1

    def saved_bytes(self, b: BlockCost) -> float:
        """Bytes per token layer ``b`` saves for its backward on this layout: ``act_bytes``, and in
        rows mode (``_rows_mode``) ``rows_mode_row_bytes`` more per routed row; node dispatch with
        one rank a node saves the inputs of the rows received instead, a row per token and node."""
        if self._rows_mode(b):
            return b.act_bytes + b.top_k * b.rows_mode_row_bytes
        if b.is_moe and self.rec.ep > 1:
            return b.act_bytes + self.node_split(b)[2] * b.row_bytes
        return b.act_bytes

    def saved_row_bytes(self, b: BlockCost) -> float:
        """Bytes layer ``b`` saves per routed row on this layout: ``expert_row_bytes``, and
        ``rows_mode_row_bytes`` in rows mode."""
        return b.expert_row_bytes + (b.rows_mode_row_bytes if self._rows_mode(b) else 0.0)

    def _pool_bytes(self, b: BlockCost, kind: str, width: int) -> float:
        """Bytes of one of layer ``b``'s kernel buffers (``BlockCost.pool_buffers``)."""
        rec = self.rec
        mean, worst = self.rows(b) if b.is_moe else (0.0, 0.0)
        # the saved buffers' rows: the kernel's static bound (tokens mode) or the rows received
        bound = mean if rec.ep > 1 else worst
        rows = {
            "block": b.pool_block_rows,
            "rows": mean,
            "rows+1": mean + 1,
            "tokens": self.tokens,
            "bound": bound,
            "experts": b.num_experts // rec.ep,
        }[kind]
        c = self.c_w if kind == "experts" else (2 if self.dtype == "bf16" else 4)
        return rows * width * c

    def _pool_modes(self) -> set[str]:
        rec = self.rec
        return {"both", "rows" if rec.ep > 1 else "tokens"} | ({"ckpt"} if rec.checkpoint_activations else set())

    def _pool_sum(self, b: BlockCost, modes: set[str], pooled: bool = True, passes: str | None = None) -> float:
        """Bytes of layer ``b``'s kernel buffers in ``modes`` (of ``passes``' pass, when given) that
        the pool keeps (``pooled``: at ``pool_min_bytes`` or more) or the heap gives (under it)."""
        total = 0.0
        for kind, width, m, used_in in b.pool_buffers:
            if m in modes and (passes is None or passes in used_in):
                nbytes = self._pool_bytes(b, kind, width)
                if (nbytes >= b.pool_min_bytes) == pooled:
                    total += nbytes
        return total

    def pooled(self, b: BlockCost, saved_only: bool = False) -> float:
        """Bytes layer ``b``'s kernel keeps from step to step (``BlockCost.pool_buffers``), one lane;
        ``saved_only``: of those, the buffers of what the layer saves, idle under checkpointing."""
        modes = self._pool_modes()
        return self._pool_sum(b, {"ckpt"} & modes if saved_only else modes)

    def pooled_saved(self, b: BlockCost) -> float:
        """Bytes of what layer ``b`` saves that its kernel's pool holds (h1, h3: mode "ckpt"), one
        micro-batch, with or without checkpointing: a pool keeps as many as were alive at once."""
        return self._pool_sum(b, {"ckpt"})

    def kernel_backward(self, b: BlockCost) -> float:
        """The heap bytes layer ``b``'s kernel takes while its backward runs: the backward's buffers
        under the pool's threshold (the weight gradients among them, all returned at once and
        alive until the engine's hook adds them into its flat buffer) and, in tokens mode, one
        chunk of the combine into token order; the pool's own buffers are kernel_buffers."""
        if not b.pool_buffers:
            return 0.0
        total = self._pool_sum(b, self._pool_modes() - {"ckpt"}, pooled=False, passes="B")
        if self.rec.ep == 1 and b.pool_combine_tokens:
            total += min(self.tokens, b.pool_combine_tokens) * b.top_k * b.row_bytes
        return total

    def compute(self, b: BlockCost) -> dict[str, float]:
        """Seconds of one micro-batch's F, I and W passes of layer ``b`` on this rank, compute only."""
        p, rec, T = self.profile, self.rec, self.tokens
        f = i = w = 0.0
        ef = ei = ew = 0.0  # the experts' products, at the busiest rank's rows
        for mm in b.matmuls:
            if mm.expert:
                X = b.num_experts // rec.ep
                # per local expert: the mean load, on the busiest rank
                rows = T * mm.rows_per_token * rec.ep / b.num_experts * self.time_skew
                flops = 2.0 * mm.k * mm.n * rows * X * mm.work
            else:
                rows = mm.fixed_rows or T * mm.rows_per_token
                flops = mm.flops_per_token() * T
            if not mm.weight:  # attention's scores or weighted values: its kernel's rate where measured
                # [L, J] @ [J, L] (the scores) or [L, L] @ [L, O] (the values): J or O is the head's dim
                attn = p.attention_rate(self.dtype, rows, mm.n if mm.k == rows else mm.k)
                if attn is not None:
                    f += flops / attn[0]
                    i += attn[1] * flops / attn[0]
                else:  # the backward: dQ, dK, dV and the recomputed scores, ~2.5x its forward
                    t = flops / p.matmul_rate(self.dtype, rows, mm.k, mm.n)
                    f += t
                    i += 2.5 * t
                continue
            # each pass at its own product's shape: the forward [rows, k] @ [k, n], the input
            # gradient [rows, n] @ [n, k], the weight gradient [k, rows] @ [rows, n]; the roofline:
            # a thin product is bound by its operands' bytes
            c = 2 if self.dtype == "bf16" else 4
            products = b.num_experts // rec.ep if mm.expert else 1
            floor = c * products * (rows * mm.k + mm.k * mm.n + rows * mm.n) / p.memory_bandwidth
            passes = (
                max(flops / p.matmul_rate(self.dtype, rows, mm.k, mm.n), floor),
                max(flops / p.matmul_rate(self.dtype, rows, mm.n, mm.k), floor),
                max(flops / p.matmul_rate(self.dtype, mm.k, rows, mm.n), floor),
            )
            if mm.expert:
                ef, ei, ew = ef + passes[0], ei + passes[1], ew + passes[2]
            else:
                f, i, w = f + passes[0], i + passes[1], w + passes[2]
        held = b.params_dense + b.params_expert / rec.ep
        weights = held * self.c_w / p.memory_bandwidth  # each pass reads the weights once
        # the non-matmul operators at the rates of tensors of this micro-batch's rows: the FFN
        # activation's at its own, the rest at the elementwise rate (the forward's at its own: as a
        # reference block runs them, where measured)
        rate, act_rate, fwd_rate = p.elementwise_rate(T), p.activation_rate(T), p.forward_elementwise_rate(T)
        if b.backward_bytes is None:
            back, back_act = 2.3 * b.elementwise_bytes + b.recompute_bytes, 2.3 * b.activation_bytes
        else:
            back, back_act = b.backward_bytes, b.backward_activation_bytes
        fwd_s = T * ((b.elementwise_bytes - b.activation_bytes) / fwd_rate + b.activation_bytes / act_rate)
        back_s = T * ((back - back_act) / rate + back_act / act_rate)
        # the backward dispatches ~1.7x the forward's operators (counted: 1.5x for an MoE block,
        # 1.9x for a dense one); of its bytes, the recomputation is the input gradient's and the
        # rest splits as 1.6 : 0.7 between the input and the weight gradients (each byte at the
        # backward's mean rate)
        own = max(back - b.recompute_bytes, 0.0)
        i_share = (own * 1.6 / 2.3 + b.recompute_bytes) / back if back > 0 else 0.0
        f += fwd_s + weights + b.ops * p.op_overhead_s
        i += i_share * back_s + weights + 1.2 * b.ops * p.backward_op_s
        w += (1.0 - i_share) * back_s + weights + 0.5 * b.ops * p.backward_op_s
        k = self.contention
        ke = self.expert_contention
        return {"F": f * k + ef * ke, "I": i * k + ei * ke, "W": w * k + ew * ke}

    def node_split(self, b: BlockCost) -> tuple[list[int], list[int], float]:
        """``ep_dispatch=node``: the ep group's inter part (its members at this rank's position on
        each node, N), its intra part (this rank's node's members, L) and the expected nodes a
        token crosses to (``expected_nodes``)."""
        g = self.groups
        inter, intra = g.across(g.ep), g.local(g.ep)
        return inter, intra, expected_nodes(b.num_experts, b.top_k, len(inter), b.num_groups, b.topk_groups)

    def moe_comm(self, b: BlockCost) -> dict[str, float]:
        """Synchronous communication of an MoE layer per micro-batch: F, I (the backward) and R
        (activation checkpointing's recomputed forward: F but the statistics' all-reduce, which
        the recomputation takes back from its forward, ``routing_kernels.runtime.replayed``)."""
        if not b.is_moe:
            return {"F": 0.0, "I": 0.0, "R": 0.0}
        rec, g = self.rec, self.groups
        f = i = stats = 0.0
        if rec.dp > 1:
            stats = self.coll("all_reduce", b.stats_bytes, g.dp)
            f += stats
            if b.capacity_factor is not None:
                f += self.coll("all_gather", b.routing_bytes * self.tokens * rec.dp, g.dp)
        if rec.ep > 1 and rec.ep_dispatch == "node":
            node = self.node_comm(b)
            f, i = f + node["F"], i + node["I"]
        elif rec.ep > 1:
            mean, _ = self.rows(b)
            a2a = self.coll("all_to_all", mean * self.time_skew * b.row_bytes, g.ep)
            counts = self.coll("all_to_all", 8 * b.num_experts, g.ep)
            f += 2 * a2a + counts  # dispatch and combine, and the counts before them
            i += 2 * a2a
        return {"F": f, "I": i, "R": f - stats}

    def node_comm(self, b: BlockCost) -> dict[str, float]:
        """``ep_dispatch=node``'s exchanges per micro-batch (``moe.dispatch.NodeDispatcher``). Over
        the inter part: a row per (token, node it needs), T d of them, out and back, and with each
        the token's K expert ids (int64) and weights (fp32, whose gradient comes back in the
        backward), each its own All-to-All, after the N counts. Inside the node: the flat exchange
        over the L members, a row per slot (T K on average, as flat's, at the busiest rank's
        skew), out and back, after the L X counts; none for L = 1. The inter exchange's rows go to
        a node's L ranks together, whose load is the node's: taken as even (the rank's time_skew
        would overstate it). The backward reverses the rows and the weights, not the ids."""
        T, K = self.tokens, b.top_k
        inter, intra, d = self.node_split(b)
        across = T * d  # rows this rank sends over the inter part (and receives, on average)
        x = self.coll("all_to_all", across * b.row_bytes, inter)
        w = self.coll("all_to_all", across * 4 * K, inter)
        ids = self.coll("all_to_all", across * 8 * K, inter)
        mean, _ = self.rows(b)
        inside = self.coll("all_to_all", mean * self.time_skew * b.row_bytes, intra)
        local_experts = len(intra) * (b.num_experts // self.rec.ep)
        counts = self.coll("all_to_all", 8 * len(inter), inter) + self.coll("all_to_all", 8 * local_experts, intra)
        return {"F": 2 * x + w + ids + 2 * inside + counts, "I": 2 * x + w + 2 * inside}

    def a2a_bytes(self, b: BlockCost) -> float:
        """One MoE layer's send and receive buffers of rows at the worst case (``a2a_buffers``):
        flat, a row per slot each way; node, the larger of its two exchanges': across nodes a row
        per (token, node) with its slots' ids and weights, T d sent and at worst every token of
        the inter part's N ranks received (``skew``: that times T d, at most N T); inside the node
        the flat exchange's rows while the rows received across nodes are still held (the
        dispatcher's ``x_recv`` and its ids and weights live through the exchange inside)."""
        _, worst = self.rows(b)
        slots = 2 * worst * b.row_bytes
        if self.rec.ep_dispatch != "node":
            return slots
        inter, _, d = self.node_split(b)
        sent, most = self.tokens * d, len(inter) * self.tokens
        got = most if self.skew is None else max(sent, min(self.skew * sent, most))
        row = b.row_bytes + 12 * b.top_k
        return max((sent + got) * row, got * row + slots)

    def _sharded(self, b: BlockCost):
        """(elements, group ranks) of layer ``b``'s weights per sharding group: dense over dp,
        expert over edp (this rank's experts)."""
        rec, g = self.rec, self.groups
        return ((b.params_dense, g.dp), (b.params_expert / rec.ep, g.edp))

    def gather(self, b: BlockCost) -> float:
        """ZeRO-3: the all-gather of one layer's weights from the primary partition (over the whole
        sharding group), int8 with an fp32 scale per block under qwZ, then dequantized."""
        rec = self.rec
        if rec.zero_stage != 3 or b.shares_params_with is not None:
            return 0.0
        t = 0.0
        for elems, ranks in self._sharded(b):
            if len(ranks) <= 1:
                continue
            if rec.zero_qwz:  # the wire's int8 + scales, and a pass that dequantizes into the compute dtype
                t += self.coll("all_gather", elems * (1 + 4 / rec.zero_quant_block), ranks)
                t += elems * (1 + self.c_w) / self.profile.memory_bandwidth
            else:
                t += self.coll("all_gather", elems * self.c_w, ranks)
        return t

    def gather_again(self, b: BlockCost) -> float:
        """ZeRO-3: a later gather of the same weights before the step (the backward's; a later
        micro-batch's forward): under hpZ from the secondary partition, inside the node, in the
        compute dtype; else the primary gather again."""
        rec = self.rec
        if not rec.zero_hpz:
            return self.gather(b)
        if rec.zero_stage != 3 or b.shares_params_with is not None:
            return 0.0
        return sum(
            self.coll("all_gather", elems * self.c_w, self.groups.local(ranks)) for elems, ranks in self._sharded(b)
        )

    def reduce(self, b: BlockCost) -> float:
        """The gradient reduction of one layer: all-reduce (ZeRO-0) or reduce-scatter (1-3), dense
        over dp and expert over edp; under qgZ two quantized all-to-alls (inside the node, then
        across nodes among the ranks at the same position) and the passes that quantize, and
        dequantize and sum, the local gradient."""
        rec = self.rec
        if not rec.zero_qgz:
            op = "all_reduce" if rec.zero_stage == 0 else "reduce_scatter"
            return sum(self.coll(op, elems * self.c_w, ranks) for elems, ranks in self._sharded(b))
        t = 0.0
        for elems, ranks in self._sharded(b):
            W = len(ranks)
            if W <= 1:
                continue
            local, across = self.groups.local(ranks), self.groups.across(ranks)
            k, n = len(local), len(across)
            t += self.coll("all_to_all", k * qrow_bytes(elems / k, rec.zero_qgz_bits, rec.zero_quant_block), local)
            t += self.coll("all_to_all", n * qrow_bytes(elems / W, rec.zero_qgz_bits, rec.zero_quant_block), across)
            # quantize (read the compute dtype, write bits/8), dequantize and sum in fp32 (x2 passes)
            t += elems * (self.c_w + rec.zero_qgz_bits / 8 + 8) / self.profile.memory_bandwidth
        return t

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


def _derived(profile: Profile, cache: dict, make) -> Profile:
    """``make(profile)``, once per profile object (its id is held with it, so it cannot be reused
    while the entry lives): thousands of layouts are predicted on one profile."""
    hit = cache.get(id(profile))
    if hit is not None and hit[0] is profile:
        return hit[1]
    out = make(profile)
    if len(cache) > 64:
        cache.clear()
    cache[id(profile)] = (profile, out)
    return out


def latency_profile(profile: Profile) -> Profile:
    """``profile`` with every link's β and the memory bandwidth infinite: a collective's time on it
    is its α steps alone (its waits), where the rest of its time is bytes the cores copy."""

    def make(p: Profile) -> Profile:
        inf = float("inf")
        links = {t: {op: AlphaBeta(ab.alpha, inf) for op, ab in ops.items()} for t, ops in p.collectives.items()}
        return dataclasses.replace(p, collectives=links, memory_bandwidth=inf)

    return _derived(profile, _LATENCY, make)


def beside_profile(profile: Profile) -> Profile:
    """``profile`` with each collective's time what it costs the computing cores beside compute
    (``collectives_beside``; an op without one: its bytes alone, β) and the memory bandwidth kept
    (qgZ's quantizing passes are the cores' work)."""

    def make(p: Profile) -> Profile:
        bes = p.collectives_beside

        def beside(op: str, ab: AlphaBeta) -> AlphaBeta:
            return bes.get(op) or AlphaBeta(0.0, ab.beta)

        links = {t: {op: beside(op, ab) for op, ab in ops.items()} for t, ops in p.collectives.items()}
        return dataclasses.replace(p, collectives=links)

    return _derived(profile, _BESIDE, make)


_LATENCY: dict = {}
_BESIDE: dict = {}


class _Terms(NamedTuple):
    """Per layer: its passes' compute, its MoE layer's exchanges, ZeRO-3's gathers (the first
    and the later ones), its gradient reduction; where no core is spare, the waits (α steps) of
    each collective that runs beside the compute and what it costs the cores (``beside_profile``);
    where one is, those are the collectives' whole times (not read)."""

    comp: list
    moe: list
    gath: list
    red: list
    gath2: list
    gath_wait: list
    gath2_wait: list
    red_wait: list
    gath_copy: list
    gath2_copy: list
    red_copy: list


def _layer_terms(cst: _Costing) -> _Terms:
    rec = cst.rec
    key = (id(cst.costs), id(cst.profile), rec.world, rec.dp, rec.ep, rec.ep_dispatch, rec.micro_rows, rec.zero_stage)
    key += (rec.mixed_precision, cst.skew, rec.zero_hpz, rec.zero_qwz, rec.zero_qgz, rec.zero_qgz_bits)
    key += (rec.zero_quant_block, cst.time_skew)
    hit = _TERMS.get(key)
    if hit is not None and hit[0] is cst.costs and hit[1] is cst.profile:
        return hit[2]
    blocks = cst.costs.blocks
    gath, gath2 = [cst.gather(b) for b in blocks], [cst.gather_again(b) for b in blocks]
    red = [cst.reduce(b) for b in blocks]
    # the waits of the collectives that run beside the compute (ZeRO-3's prefetched gathers, the
    # gradient reductions launched as the backward goes): where no core is spare their copies
    # take the cores' time, their waits do not (predict); where one is, the waits are not read
    if cst.overlap:
        waits, waits2, red_waits = gath, gath2, red
        copies, copies2, red_copies = gath, gath2, red
    else:
        lat = _Costing(rec, cst.costs, latency_profile(cst.profile), cst.skew, cst.time_skew)
        waits, waits2 = [lat.gather(b) for b in blocks], [lat.gather_again(b) for b in blocks]
        red_waits = [lat.reduce(b) for b in blocks]
        bes = _Costing(rec, cst.costs, beside_profile(cst.profile), cst.skew, cst.time_skew)
        copies, copies2 = [bes.gather(b) for b in blocks], [bes.gather_again(b) for b in blocks]
        red_copies = [bes.reduce(b) for b in blocks]
    terms = _Terms(
        [cst.compute(b) for b in blocks],
        [cst.moe_comm(b) for b in blocks],
        gath,
        red,
        gath2,
        waits,
        waits2,
        red_waits,
        copies,
        copies2,
        red_copies,
    )
    if len(_TERMS) > 4096:
        _TERMS.clear()
    _TERMS[key] = (cst.costs, cst.profile, terms)
    return terms
