"""Pipeline stages on ``torch.distributed.pipelining``, composed with ``ZeroEngine``.

A model made of ``num_layers`` pipeline layers (for ``moe.model.Transformer``: the embedding, each
block, the head) is cut into ``pp * pp_virtual_stages`` stages of consecutive layers. Each pipeline
rank runs ``pp_virtual_stages`` of them (its *chunks*) under one of torch's schedules; the dp ranks
of a stage are ordinary ZeRO data parallelism (``layout.dp_group``, experts over ``layout.ep_group``
and ``layout.edp_group``, never across stages), and activations cross ``layout.pp_group``.

    plan = plan_pipeline(model.num_pipeline_layers, pp=layout.pp, pp_schedule="1f1b", pp_microbatches=8)
    ranges = [plan.ranges[s] for s in plan.stages_of(layout.pp_rank)]
    held = model.keep_layers(ranges)                   # this rank's layers, parameters under their names
    chunks = [model.pipeline_stage(lo, hi) for lo, hi in ranges]
    engine = ZeroEngine(held, layout, stage=3, blocks=default_blocks(held), entries=chunks,
                        keep_gathered_across_microbatches=True, optimizer=...)
    pipe = Pipeline(chunks, plan, layout, engine, loss_fn=cross_entropy)
    losses = pipe.step(x, y)        # m micro-batches through the schedule; the last stage's losses
    engine.step()

What the engine learns from the schedule: every backward of a step runs inside
``engine.no_sync()`` (local accumulation only), and the schedule's own ``last_backward`` flag (the
signal torch gives FSDP2 and DDP) marks each chunk's last backward of the step; after the last one of
all this rank's chunks, ``engine.start_reduction()`` launches the data-parallel reduction while other
stages are still draining the pipeline, and ``engine.step()`` waits for it. The zero-bubble
schedules' weight-gradient pass assigns ``.grad`` itself instead of accumulating through autograd;
``engine.accumulate_param_grads`` moves those gradients into the engine's buffers. Under ZeRO-3 the
engine keeps a stage's blocks gathered from their first forward to the step
(``keep_gathered_across_microbatches``): every schedule interleaves forwards and backwards of
different micro-batches, and the split input/weight backward needs the weights twice.

Overlapped pairs (``plan.overlap``, ``parallel.pp_overlap``; DualPipeV only): the schedule's
forward-backward pairs run their two passes at once, the forward on a worker thread, the backward on
twins of the layout's process groups (``Layout.twin_groups``, ``routing_kernels.runtime.comm_lane``),
so one pass's All-to-All waits beside the other's compute; docs/design.md says why that is safe.

Loss scaling: the loss of each micro-batch is multiplied by ``loss_scale`` (the trainer gives
1 / (micro-batches x accumulation rounds)), and torch's own ``scale_grads`` is off, so gradients
are the global-batch mean exactly as under gradient accumulation without a pipeline; the losses
``step`` returns are the unscaled per-micro-batch values.
"""

from __future__ import annotations

import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed import pipelining as tpp
from torch.distributed.pipelining import schedules as tsched

from routing_kernels.runtime import comm_lane

from .engine import ZeroEngine
from .layout import Layout

# name -> (torch schedule class name, how stages map to ranks, virtual stages per rank it takes)
#   "single": one stage per rank; "loop": stage s on rank s % pp; "v": rank r holds r and 2pp-1-r
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "single"),
    "1f1b": ("Schedule1F1B", "single"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", "loop"),
    "zbv": ("ScheduleZBVZeroBubble", "v"),
    "dualpipev": ("ScheduleDualPipeV", "v"),
}
# the zero-bubble schedules: a stage's backward in two passes over one autograd graph, the input
# gradients (retain_graph=True) and later the weight gradients
SPLIT_BACKWARD = frozenset({"interleaved_zb", "zbv", "dualpipev"})


def even_split(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage, as even as possible; the first ``num_layers % num_stages`` stages take one more."""
    q, r = divmod(num_layers, num_stages)
    return [q + 1] * r + [q] * (num_stages - r)


@dataclass(frozen=True)
class PipelinePlan:
    """Which layers each stage holds and which pipeline rank runs it."""

    pp: int
    virtual: int
    schedule: str
    microbatches: int
    ranges: tuple[tuple[int, int], ...]  # [lo, hi) of each stage, by global stage index
    # dualpipev: each overlapped forward-backward pair runs its two passes at once, the backward's
    # collectives on groups of their own (``Pipeline``), so one pass's All-to-All waits beside the
    # other's compute
    overlap: bool = False

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual

    @property
    def style(self) -> str:
        return SCHEDULES[self.schedule][1]

    @property
    def splits_backward(self) -> bool:
        return self.schedule in SPLIT_BACKWARD

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stage indices pipeline rank ``pp_rank`` runs, in order."""
        if self.style == "v":
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return list(range(pp_rank, self.num_stages, self.pp))

    def rank_of(self, stage: int) -> int:
        return next(r for r in range(self.pp) if stage in self.stages_of(r))

    def describe(self) -> str:
        return (
            f"pp={self.pp} x {self.virtual} virtual, schedule {self.schedule}, {self.microbatches} micro-batches, "
            f"layers per stage {[hi - lo for lo, hi in self.ranges]}"
            + (", forward-backward pairs overlapped" if self.overlap else "")
        )


def plan_pipeline(
    num_layers: int,
    *,
    pp: int,
    pp_schedule: str = "1f1b",
    pp_microbatches: int = 1,
    pp_virtual_stages: int = 1,
    pp_layers: list[int] | None = None,
    pp_overlap: bool = False,
) -> PipelinePlan:
    """Validate a pipeline configuration (before any collective) and cut ``num_layers`` layers
    into stages: ``pp_layers`` gives the layers of each of the ``pp * pp_virtual_stages`` stages in
    order (uneven allowed), default ``even_split``. Every error names the values and what is valid."""
    for name, v in (("pp", pp), ("pp_microbatches", pp_microbatches), ("pp_virtual_stages", pp_virtual_stages)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r} is invalid: expected a positive integer")
    if pp_schedule not in SCHEDULES:
        raise ValueError(f"pp_schedule={pp_schedule!r} is invalid: expected one of {sorted(SCHEDULES)}")
    validate_pp_overlap(pp_schedule, pp_overlap)
    style, v, m = SCHEDULES[pp_schedule][1], pp_virtual_stages, pp_microbatches
    if style == "single" and v != 1:
        raise ValueError(
            f"pp_schedule={pp_schedule} runs one stage per rank, but pp_virtual_stages={v}: use "
            f"pp_virtual_stages=1, or an interleaved schedule (interleaved_1f1b, interleaved_zb, zbv, dualpipev)"
        )
    if style == "loop" and v < 2:
        raise ValueError(
            f"pp_schedule={pp_schedule} interleaves several stages per rank: pp_virtual_stages={v} must be >= 2"
        )
    if style == "v" and v != 2:
        raise ValueError(
            f"pp_schedule={pp_schedule} is V-shaped, exactly two stages per rank: pp_virtual_stages={v} must be 2"
        )
    num_stages = pp * v
    if pp_layers is None:
        if num_layers < num_stages:
            raise ValueError(
                f"{num_layers} pipeline layers (the embedding, each block and the head) cannot fill "
                f"pp={pp} x pp_virtual_stages={v} = {num_stages} stages: each stage needs at least one layer"
            )
        sizes = even_split(num_layers, num_stages)
    else:
        sizes = list(pp_layers)
        if (
            len(sizes) != num_stages
            or any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in sizes)
            or sum(sizes) != num_layers
        ):
            raise ValueError(
                f"pp_layers={sizes} is invalid: expected {num_stages} positive integers "
                f"(pp={pp} x pp_virtual_stages={v} stages) summing to the {num_layers} pipeline layers "
                f"(the embedding, each block, the head)"
            )
    # what torch's schedules need of the micro-batch count, checked here to name the keys
    if pp_schedule == "1f1b" and m < pp:
        raise ValueError(f"pp_microbatches={m} is below what 1f1b needs: at least pp={pp} micro-batches")
    if pp_schedule == "dualpipev" and m < num_stages:
        raise ValueError(
            f"pp_microbatches={m} is below what dualpipev needs: at least 2 x pp={num_stages} micro-batches"
        )
    if style == "loop":
        rounds = max(1, m // pp)
        if m % rounds:
            raise ValueError(
                f"pp_microbatches={m} does not suit {pp_schedule} with pp={pp}: it runs the micro-batches in "
                f"rounds of pp, so use at most pp or a multiple of pp micro-batches"
            )
    ranges, lo = [], 0
    for k in sizes:
        ranges.append((lo, lo + k))
        lo += k
    return PipelinePlan(
        pp=pp, virtual=v, schedule=pp_schedule, microbatches=m, ranges=tuple(ranges), overlap=pp_overlap
    )


# the schedules whose order has overlapped forward-backward pairs (torch's OVERLAP_F_B actions)
OVERLAP_SCHEDULES = frozenset({"dualpipev"})


def validate_pp_overlap(pp_schedule: str, pp_overlap) -> None:
    """``pp_overlap`` (``parallel.pp_overlap``) is a bool, true only under a schedule with overlapped
    forward-backward pairs (``OVERLAP_SCHEDULES``)."""
    if not isinstance(pp_overlap, bool):
        raise ValueError(f"pp_overlap={pp_overlap!r} is invalid: expected true or false")
    if pp_overlap and pp_schedule not in OVERLAP_SCHEDULES:
        raise ValueError(
            f"pp_overlap=true needs a schedule with overlapped forward-backward pairs "
            f"({', '.join(sorted(OVERLAP_SCHEDULES))}), but pp_schedule={pp_schedule}: use "
            f"pp_schedule=dualpipev, or pp_overlap=false"
        )


class _EngineStage(tpp.PipelineStage):
    """torch's ``PipelineStage`` whose backward passes accumulate into a ``ZeroEngine`` and tell
    the owning ``Pipeline`` when the schedule says a backward is this stage's last of the step."""

    def __init__(self, pipeline: Pipeline, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pipeline = pipeline

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        # the whole schedule runs inside engine.no_sync() (Pipeline._run)
        result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if backward_type == "weight":  # the split weight pass assigns .grad itself
            self._pipeline.engine.accumulate_param_grads(self.submod.parameters())
        if last_backward:
            self._pipeline._stage_finished(self.stage_index)
        return result

    def _compute_outputs(self, *args, module, **kwargs):
        # torch calls this only for its shape inference at the first step, on stand-in inputs:
        # in eval mode, so modules that count what passes through them in training (routers'
        # load statistics, the trainer's metrics) do not count a forward that is no micro-batch
        modes = [(m, m.training) for m in module.modules()]
        module.train(False)
        try:
            return super()._compute_outputs(*args, module=module, **kwargs)
        finally:
            for m, training in modes:
                m.training = training

    # torch 2.13's runtime keeps a V-shaped schedule's backward actions in its forward-only
    # eval(); their backward is skipped, but the hand-over of input gradients between the two
    # stages of one rank is not, and fails: with no backward there is nothing to hand over
    def get_local_bwd_output(self, mb_index):
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index):
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)


class Pipeline:
    """One pipeline rank's chunks (``plan.stages_of(layout.pp_rank)``, in order) under the
    plan's schedule, with gradients into ``engine`` (see the module docstring). ``loss_fn(output,
    target)`` is the per-micro-batch loss on the last stage (a mean over its tokens)."""

    def __init__(
        self,
        chunks: list[nn.Module],
        plan: PipelinePlan,
        layout: Layout,
        engine: ZeroEngine,
        loss_fn,
        device: torch.device | None = None,
    ):
        if layout.pp != plan.pp:
            raise ValueError(f"the plan has pp={plan.pp} but the layout pp={layout.pp}")
        mine = plan.stages_of(layout.pp_rank)
        if len(chunks) != len(mine):
            raise ValueError(
                f"pipeline rank {layout.pp_rank} runs stages {mine}: pass {len(mine)} chunk modules, got {len(chunks)}"
            )
        held = {id(p) for p in engine.module.parameters()}
        for c in chunks:
            if any(id(p) not in held for p in c.parameters()):
                raise ValueError(
                    "every chunk's parameters must be held by the engine's module (build it with "
                    "keep_layers over this rank's stage ranges)"
                )
        self.plan, self.layout, self.engine, self.loss_fn = plan, layout, engine, loss_fn
        self.device = device if device is not None else engine.device
        self.stage_ids = mine
        self.loss_scale = 1.0
        self._reduce_after = True
        self._finished: set[int] = set()
        self._unscaled: dict[int, torch.Tensor] = {}  # id of a scaled loss -> the loss
        if plan.splits_backward:
            # torch's checkpoint recomputes once per graph task, and a split backward runs one for
            # the input pass and one per parameter group for the weight pass: a chunk that offers
            # it (moe's Transformer) recomputes once for all of them
            for c in chunks:
                if hasattr(c, "recompute_once"):
                    c.recompute_once = True
        self.stages = [
            _EngineStage(self, c, s, plan.num_stages, self.device, group=layout.pp_group) for c, s in zip(chunks, mine)
        ]
        cls = getattr(tpp, SCHEDULES[plan.schedule][0])
        arg = self.stages[0] if plan.style == "single" else self.stages
        self.schedule = cls(arg, n_microbatches=plan.microbatches, loss_fn=self._loss, scale_grads=False)
        self.is_first = 0 in mine
        self.is_last = plan.num_stages - 1 in mine
        # plan.overlap: each of the schedule's overlapped forward-backward pairs runs its two passes
        # at once, the forward in a worker thread on the layout's groups, the backward here on
        # their twins (every rank of a stage runs the same pairs in the same order, so each lane's
        # collectives meet their peers'; on one group the two lanes' collectives would interleave
        # differently on each rank). overlapped_pairs counts the pairs of the last step
        self.overlapped_pairs = 0
        self._pair_open = self._reduce_pending = False
        if plan.overlap:
            self._check_overlap_runtime()
            self._by_index = {st.stage_index: st for st in self.stages}
            self._twins = layout.twin_groups()  # every rank creates them, in the same order
            self._forward_lane = ThreadPoolExecutor(1, thread_name_prefix="pipeline-forward-lane")
            weakref.finalize(self, self._forward_lane.shutdown, wait=False)
            self.schedule.register_custom_function(tsched.OVERLAP_F_B, self._overlap_f_b)

    def _loss(self, output, target):
        loss = self.loss_fn(output, target)
        scaled = loss * self.loss_scale
        self._unscaled[id(scaled)] = loss.detach()
        return scaled

    def _stage_finished(self, stage_index: int) -> None:
        self._finished.add(stage_index)
        if self._reduce_after and len(self._finished) == len(self.stages):
            if self._pair_open:  # launched once the pair is done, on the layout's own groups
                self._reduce_pending = True
            else:
                self.engine.start_reduction()

    # ----- overlapped forward-backward pairs (plan.overlap) ----------------------------------------
    def _check_overlap_runtime(self) -> None:
        """What ``_overlap_f_b`` reads of torch's schedule runtime (private to torch), checked once."""
        need = ("fwd_recv_ops", "bwd_recv_ops", "backward_counter", "_n_microbatches")
        missing = [a for a in need if not hasattr(self.schedule, a)]
        helpers = ("_maybe_compute_loss", "_maybe_get_loss", "register_custom_function")
        missing += [a for a in helpers if not hasattr(self.schedule, a)]
        if missing or not hasattr(tsched, "OVERLAP_F_B") or not hasattr(tsched, "_wait_batch_p2p"):
            raise RuntimeError(
                f"pp_overlap=true needs torch.distributed.pipelining's schedule runtime with overlapped "
                f"forward-backward actions (torch {torch.__version__} lacks {missing or ['OVERLAP_F_B']}): "
                f"use pp_overlap=false"
            )

    def _overlap_f_b(self, action, ctx) -> None:
        """torch's OVERLAP_F_B action (DualPipeV: the forward of one micro-batch on one of this rank's
        stages and the full backward of another on the other): the forward in the worker thread,
        under this thread's grad mode and autocast, the backward here on the twin groups; what each
        does is what torch's runtime does for a FORWARD and a FULL_BACKWARD action."""
        subs = action.sub_actions or ()
        kinds = tuple(a.computation_type for a in subs)
        if kinds != (tsched.FORWARD, tsched.FULL_BACKWARD):
            raise RuntimeError(f"an overlapped pair of {kinds}: expected a forward and then a full backward")
        fwd, bwd = subs
        grad = torch.is_grad_enabled()
        dev = self.device.type
        cast = torch.is_autocast_enabled(dev)
        cast_dtype = torch.get_autocast_dtype(dev)

        def forward():
            with torch.set_grad_enabled(grad), torch.autocast(dev, dtype=cast_dtype, enabled=cast):
                self._pair_forward(ctx, fwd)

        self._pair_open = True
        try:
            running = self._forward_lane.submit(forward)
            try:
                with comm_lane(self._twins):
                    self._pair_backward(bwd)
            finally:
                running.result()  # the forward's error, if any, after the backward's own
        finally:
            self._pair_open = False
        self.overlapped_pairs += 1
        if self._reduce_pending:
            self._reduce_pending = False
            self.engine.start_reduction()

    def _pair_forward(self, ctx, a) -> None:
        sched, stage, mb = self.schedule, self._by_index[a.stage_index], a.microbatch_index
        if not stage.is_first and a.stage_index - 1 not in self._by_index:
            tsched._wait_batch_p2p(sched.fwd_recv_ops.pop((a.stage_index, mb)))
        output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], save_forward_output=False)
        sched._maybe_compute_loss(stage, output, ctx.target_mbs, mb)
        if a.stage_index + 1 in self._by_index:  # a V's two stages hand over in memory
            self._by_index[a.stage_index + 1].set_local_fwd_input(output, mb)

    def _pair_backward(self, a) -> None:
        sched, stage, mb = self.schedule, self._by_index[a.stage_index], a.microbatch_index
        if not stage.is_last and a.stage_index + 1 not in self._by_index:
            tsched._wait_batch_p2p(sched.bwd_recv_ops.pop((a.stage_index, mb)))
        loss = sched._maybe_get_loss(stage, mb)
        sched.backward_counter[a.stage_index] += 1
        last = sched.backward_counter[a.stage_index] == sched._n_microbatches
        stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last)
        if a.stage_index - 1 in self._by_index:
            self._by_index[a.stage_index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)

    def _run(self, run, x, y, kwargs: dict) -> list[torch.Tensor]:
        self._finished, self._unscaled, losses = set(), {}, []
        self.overlapped_pairs = 0
        args = (x,) if self.is_first else ()
        # the schedule's own list: its first step also evaluates the loss function while it infers
        # the stages' shapes, and that call is not a micro-batch
        # every backward accumulates locally, including the one the schedule's first step runs to
        # infer the gradients' shapes; start_reduction() follows the last real one
        with self.engine.no_sync():
            # return_outputs=False: the losses are all the step returns, and torch's last stage would
            # otherwise keep every micro-batch's output (the logits) until the next step
            run(
                *args,
                target=y if self.is_last else None,
                losses=losses if self.is_last else None,
                return_outputs=False,
                **kwargs,
            )
        out = [self._unscaled[id(loss)] for loss in losses]
        self._unscaled = {}
        return out

    def step(
        self, x: torch.Tensor | None, y: torch.Tensor | None, *, reduce: bool = True, **kwargs
    ) -> list[torch.Tensor]:
        """Forward and backward of one batch (split into the plan's micro-batches) through the
        pipeline; ``x`` is needed on the rank holding the first stage, ``y`` on the one holding the
        last. ``kwargs``: keyword inputs of every stage's forward (``doc_ids``), given on every
        rank and split into micro-batches along dim 0 like ``x``. ``reduce=False`` (all but the last
        round of gradient accumulation) leaves the gradients local. Returns the last stage's
        per-micro-batch losses (empty elsewhere)."""
        self._reduce_after = reduce
        return self._run(self.schedule.step, x, y, kwargs)

    @torch.no_grad()
    def eval(self, x: torch.Tensor | None, y: torch.Tensor | None, **kwargs) -> list[torch.Tensor]:
        """Forward only (the schedule's ``eval``); the last stage's per-micro-batch losses."""
        return self._run(self.schedule.eval, x, y, kwargs)
