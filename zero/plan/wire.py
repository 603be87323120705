"""The bytes one rank sends per optimizer step on each link tier, as the engine counts them
(``zero.comm``: the same byte model, the same functions), predicted from a layout and the model's
costs: what ``metrics.jsonl`` logs as ``comm_bytes_intra`` and ``comm_bytes_inter``.

The engine's collectives per step, per flat parameter (each layer's dense weights over dp, its
routed experts over edp; padded to a multiple of the group, as ``zero.flat`` pads them):

    ZeRO-3     the weights' all-gather from the primary partition at the step's first forward
               (int8 + fp32 scales per block under qwZ), and at each later pass (the backwards,
               the later micro-batches' forwards) again, or under hpZ from the secondary partition
               inside the node; under a pipeline the engine keeps a stage's weights gathered for
               the whole step, one gather
    ZeRO-0     the gradients' all-reduce; ZeRO-1-3 their reduce-scatter, or under qgZ the two
               quantized all-to-alls (inside the node, then across); once per step
    ZeRO-1-2   the updated weights' all-gather after the step
    all        the gradient norm's all-reduce over dp, and over pp under a pipeline: one fp32 and
               one per finiteness flag or extra sum the caller adds (the trainer's: the loss,
               every MoE layer's aux and z losses, ``experiments.training.nonfinite``, and the
               preemption flag)

Not counted here, as the engine does not count them: the MoE layer's token All-to-All and the
pipeline's point-to-point sends. A layer that shares another's weights (tied embeddings) is the
owner's; the engine makes them one root unit, which this counts as the owner layer's flat.
"""

from __future__ import annotations

from ..comm import Tiers, all_reduce_bytes, gather_bytes
from ..zeropp import QWZ_BITS, row_bytes
from .enumerate import LayoutRecord
from .records import ModelCosts


def _groups(rec: LayoutRecord, pp_rank: int):
    base = pp_rank * rec.dp
    return tuple(range(base, base + rec.dp)), tuple(range(base, base + rec.dp, rec.ep))


def _flat_bytes(rec: LayoutRecord, elems: int, ranks: tuple[int, ...], node_size: int, c_w: int, pipeline: bool):
    """(intra, inter) this rank (the group's first member) sends per step for one flat parameter."""
    W = len(ranks)
    if W <= 1 or elems == 0:
        return 0, 0
    t = Tiers(ranks, ranks[0], node_size)
    padded = -(-elems // W) * W
    C = padded // W
    out = [0, 0]

    def add(pair, times=1):
        out[0] += times * pair[0]
        out[1] += times * pair[1]

    passes = 1 if pipeline else 2 * rec.grad_accum  # the gathers a step makes of one flat
    if rec.zero_stage == 3:
        primary = W * row_bytes(C, QWZ_BITS, rec.zero_quant_block) if rec.zero_qwz else padded * c_w
        add(gather_bytes(primary, t))
        if passes > 1:
            if rec.zero_hpz:
                node = ranks[0] // node_size
                local = tuple(r for r in ranks if r // node_size == node)
                add(gather_bytes(padded * c_w, Tiers(local, ranks[0], node_size)), passes - 1)
            else:
                add(gather_bytes(primary, t), passes - 1)
    if rec.zero_stage == 0:
        add(all_reduce_bytes(padded * c_w, t))
    elif rec.zero_qgz:
        if t.split is None:
            raise ValueError(f"qgz needs the group {ranks} evenly on nodes of {node_size} ranks")
        n, k = t.split
        bits, block = rec.zero_qgz_bits, rec.zero_quant_block
        add(((k - 1) * row_bytes(n * C, bits, block) if k > 1 else 0, (n - 1) * row_bytes(C, bits, block)))
    else:
        add(gather_bytes(padded * c_w, t))
    if rec.zero_stage in (1, 2):
        add(gather_bytes(padded * c_w, t))
    return out[0], out[1]


def comm_bytes(rec: LayoutRecord, costs: ModelCosts, node_size: int, flags: int | None = None) -> dict[str, int]:
    """``{"intra": bytes, "inter": bytes}`` one rank sends per optimizer step, averaged over the
    world as the trainer logs them (the dp ranks of a pipeline stage send alike; the stages hold
    different layers): an integer where the mean is one (see the module docstring). ``flags``:
    the values the step's norm all-reduce carries beside the norm (None: the trainer's, its
    finiteness flags and its preemption flag)."""
    if flags is None:
        flags = 1 + 2 * sum(1 for b in costs.blocks if b.is_moe) + 1
    if not isinstance(node_size, int) or isinstance(node_size, bool) or node_size < 1:
        raise ValueError(f"node_size={node_size!r} is invalid: expected the ranks per node, a positive integer")
    c_w = 2 if rec.mixed_precision == "bf16" else 4
    blocks = costs.blocks
    plan = rec.plan(len(blocks))
    stages = [(0, len(blocks))] if plan is None else list(plan.ranges)
    total = [0, 0]
    for r in range(rec.pp):
        mine = [0] if plan is None else plan.stages_of(r)
        layers = [j for s in mine for j in range(*stages[s])]
        dp_ranks, edp_ranks = _groups(rec, r)
        intra = inter = 0
        for j in layers:
            b = blocks[j]
            if b.shares_params_with is not None:
                continue
            for elems, ranks in ((b.params_dense, dp_ranks), (b.params_expert // rec.ep, edp_ranks)):
                a, e = _flat_bytes(rec, int(elems), ranks, node_size, c_w, plan is not None)
                intra, inter = intra + a, inter + e
        for ranks in (dp_ranks,) + ((tuple(range(0, rec.world, rec.dp)),) if rec.pp > 1 else ()):
            a, e = all_reduce_bytes(4 * (1 + flags), Tiers(ranks, r * rec.dp, node_size)) if len(ranks) > 1 else (0, 0)
            intra, inter = intra + a, inter + e
        total[0] += intra
        total[1] += inter
    return {k: v // rec.pp if v % rec.pp == 0 else v / rec.pp for k, v in zip(("intra", "inter"), total)}
