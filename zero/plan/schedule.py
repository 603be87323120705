"""A pipeline schedule's order of actions on each rank, as torch.distributed.pipelining runs it, and
what follows from that order alone: the activations each rank keeps alive and, given each action's
duration, the step's length and bubble.

Actions are ``(kind, stage, microbatch)`` with kind F (forward), B (full backward), I (backward
for the input) and W (backward for the weights). A rank's order is a list of groups: one action,
or DualPipeV's overlapped forward-backward pair (torch's OVERLAP_F_B: the forward of one
micro-batch on one of the rank's stages, the full backward of another on its other stage), which,
as in ``experiments/bench_pipeline.simulate``, starts once the inputs of both exist. torch's
runtime runs the pair's passes one after the other; under ``parallel.pp_overlap`` the trainer runs
them at once, each pass's exchanges (the MoE All-to-All) waiting beside the other's compute
(``simulate``'s ``comm``).

Where the order comes from: for the multi-stage schedules (interleaved_1f1b, interleaved_zb, zbv,
dualpipev) torch builds it in the constructor and its runtime executes exactly that list, so it is
taken from the schedule class itself, built over stand-in stages (no process group, no module).
The single-stage schedules (gpipe, 1f1b) do not execute their ``pipeline_order``: their
``_step_microbatches`` runs a fixed loop, mirrored here. (torch 2.13's ``Schedule1F1B`` IR also
differs from what it runs: its last rank starts at micro-batch 1 and warms up one forward less.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch.nn as nn
from torch.distributed import pipelining as tpp

from ..pipeline import SCHEDULES, PipelinePlan

Action = tuple[str, int, int]


class _StandInStage:
    """The attributes torch's schedule constructors read of a stage, and nothing else."""

    def __init__(self, stage_index: int, num_stages: int, pp: int, rank: int):
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_size, self.group_rank = pp, rank
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.submod = nn.Identity()


def _single_stage(schedule: str, pp: int, m: int) -> dict[int, list[list[Action]]]:
    out = {}
    for r in range(pp):
        if schedule == "gpipe":
            acts = [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)]
        else:  # Schedule1F1B._step_microbatches: warm up pp - stage forwards, then B,F pairs, then the rest
            warm = min(m, pp - r)
            acts = [("F", r, i) for i in range(warm)]
            f, b = warm, 0
            while True:
                acts.append(("B", r, b))
                b += 1
                if f == m:
                    break
                acts.append(("F", r, f))
                f += 1
            acts += [("B", r, i) for i in range(b, m)]
        out[r] = [[a] for a in acts]
    return out


_KINDS = {"F": "F", "B": "B", "I": "I", "W": "W"}


@functools.lru_cache(maxsize=512)
def _orders(schedule: str, pp: int, virtual: int, m: int) -> tuple:
    if SCHEDULES[schedule][1] == "single":
        orders = _single_stage(schedule, pp, m)
    else:
        plan = PipelinePlan(pp=pp, virtual=virtual, schedule=schedule, microbatches=m, ranges=())
        stages = [_StandInStage(s, pp * virtual, pp, 0) for s in plan.stages_of(0)]
        cls = getattr(tpp, SCHEDULES[schedule][0])
        sched = cls(stages, n_microbatches=m, loss_fn=lambda out, target: out, scale_grads=False)
        orders = {}
        for r, actions in sched.pipeline_order.items():
            groups = []
            for a in actions:
                if a is None:
                    continue
                subs = a.sub_actions or [a]
                group = [
                    (_KINDS[x.computation_type.value], x.stage_index, x.microbatch_index)
                    for x in subs
                    if x.computation_type.value in _KINDS
                ]
                if group:
                    groups.append(group)
            orders[r] = groups
    return tuple(tuple(tuple(g) for g in orders[r]) for r in range(pp))


def rank_orders(plan: PipelinePlan) -> tuple:
    """``orders[r]``: pipeline rank r's action groups in the order it runs them."""
    return _orders(plan.schedule, plan.pp, plan.virtual, plan.microbatches)


@dataclass(frozen=True)
class LiveActivations:
    peak_bytes: tuple[float, ...]  # per rank: the most activation bytes alive at once
    peak_extra: tuple[float, ...]  # per rank: the second accumulator at that same moment
    peak_count: tuple[int, ...]  # per rank: the most (stage, micro-batch) forwards alive at once
    # per stage: the most of its micro-batches' forwards alive at once (whatever the rank's moment)
    stage_peak_count: tuple[int, ...] = ()
    # per stage: the most of its micro-batches between their input and weight passes at once
    stage_peak_kept: tuple[int, ...] = ()
    # per rank: of its stages' ``grads``, what was there at the peak (0 before their first backward)
    peak_grads: tuple[float, ...] = ()
    # per rank: the working memory and the All-to-All buffers of the action at the peak
    peak_work: tuple[float, ...] = ()
    peak_a2a: tuple[float, ...] = ()


def live_activations(
    orders, act, keep, extra=None, grads=None, work=None, a2a=None, sent_f=None, sent_b=None, work_w=None
) -> LiveActivations:
    """Walk each rank's order: F of stage s adds ``act[s]`` (and ``extra[s]``), I leaves ``keep[s]``
    of it for the weight pass, W frees that, B frees it all; a stage's first action that computes
    weight gradients (W or B; a split backward's input pass does not) adds ``grads[s]`` for the
    rest of the walk (the full-size gradient buffers ZeRO-2/3 fill from then on, one per block, as
    that first pass frees what it read: counted from its end; a rank's other stages have theirs
    from their own first).

    While a backward action of stage s (I, W or B) runs, before it frees anything, its working
    memory ``work[s]`` is there too (``work_w[s]`` at a weight pass, default ``work``: a block the
    input pass recomputed is in ``keep`` by then), and while a pass that exchanges rows runs (F, I
    or B) the stage's All-to-All buffers ``a2a[s]``: each at its own stage's actions, not the
    largest at every moment.

    What a send to another rank holds until the step's end (torch's runtime waits for its sends
    there): ``sent_f[s]``, part of ``act[s]``, stays when the backward frees the rest (the stage's
    output, sent on by the forward), and ``sent_b[s]`` joins at the input pass or whole backward
    (the input's gradient, sent back). The peak is over the walk; the schedule's timing does not
    change which forwards are alive, only the order does."""
    n = len(act)
    extra = extra or [0.0] * n
    grads = grads or [0.0] * n
    work = work or [0.0] * n
    a2a = a2a or [0.0] * n
    sent_f = sent_f or [0.0] * n
    sent_b = sent_b or [0.0] * n
    work_w = work_w or work
    peaks, extras, counts, at_peak, works, a2as = [], [], [], [], [], []
    stage_alive, stage_most = [0] * n, [0] * n
    stage_kept, stage_most_kept = [0] * n, [0] * n
    for groups in orders:
        live = x = g = 0.0
        filling: set[int] = set()  # the stages whose gradient buffers this rank has
        best = (0.0, 0.0, 0.0, 0.0, 0.0)

        def see(*moment):
            nonlocal best
            if sum(moment) > sum(best):
                best = moment

        alive = most = 0  # forwards whose input-gradient pass has not run
        for group in groups:
            for kind, s, _ in group:
                if kind == "F":
                    live += act[s]
                    x += extra[s]
                    alive += 1
                    stage_alive[s] += 1
                    stage_most[s] = max(stage_most[s], stage_alive[s])
                    see(live, x, g, 0.0, a2a[s])  # the forward's exchanges, its activations made
                else:  # a backward pass at work, all it reads still there
                    see(live, x, g, work_w[s] if kind == "W" else work[s], 0.0 if kind == "W" else a2a[s])
                if kind in "WB" and s not in filling:  # the weights' gradients, filled as the pass
                    filling.add(s)  # frees what it read: counted once it has run
                    g += grads[s]
                if kind in "IB":  # the input's gradient, sent back and held by its send
                    live += sent_b[s]
                if kind == "I":
                    live -= act[s] - sent_f[s] - keep[s]
                    x -= extra[s]
                    alive -= 1
                    stage_alive[s] -= 1
                    stage_kept[s] += 1
                    stage_most_kept[s] = max(stage_most_kept[s], stage_kept[s])
                elif kind == "W":
                    live -= keep[s]
                    stage_kept[s] -= 1
                elif kind == "B":
                    live -= act[s] - sent_f[s]
                    x -= extra[s]
                    alive -= 1
                    stage_alive[s] -= 1
                see(live, x, g, 0.0, 0.0)
                most = max(most, alive)
        peaks.append(best[0])
        extras.append(best[1])
        at_peak.append(best[2])
        works.append(best[3])
        a2as.append(best[4])
        counts.append(most)
    return LiveActivations(
        tuple(peaks),
        tuple(extras),
        tuple(counts),
        tuple(stage_most),
        tuple(stage_most_kept),
        tuple(at_peak),
        tuple(works),
        tuple(a2as),
    )


def _deps(kind: str, s: int, mb: int, num_stages: int) -> list[tuple]:
    # a forward needs the previous stage's forward of that micro-batch, an input gradient ("G",
    # from I or B) the next stage's and its own forward, a weight gradient its own input gradient
    if kind == "F":
        return [] if s == 0 else [("F", s - 1, mb)]
    if kind in "IB":
        return [("F", s, mb)] + ([] if s == num_stages - 1 else [("G", s + 1, mb)])
    return [("G", s, mb)]


@dataclass(frozen=True)
class Simulated:
    makespan: float  # the step's pipeline part: the last rank's last action
    finish: tuple[float, ...]  # per rank: when its last action ends
    busy: tuple[float, ...]  # per rank: the time it computes

    @property
    def bubble(self) -> float:
        """The busiest rank's idle fraction of the makespan: what a perfect schedule of these
        stages would still save (a rank with lighter stages idles more, but does not set the pace)."""
        return 1 - max(self.busy) / self.makespan if self.makespan > 0 else 0.0


def simulate(orders, stage_rank, dur, latency=None, first=None, comm=None) -> Simulated:
    """Each rank runs its groups in order, a group as soon as the rank is free and the inputs of
    the whole group exist. ``dur[kind][s]``: the duration of stage s's pass of that kind;
    ``latency[s]``: the time an activation (forward) or gradient (backward) takes between stage s
    and s + 1 (only across ranks: the two stages of one V-shaped rank hand over in memory);
    ``first[kind][s]``: the duration of stage s's first pass of that kind, when it differs (ZeRO-3
    gathers the weights in the first forward of a step). With unit durations and free
    communication this is ``experiments/bench_pipeline.simulate``. Event-driven: a rank blocked on
    an input waits for the action that makes it, so each action is looked at a few times only.

    ``comm`` (None: every group's actions one after the other): the passes of a group of several
    actions (DualPipeV's overlapped pairs under ``parallel.pp_overlap``) run at once, and
    ``comm[kind][s]`` is the part of stage s's pass of that kind that waits on its exchanges (the
    MoE All-to-All; a kind not in it: none), the rest of the pass's duration its compute. The
    pair's forward runs as it would alone and ends as it would alone (its output is what the next
    stage waits for); the backward computes while the forward's exchanges wait and exchanges
    while the forward computes, and does the rest after. That takes exactly
    max(cF + cB, mF + mB, dF, dB) (c: compute, m: exchanges, d = c + m: a pass's duration): each
    pass's exchanges hidden behind the other's compute, as far as the other has compute, and never
    less than either pass alone. The pair's backward ends with it. (Generally: the group takes
    max(sum of c, sum of m, largest d), and each action ends at the earlier of its end one after
    the other and the group's end.) Where that hides nothing (no exchanges), exactly one after
    the other."""
    num_stages = len(stage_rank)
    latency = latency or [0.0] * num_stages
    first = first or {}
    tag = lambda kind, s, mb: ("G" if kind in "IB" else kind, s, mb)  # noqa: E731
    finish: dict[tuple, float] = {}
    seen: set[tuple[str, int]] = set()
    n = len(orders)
    free, busy, pos = [0.0] * n, [0.0] * n, [0] * n
    waiting: dict[tuple, list[int]] = {}
    ready_ranks = list(range(n))
    while ready_ranks:
        r = ready_ranks.pop()
        groups = orders[r]
        while pos[r] < len(groups):
            group = groups[pos[r]]
            inside = {tag(*a) for a in group}
            deps = [d for a in group for d in _deps(a[0], a[1], a[2], num_stages) if d not in inside]
            missing = next((d for d in deps if d not in finish), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(r)
                break
            t = free[r]
            for kind, s, mb in deps:
                # a dependency on the neighbouring stage on another rank crosses the link
                # between them: stage s -> s + 1 for an activation, s - 1 <- s for a gradient
                hop = 0.0 if stage_rank[s] == r else latency[s if kind == "F" else s - 1]
                t = max(t, finish[(kind, s, mb)] + hop)
            ds = []
            for kind, s, _ in group:
                d = dur[kind][s]
                if (kind, s) not in seen:
                    seen.add((kind, s))
                    d = first.get(kind, {}).get(s, d)
                ds.append(d)
            span = None
            if comm is not None and len(group) > 1:
                ms = [comm[kind][s] if kind in comm else 0.0 for kind, s, _ in group]
                span = max(sum(ds) - sum(ms), sum(ms), max(ds))
            if span is not None and span < sum(ds):  # at once: the group's end, the first pass's as alone
                start, ends = t, []
                for d in ds:
                    t += d
                    ends.append(min(t, start + span))
                busy[r] += span
            else:  # one after the other (nothing to hide: exactly so)
                ends = []
                for d in ds:
                    t += d
                    busy[r] += d
                    ends.append(t)
            for (kind, s, mb), end in zip(group, ends):
                key = tag(kind, s, mb)
                finish[key] = end
                ready_ranks.extend(waiting.pop(key, ()))
            free[r] = ends[-1]
            pos[r] += 1
    if any(pos[r] < len(orders[r]) for r in range(n)):
        raise RuntimeError("the schedule's actions cannot all run: a dependency is never met")
    return Simulated(max(free), tuple(free), tuple(busy))


@functools.lru_cache(maxsize=4096)
def _simulate_cached(plan_key, stage_rank, dur, latency, first, comm) -> Simulated:
    orders = _orders(*plan_key)
    return simulate(
        orders,
        list(stage_rank),
        {k: list(v) for k, v in dur},
        list(latency),
        {k: dict(v) for k, v in first},
        None if comm is None else {k: list(v) for k, v in comm},
    )


def simulate_plan(plan: PipelinePlan, stage_rank, dur, latency, first=None, comm=None) -> Simulated:
    """``simulate`` over ``plan``'s own order, memoised: layouts that differ only in what does not
    change a pass's duration (offload, ZeRO 0-2) share one simulation. ``comm``: ``simulate``'s
    (the overlapped pairs' passes at once; None: one after the other)."""
    key = (plan.schedule, plan.pp, plan.virtual, plan.microbatches)
    return _simulate_cached(
        key,
        tuple(stage_rank),
        tuple((k, tuple(v)) for k, v in sorted(dur.items())),
        tuple(latency),
        tuple((k, tuple(sorted(v.items()))) for k, v in sorted((first or {}).items())),
        None if comm is None else tuple((k, tuple(v)) for k, v in sorted(comm.items())),
    )


@functools.lru_cache(maxsize=4096)
def _live_cached(plan_key, act, keep, extra, grads, work, a2a, sent_f, sent_b, work_w) -> LiveActivations:
    lists = (list(x) for x in (act, keep, extra, grads, work, a2a, sent_f, sent_b, work_w))
    return live_activations(_orders(*plan_key), *lists)


def live_plan(
    plan: PipelinePlan,
    act,
    keep,
    extra=None,
    grads=None,
    work=None,
    a2a=None,
    sent_f=None,
    sent_b=None,
    work_w=None,
) -> LiveActivations:
    """``live_activations`` over ``plan``'s own order, memoised."""
    key = (plan.schedule, plan.pp, plan.virtual, plan.microbatches)
    zeros = (0.0,) * len(act)
    return _live_cached(
        key,
        tuple(act),
        tuple(keep),
        tuple(extra or zeros),
        tuple(grads or zeros),
        *(tuple(x or zeros) for x in (work, a2a, sent_f, sent_b)),
        tuple(work_w or work or zeros),
    )
