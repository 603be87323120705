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
                    stage's blocks gathered for the whole step, so all of them; under hpZ also
                    the secondary partition, a 1/k slice of every block (k: the sharding group's
                    members on one node), from the block's first forward to the step
    grad_buffers    ZeRO-2/3: the full-size local gradient buffers; ``zero.flat`` frees them only
                    once the step's reductions are waited for, so during a backward they add to the
                    shards ``predict_memory`` counts; where the profile's collectives copy
                    (``collective_copies``: gloo) also each reduce-scatter in flight, a full
                    copy of a layer's gradients from its backward's end to the backward's
                    (ZeRO-3's prefetch in flight: one more gathered block)
    activations     saved for backward, per micro-batch times the number the schedule keeps alive
                    (from the schedule's own order: forwards whose backward has not run; 1 without
                    a pipeline), at the mean expert load; under a pipeline also torch's stage
                    buffers (one input and one output gradient per micro-batch, each live
                    forward's output: the last stage's logits); the kernel pool's saved hiddens
                    do not drain with the rest in the backward (the pool keeps them): one
                    micro-batch's without a pipeline, under one the most micro-batches alive
                    at once on their stage
    expert_rows     the routed rows beyond the mean load, at the worst case: under a capacity
                    E_local x capacity bounds them exactly; dropless takes ``skew`` (default the
                    worst case: every token of the ep group routed to this rank's experts)
    a2a_buffers     the send and receive buffers of rows (worst case) of the MoE layer
                    exchanging at the peak (none where the peak is elsewhere: the head's loss);
                    under ``ep_dispatch=node`` the larger of its two exchanges' (across nodes a
                    row per token and node with its slots' ids and weights, inside as flat's)
    workspace       the backward's working memory of one layer (the loss's fp32 logits at the
                    head; the CPU expert kernel's heap buffers and its weight gradients, all
                    alive until the engine's hook adds them in: ``_Costing.kernel_backward``),
                    and with activation checkpointing the recomputed block's activations:
                    without a pipeline, the layer's whose (last micro-batch's) backward runs at
                    the peak (activations, gradients and it together); under one, the stage's
                    whose backward action is the peak of the walk of the rank's order (each
                    stage's largest layer, at its own I, W and B actions, with its exchanges)
    kernel_buffers  what kernels keep allocated from step to step beyond what they save: the CPU
                    expert kernel's buffer pool (``routing_kernels.cpu.pool``: per MoE layer its
                    block scratch, row buffers and weight gradients of 1 MB or more, one lane;
                    under activation checkpointing also its saved hiddens, idle between passes)

Step time. Each matrix product at the profile's FLOP/s for its size, each elementwise byte at its
memory bandwidth, each operator a fixed overhead, and each collective by the α-β model of its link
tier (a group inside one node: ``intra``; a group of k members on each of n nodes: the two-level
algorithm whose bytes ``zero.comm`` counts, (n - 1) N / W across nodes at the ``inter`` link and
(k - 1) N / k inside; one member a node: the ring at the ``inter`` link; All-to-All splits its bytes
between the two). ZeRO++ (``LayoutRecord.zero_hpz`` / ``zero_qwz`` / ``zero_qgz``): qwZ gathers
int8 and an fp32 scale per block, plus a pass that dequantizes; hpZ makes every gather after the
step's first forward (the backwards, later micro-batches' forwards) one inside the node in the
compute dtype; qgZ replaces the reduce-scatter with an all-to-all of quantized rows inside the node
and one across nodes among the ranks at the same position, plus passes that quantize and that
dequantize and sum. ``Prediction.comm_bytes``: the bytes per tier the engine's counters log
(``zero.plan.wire``). The overlaps are the engine's: ZeRO-3 prefetches the next block's gather while a block
computes (max per block, the first gather exposed); gradient reductions start per block as soon as
its gradients are complete (overlapping the rest of that backward) without a pipeline, and after a
rank's last backward with one (``Pipeline`` calls ``start_reduction``); where every core computes,
what a gather or reduction takes from the cores (``Profile.collectives_beside``: its CPU seconds
per call; else its bytes) adds to the layer it runs beside and only its waits (its α steps)
overlap; the MoE layer's All-to-All, its statistics all-reduce and the capacity gather are
synchronous (summed). Under ``ep_dispatch=node`` the All-to-All is two: across nodes among the ep
group's ranks at one position, a row per token and node it needs (``terms.expected_nodes``: d of
them on average, with its slots' ids and weights), then inside the node a row per slot
(``_Costing.node_comm``). The
pipeline's length comes from simulating the schedule's own order with each stage's forward,
backward-input and backward-weight durations and the point-to-point time of an activation between
ranks: a wait between them where something else moves the bytes (a GPU, a spare core), and work
on both ranks' actions where every core computes; every accumulation round runs a whole pipeline
(fill and drain). Under ``parallel.pp_overlap`` (dualpipev) each overlapped forward-backward pair
runs its two passes at once, where something other than the computing cores runs the collectives:
each pass's MoE exchanges (its layers' All-to-All, statistics all-reduce and capacity gather; the
backward's with a recomputed forward's again, but for the statistics' all-reduce, which a
recomputation takes back from its forward) wait beside the other pass's compute, so the pair
takes max(cF + cB, mF + mB, dF, dB) (c: compute, m: exchanges, d: a pass's whole duration;
``schedule.simulate``); where every core computes the pairs stay one pass after the other.
Where ranks share cores, the busiest expert rank's products take the longer of its rows alone
and the node's mean load on all cores (``_Costing.expert_contention``). Then the optimizer: Adam's
passes over this rank's shard at memory bandwidth, or with offload the host's rate plus the copies
over the host link, and ZeRO-1/2's all-gather of the updated weights.

What it leaves out: computation overlapping an All-to-All other than the overlapped pairs' (DeepEP;
a lone pass's own exchanges), the two passes of an overlapped pair slowing each other down (sharing
the SMs and memory bandwidth) and what they hold at once beyond one pass after the other (both
passes' All-to-All buffers and working memory), FP8, tensor and sequence parallelism, kernel
fusion beyond a fixed per-operator cost, network contention between groups.
"""

from __future__ import annotations

from ..memory import predict_memory
from .enumerate import LayoutRecord, ep_dispatch_problem
from .profile import Profile
from .records import PARTS, BlockCost, MatMul, ModelCosts, Prediction
from .schedule import live_plan, simulate_plan
from .terms import _Costing, _layer_terms
from .wire import comm_bytes

__all__ = ["PARTS", "BlockCost", "MatMul", "ModelCosts", "Prediction", "predict"]


def _stream(compute: list[float], comm: list[float], overlap: bool = True) -> float:
    """A chain of layers whose communication runs one ahead of the compute (ZeRO-3's prefetch:
    the next layer's gather starts when the current layer starts): the first gather is exposed,
    then each layer takes the longer of its compute and the next gather. Without ``overlap``
    (nothing but the computing cores to run the collectives) one after the other."""
    if not overlap:
        return sum(compute) + sum(comm[: len(compute)])
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


def _beside(compute: list[float], comm: list[float], copies: list[float], waits: list[float], overlap: bool) -> float:
    """``_stream`` of collectives that run beside the compute. Where a core is spare (``overlap``)
    they run on it (``comm``: their whole times); where none is, what a collective costs the
    computing cores (``copies``: its bytes, launch and thread's work) adds to its layer's compute
    and only its waits (``waits``: its α steps, gloo's thread asleep) overlap."""
    if overlap:
        return _stream(compute, comm, True)
    return _stream([c + x for c, x in zip(compute, copies)], waits, True)


def _overlapped_reduction(compute_rev: list[float], reduce_rev: list[float]) -> float:
    """A backward over layers (in backward order) whose reductions start as each layer's gradients
    are complete, one at a time: the end of the last reduction."""
    t = t_red = 0.0
    for c, r in zip(compute_rev, reduce_rev):
        t += c
        t_red = max(t_red, t) + r
    return max(t, t_red)


def predict(
    rec: LayoutRecord, costs: ModelCosts, profile: Profile, *, skew: float | None = None, time_skew: float = 1.0
) -> Prediction:
    """Peak memory per rank and step time of layout ``rec`` (see the module docstring). ``skew``:
    the dropless MoE layers' worst rows over the mean, for memory (default: the worst case
    possible); ``time_skew``: the busiest expert-parallel rank's routed rows over the mean, for
    time (default 1: even routing; at most ep)."""
    blocks = costs.blocks
    L = len(blocks)
    plan = rec.plan(L)
    cst = _Costing(rec, costs, profile, skew, time_skew)
    T = cst.tokens
    if T < 1:
        raise ValueError(f"layout {rec.label()}: a micro-batch has no rows (batch_size={rec.batch_size})")
    problem = ep_dispatch_problem(rec, profile.node_size)  # node: the exchanges follow the profile's nodes
    if problem is not None:
        raise ValueError(f"layout {rec.label()} on profile {profile.name} (node_size={profile.node_size}): {problem}")
    ckpt = rec.checkpoint_activations
    stages = [(0, L)] if plan is None else list(plan.ranges)

    # per layer: passes, communication, memory per token
    terms = _layer_terms(cst)
    comp, moe, gath, red, gath2 = terms.comp, terms.moe, terms.gath, terms.red, terms.gath2
    gath_wait, gath2_wait, gath_copy, gath2_copy = terms.gath_wait, terms.gath2_wait, terms.gath_copy, terms.gath2_copy

    def again(j):
        return cst.recomputes(blocks[j])

    def grad_full_bytes(j):
        # ZeRO-2/3's full-size local gradients of layer j, from its first backward, beside the shards
        # until the reductions are waited for; a flat whose group is this rank alone (ep = dp: the
        # experts'; dp = 1: all) has no other shard: the buffer becomes it at the reduction and is
        # freed after the step (``zero.flat``), so its gradients leave the model states (below)
        if rec.zero_stage < 2:
            return 0.0
        return (blocks[j].params_dense + blocks[j].params_expert / rec.ep) * cst.c_w

    def layer_f(j):
        return comp[j]["F"] + moe[j]["F"]

    def layer_i(j):
        # the recomputation: the forward's compute and its exchanges but the statistics' all-reduce
        return comp[j]["I"] + moe[j]["I"] + (comp[j]["F"] + moe[j]["R"] if again(j) else 0.0)

    def layer_w(j):
        return comp[j]["W"]

    def saved(j):
        b = blocks[j]
        return (b.act_bytes_checkpointed if ckpt else cst.saved_bytes(b)) * T

    def extra_rows(j):
        b = blocks[j]
        if not b.is_moe or ckpt:
            return 0.0
        mean, worst = cst.rows(b)
        return (worst - mean) * cst.saved_row_bytes(b)

    def keep(j):
        # what a split backward's weight pass still needs after the input pass
        b = blocks[j]
        return 0.0 if again(j) else min(b.wgrad_bytes, b.act_bytes) * T

    def recomputed_keep(j):
        # a checkpointed block under a split backward: the input pass recomputes it once and all it
        # saves stays for the weight pass (moe.recompute.checkpoint_once; the input pass retains the
        # graph), with the output gradients it captured for the weight operators; the CPU expert
        # kernel's pooled hiddens among it are held apart (stage_held)
        b = blocks[j]
        if not again(j):
            return 0.0
        return (cst.saved_bytes(b) + b.wgrad_captured_bytes) * T - cst.pooled_saved(b)

    def work_of(j, recomputing=True):
        # a layer's backward works in the larger of its own temporaries and its kernel's; with
        # checkpointing also the recomputed block's activations (its kernel's saved buffers are
        # kernel_buffers), where the pass recomputes (not a split backward's weight pass)
        b = blocks[j]
        w = max(b.transient_bytes * T, cst.kernel_backward(b))
        if recomputing and ckpt and again(j):
            w += cst.saved_bytes(b) * T + _extra_rows_ckpt(cst, b) - cst.pooled(b, saved_only=True)
        return w

    def a2a_of(j):
        # one MoE layer's All-to-All buffers, while its forward or backward exchanges rows
        return cst.a2a_bytes(blocks[j]) if rec.ep > 1 and blocks[j].is_moe else 0.0

    # ----- memory: each pipeline rank --------------------------------------------------------
    ranks = range(rec.pp)
    rank_stages = [[0] for _ in ranks] if plan is None else [plan.stages_of(r) for r in ranks]
    rank_layers = [[j for s in rank_stages[r] for j in range(*stages[s])] for r in ranks]
    if plan is not None:
        n_st, m = len(stages), plan.microbatches
        # torch's stages: every stage but the first receives its input into a buffer of its own
        # per micro-batch, every stage but the last its output's gradient, kept from step to step;
        # each forward's output is kept until its backward (the last stage's: the logits)
        recv_in = [T * blocks[lo - 1].boundary_bytes if s > 0 else 0.0 for s, (lo, _) in enumerate(stages)]
        recv_grad = [T * blocks[hi - 1].boundary_bytes if s < n_st - 1 else 0.0 for s, (_, hi) in enumerate(stages)]
        out = [
            T * (blocks[hi - 1].boundary_bytes if s < n_st - 1 else blocks[hi - 1].output_bytes)
            for s, (_, hi) in enumerate(stages)
        ]
        # the received input is what the stage's first layer saves of it (its norm's fp32 input;
        # a checkpointed block's input) unless that saves a copy (an fp32 copy of bf16)
        own_input = ckpt or cst.dtype == "fp32"
        # the saved hiddens the CPU expert kernel's pool holds: as many per layer as were alive at once
        hidden = [0.0 if ckpt else sum(cst.pooled_saved(blocks[j]) for j in range(*stages[s])) for s in range(n_st)]
        stage_act = [
            sum(saved(j) for j in range(*stages[s])) - hidden[s] + out[s] - (recv_in[s] if own_input else 0.0)
            for s in range(n_st)
        ]
        # what torch's pipeline runtime holds until the step's end: it waits for its sends there (the
        # multi-stage schedules; GPipe waits for its forward sends after the last forward, when the
        # backward still holds those outputs, and for its backward sends at the end; 1F1B waits for
        # each send at once), and a tensor sent to another rank lives as long as its send
        on_rank = [plan.rank_of(s) for s in range(n_st)]
        multi, gpipe = plan.style != "single", plan.schedule == "gpipe"
        sent_f = [out[s] if multi and s + 1 < n_st and on_rank[s + 1] != on_rank[s] else 0.0 for s in range(n_st)]
        sent_b = [
            recv_in[s] if (multi or gpipe) and s > 0 and on_rank[s - 1] != on_rank[s] else 0.0 for s in range(n_st)
        ]
        # what the weight pass still needs after the input pass, of what the forward added to the
        # walk: the kernel's pooled hiddens are held apart (stage_held), so they leave no hole here
        # (a split backward's input pass frees none of the stage's saved tensors: the weight pass
        # reads them, from the pool or not)
        stage_keep = [
            max(0.0, min(sum(keep(j) for j in range(*stages[s])) - hidden[s], stage_act[s] - sent_f[s]))
            + (sum(recomputed_keep(j) for j in range(*stages[s])) if plan.splits_backward else 0.0)
            for s in range(n_st)
        ]
        stage_extra = [sum(extra_rows(j) for j in range(*stages[s])) for s in range(n_st)]
        # ZeRO-2/3's full-size gradient buffers (grad_full_bytes, one per block) appear at their
        # stage's first backward: a peak before it (GPipe's, after all the forwards; an interleaved
        # rank's last stage's first backward before its others') is without them; with accumulation
        # the later rounds' forwards run with them
        stage_grads = [sum(grad_full_bytes(j) for j in range(*stages[s])) for s in range(n_st)]
        # each stage's backward working memory and All-to-All buffers, at its own actions in the walk
        stage_work = [max(work_of(j) for j in range(*stages[s])) for s in range(n_st)]
        stage_a2a = [max(a2a_of(j) for j in range(*stages[s])) for s in range(n_st)]
        stage_work_w = [max(work_of(j, recomputing=False) for j in range(*stages[s])) for s in range(n_st)]
        live = live_plan(
            plan,
            stage_act,
            stage_keep,
            stage_extra,
            stage_grads if rec.grad_accum == 1 else None,
            stage_work,
            stage_a2a,
            sent_f,
            sent_b,
            stage_work_w,
        )
        stage_held = [m * (recv_in[s] + recv_grad[s]) + live.stage_peak_count[s] * hidden[s] for s in range(n_st)]
        if ckpt and plan.splits_backward:
            # the recomputed blocks' pooled hiddens, held from the input pass to the weight pass: the
            # pool keeps as many as were held at once (kernel_buffers has one set, idle between passes)
            again_hidden = [
                sum(cst.pooled_saved(blocks[j]) for j in range(*stages[s]) if again(j)) for s in range(n_st)
            ]
            stage_held = [h + max(0, live.stage_peak_kept[s] - 1) * again_hidden[s] for s, h in enumerate(stage_held)]
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
        # a group of one rank holds its gradients only from the first backward to the step: they
        # are grad_full_bytes, in the activations' walk, not the states kept from step to step
        alone = [k for k, w in (("dense", rec.dp), ("expert", rec.edp)) if w == 1] if rec.zero_stage >= 2 else []
        parts["model_states"] = ms["device_total"] - sum(ms[k]["grads"] for k in alone)
        # the full size of each layer's sharded weights (and gradients), where the group shards them
        full = [
            (blocks[j].params_dense * (rec.dp > 1) + blocks[j].params_expert / rec.ep * (rec.edp > 1)) * cst.c_w
            for j in layers
        ]
        grad_full = [grad_full_bytes(j) for j in layers]
        if rec.zero_stage == 3:
            if rec.zero_hpz:  # the secondary partition: a 1/k slice of every block from its first forward on
                parts["gathered_params"] += sum(_secondary(cst, blocks[j]) for j in layers)
            if plan is not None:  # keep_gathered_across_microbatches: the stage's blocks, all step
                parts["gathered_params"] += sum(full)
            else:
                # a weight two blocks share is the engine's root unit, gathered for the whole pass;
                # of the others, the block computing and the one prefetched
                root = sum(f for j, f in zip(layers, full) if _is_tied(blocks, j))
                own = [0.0 if _is_tied(blocks, j) else f for j, f in zip(layers, full)]
                pairs = [own[a] + own[a + 1] for a in range(len(own) - 1)] or own
                parts["gathered_params"] += max(pairs) + root
                if profile.collective_copies:  # the prefetch in flight gathers into a buffer of its own
                    parts["gathered_params"] += max(own, default=0.0)
        # the reduction of a layer's gradients starts once its backward is done and is waited for at
        # the backward's end; a reduce-scatter in flight holds a copy of its input where the library
        # copies (stages 1-3; qgZ's all-to-alls send quantized rows instead)
        copy_rs = profile.collective_copies and rec.zero_stage >= 1 and not rec.zero_qgz
        in_flight = full if copy_rs else [0.0] * len(layers)
        if plan is None:
            work = [work_of(j) for j in layers]
            a2a = [a2a_of(j) for j in layers]
            # the saved hiddens the CPU expert kernel's pool holds stay allocated when the backward
            # has read them (the pool keeps its buffers from step to step): they do not drain
            hidden = [0.0 if ckpt else cst.pooled_saved(blocks[j]) for j in layers]
            acts = [saved(j) - h for j, h in zip(layers, hidden)]
            xs = [extra_rows(j) for j in layers]
            # the (last micro-batch's) backward: activations drain layer by layer as gradient
            # buffers fill (with accumulation the earlier micro-batches' are all there) and the
            # reductions of the layers done are in flight; the working memory and the All-to-All
            # buffers are the layer's whose backward runs (none at the head's, often the peak)
            best, arg = -1.0, 0
            for k in range(len(layers)):
                grads = sum(grad_full[k:] if rec.grad_accum == 1 else grad_full) + sum(in_flight[k + 1 :])
                v = sum(acts[: k + 1]) + sum(xs[: k + 1]) + grads + work[k] + a2a[k]
                if v > best:
                    best, arg = v, k
            parts["activations"] = sum(acts[: arg + 1]) + sum(hidden)
            parts["expert_rows"] = sum(xs[: arg + 1])
            parts["grad_buffers"] = sum(grad_full[arg:] if rec.grad_accum == 1 else grad_full)
            parts["grad_buffers"] += sum(in_flight[arg + 1 :])
            parts["workspace"], parts["a2a_buffers"] = work[arg], a2a[arg]
            count = 1
        else:
            held = sum(stage_held[s] for s in rank_stages[r])
            parts["activations"], parts["expert_rows"] = live.peak_bytes[r] + held, live.peak_extra[r]
            # under no_sync the whole step (accumulation), else from the rank's first backward
            parts["grad_buffers"] = live.peak_grads[r] if rec.grad_accum == 1 else sum(grad_full)
            parts["workspace"], parts["a2a_buffers"] = live.peak_work[r], live.peak_a2a[r]
            count = live.peak_count[r]
        parts["kernel_buffers"] = sum(cst.pooled(blocks[j]) for j in layers)
        per_rank.append((sum(parts.values()), parts, ms["host_total"], count))
    mem, parts, host, _ = max(per_rank, key=lambda x: x[0])
    count = max(x[3] for x in per_rank)

    # ----- time --------------------------------------------------------------------------------
    tp: dict[str, float] = {}
    if plan is None:
        layers = rank_layers[0]
        f_c = [layer_f(j) for j in layers]
        b_c = [layer_i(j) + layer_w(j) for j in layers][::-1]
        g, g2 = [gath[j] for j in layers], [gath2[j] for j in layers]
        gw, g2w = [gath_wait[j] for j in layers], [gath2_wait[j] for j in layers]
        gc, g2c = [gath_copy[j] for j in layers], [gath2_copy[j] for j in layers]
        z3 = rec.zero_stage == 3
        # the step's first forward gathers from the primary partition; the backwards and the later
        # forwards gather again (under hpZ from the secondary one, inside the node)
        ov = cst.overlap
        fwd = _beside(f_c, g, gc, gw, ov) if z3 else sum(f_c)
        fwd_again = _beside(f_c, g2, g2c, g2w, ov) if z3 else sum(f_c)
        bwd = _beside(b_c, g2[::-1], g2c[::-1], g2w[::-1], ov) if z3 else sum(b_c)
        # the last micro-batch's backward overlaps each layer's reduction with the layers before it
        r_rev = [red[j] for j in layers][::-1]
        if rec.dp == 1:
            last_bwd = bwd
        elif ov:
            last_bwd = max(bwd, _overlapped_reduction(b_c, r_rev))
        else:
            # what each reduction costs the computing cores adds to its layer's backward, and its
            # waits (α steps, gloo's thread asleep) overlap the layers still to run: the backward
            # gains those costs and the waits left after it
            w_rev = [terms.red_wait[j] for j in layers][::-1]
            own = [c + terms.red_copy[j] for c, j in zip(b_c, layers[::-1])]
            last_bwd = bwd + _overlapped_reduction(own, w_rev) - sum(b_c)
        pipeline = fwd + (rec.grad_accum - 1) * (fwd_again + bwd) + last_bwd
        forward = fwd + (rec.grad_accum - 1) * fwd_again
        tp.update(forward=forward, backward=rec.grad_accum * bwd, reduction_exposed=last_bwd - bwd)
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
        shares = profile.split_backward_shares(T) if plan.splits_backward else None
        if shares is not None:
            # a split backward's two passes as the profile measured them, each a share of the whole
            # (their sum above 1: the weight pass walks the graph again)
            dur["I"], dur["W"] = ([share * b for b in dur["B"]] for share in shares)
        if plan.splits_backward:
            # torch skips the first stage's input pass (its input, the tokens, takes no gradient)
            # and runs that stage's whole backward in its weight pass
            dur["I"][0], dur["W"][0] = 0.0, dur["B"][0]
        stage_rank = [plan.rank_of(s) for s in range(n_st)]
        # the hand-over from stage s to s + 1 (an activation forward, its gradient back), where
        # the two stages sit on different ranks (a V-shaped rank's two stages hand over in memory)
        hand = [
            cst.p2p(T * blocks[stages[s][1] - 1].boundary_bytes, stage_rank[s] * rec.dp, stage_rank[s + 1] * rec.dp)
            if s + 1 < n_st and stage_rank[s] != stage_rank[s + 1]
            else 0.0
            for s in range(n_st)
        ]
        if cst.overlap:  # something else moves the bytes: the hand-over is a wait between the ranks
            latency, p2p_f = hand, [0.0] * n_st
        else:
            # every core computes: a transfer is work on both ranks, the sender's action and the
            # receiver's, each paying its whole time, and nothing is left to wait for
            latency, p2p_f = [0.0] * n_st, [hand[s] + (hand[s - 1] if s else 0.0) for s in range(n_st)]
        # (the gradient's receive and send belong to the input pass, or the whole backward)
        for kind in ("F", "I", "B"):
            dur[kind] = [d + x for d, x in zip(dur[kind], p2p_f)]
        # parallel.pp_overlap: each overlapped pair's passes at once, each pass's MoE exchanges beside
        # the other's compute (schedule.simulate's rule); only where something other than the
        # computing cores runs the collectives (where every core computes they take the cores' time).
        # DualPipeV's pairs are a forward and a full backward: the backward's exchanges are its
        # input part's, and under recomputation the recomputed forward's again (but the statistics')
        comm = None
        if plan.overlap and cst.overlap:
            comm = {
                "F": [sum(moe[j]["F"] for j in range(*stages[s])) for s in range(n_st)],
                "B": [sum(moe[j]["I"] + moe[j]["R"] * again(j) for j in range(*stages[s])) for s in range(n_st)],
            }
        plain = simulate_plan(plan, stage_rank, dur, latency, None, comm)
        first_round = plain
        if rec.zero_stage == 3 and any(gath):
            # the step's first forward of each stage gathers its blocks (kept until the step)
            first = {
                "F": {
                    s: _beside(
                        [layer_f(j) for j in range(*stages[s])],
                        [gath[j] for j in range(*stages[s])],
                        [gath_copy[j] for j in range(*stages[s])],
                        [gath_wait[j] for j in range(*stages[s])],
                        cst.overlap,
                    )
                    + p2p_f[s]
                    for s in range(n_st)
                }
            }
            first_round = simulate_plan(plan, stage_rank, dur, latency, first, comm)
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
        gathers=max(
            sum(gath[j] for j in layers) + (0 if plan is not None else (2 * passes - 1) * sum(gath2[j] for j in layers))
            for layers in rank_layers
        ),
        # the MoE layers' synchronous exchanges, the recomputed forwards' under checkpointing too
        moe_comm=max(sum(moe[j]["F"] + moe[j]["R"] * again(j) + moe[j]["I"] for j in layers) for layers in rank_layers)
        * passes,
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
        comm_bytes=comm_bytes(rec, costs, profile.node_size),
        memory_parts_by_pp_rank=tuple(dict(x[1]) for x in per_rank),
    )


def _secondary(cst: _Costing, b: BlockCost) -> float:
    """hpZ: bytes of layer ``b``'s secondary slice on this rank, 1/k of its weights per sharding
    group (k: the group's members on this node; one a node keeps the whole layer)."""
    if b.shares_params_with is not None:
        return 0.0
    return sum(elems * cst.c_w / len(cst.groups.local(ranks)) for elems, ranks in cst._sharded(b) if len(ranks) > 1)


def _is_tied(blocks, j) -> bool:
    return any(b.shares_params_with == j for b in blocks)


def _extra_rows_ckpt(cst: _Costing, b: BlockCost) -> float:
    """The recomputed MoE block's rows beyond the mean load (its activations are the workspace)."""
    if not b.is_moe:
        return 0.0
    mean, worst = cst.rows(b)
    return (worst - mean) * cst.saved_row_bytes(b)
