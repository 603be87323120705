"""A pipeline's layers cut by their costs (``parallel.pp_layers``), not by their count.

The trainer's default split (``zero.pipeline.even_split``) gives each stage as many layers as it
can, whatever they cost. Layers seldom cost alike: the embedding is a lookup, the head a product
over the vocabulary, and a model may mix dense and MoE blocks. Under a V-shaped schedule the
first and last stages share rank 0, so the even split of ``model=small`` over ``pp2 zbvx2`` puts
the embedding, one block and the head on rank 0 and three blocks on rank 1.

``balanced_split`` cuts the layers into the plan's stages so that the busiest pipeline rank's work
per micro-batch (each layer's forward, backward, synchronous MoE communication and, under
checkpointing, recomputation, at this layout's micro-batch on the profile) is the least, ties
broken by the costliest stage (the fill and drain); ``balance`` returns the layout with that split
when it beats the even one by at least ``GAIN``. Up to ``EXHAUSTIVE`` ways to cut, every one is
tried; past that (a 63-layer model over 32 stages has ~10^17), a steepest descent moves one
layer's worth of cut between any two stages while the ranks' loads (busiest first) drop, from the
even cut, the greedy cut of the least costly bottleneck stage and that cut made from the last
layer back, and the best is kept: never worse than the even cut, not always the best one
(docs/design.md). The planner predicts the layout with its split like any other (the
schedule simulation takes each stage's own durations), so whether the cut is faster is the
prediction's to say, and the ranking lists both.
"""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import combinations

import numpy as np

from ..pipeline import SCHEDULES, even_split
from .enumerate import LayoutRecord, layout_problem
from .profile import Profile
from .records import ModelCosts
from .terms import _Costing, _layer_terms

EXHAUSTIVE = 5000  # ways to cut tried one by one; past it, the local search
GAIN = 0.01  # a cut is listed when its busiest rank's work is this much under the even split's

_CUTS: dict = {}


def layer_seconds(
    rec: LayoutRecord, costs: ModelCosts, profile: Profile, skew: float | None = None, time_skew: float = 1.0
) -> list[float]:
    """Per pipeline layer, one micro-batch's forward and backward with the MoE layer's synchronous
    communication (and the recomputed forward under checkpointing) on layout ``rec``: the terms
    ``predict`` sums into a stage's durations."""
    cst = _Costing(rec, costs, profile, skew, time_skew)
    comp, moe, *_ = _layer_terms(cst)
    # a checkpointed block's recomputed forward: its compute and exchanges but the statistics'
    # all-reduce (replayed); the embedding and the head run once
    again = [float(cst.recomputes(b)) for b in costs.blocks]
    return [c["F"] + c["I"] + c["W"] + m["F"] + m["I"] + a * (c["F"] + m["R"]) for c, m, a in zip(comp, moe, again)]


def score(sizes, seconds: list[float], owner: list[int]) -> tuple[float, float]:
    """(the busiest rank's seconds, the costliest stage's) of cutting ``seconds`` into stages of
    ``sizes`` layers, stage ``s`` on rank ``owner[s]``."""
    loads = [0.0] * (max(owner) + 1)
    worst, lo = 0.0, 0
    for s, k in enumerate(sizes):
        c = math.fsum(seconds[lo : lo + k])
        loads[owner[s]] += c
        worst = max(worst, c)
        lo += k
    return max(loads), worst


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """``a`` beats ``b``: a busier rank less busy, or as busy (to rounding: the same layers summed
    in another order) and a costliest stage less costly."""
    tie = 1e-9 * b[0]
    return a[0] < b[0] - tie or (a[0] <= b[0] + tie and a[1] < b[1] - 1e-9 * b[1])


def _greedy(seconds: list[float], stages: int) -> list[int]:
    """The cut whose costliest stage is the least (by bisection on that bound; a cut into fewer
    stages is split further at its largest stages, which raises no stage's cost)."""
    n = len(seconds)

    def cut(bound):
        sizes, acc = [], 0.0
        for c in seconds:
            if sizes and acc + c <= bound:
                sizes[-1] += 1
                acc += c
            else:
                sizes.append(1)
                acc = c
        return sizes

    lo, hi = max(seconds), math.fsum(seconds)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if len(cut(mid)) <= stages else (mid, hi)
    sizes = cut(hi)
    while len(sizes) < stages:  # n >= stages: some stage has two layers or more
        i = max(range(len(sizes)), key=lambda j: sizes[j])
        sizes[i : i + 1] = [sizes[i] - sizes[i] // 2, sizes[i] // 2]
    assert sum(sizes) == n
    return sizes


def _descend(sizes: list[int], seconds: list[float], owner: list[int]) -> list[int]:
    """Move one layer's worth of the cut from one stage to another at a time (stage a one layer
    fewer, stage b one more: the stages between shift by a layer), the move that lowers the ranks'
    loads most (every rank's, busiest first: a descent on the busiest alone stalls where a move
    leaves it as it is and only the next one down would drop), until none does. Every move of an
    iteration is scored at once (numpy)."""
    n = len(sizes)
    prefix = np.concatenate([[0.0], np.cumsum(seconds)])
    onehot = np.zeros((n, max(owner) + 1))
    onehot[np.arange(n), owner] = 1.0
    a, b = (np.array(x, dtype=np.int64) for x in zip(*[(i, j) for i in range(n) for j in range(n) if i != j]))
    rows = np.arange(len(a))

    def loads(cuts):  # [moves, stages] layers per stage -> [moves, ranks] loads, busiest first
        ends = np.cumsum(cuts, axis=1)
        return -np.sort(-((prefix[ends] - prefix[ends - cuts]) @ onehot), axis=1)

    cur = np.array(sizes, dtype=np.int64)
    best = loads(cur[None])[0]
    for _ in range(4 * len(seconds)):
        trials = np.repeat(cur[None], len(a), axis=0)
        trials[rows, a] -= 1
        trials[rows, b] += 1
        trials = trials[trials[rows, a] >= 1]
        if not len(trials):
            break
        got = loads(trials)
        i = np.lexsort(got.T[::-1])[0]  # the least, busiest rank first
        if tuple(got[i]) >= tuple(best):
            break
        cur, best = trials[i], got[i]
    return [int(k) for k in cur]


def balanced_split(seconds: list[float], owner: list[int]) -> list[int]:
    """Layers per stage cutting ``seconds`` (per layer) into ``len(owner)`` stages, stage ``s``
    on rank ``owner[s]``, with the least ``score``; the even split where nothing beats it."""
    n, stages = len(seconds), len(owner)
    key = (tuple(seconds), tuple(owner))
    hit = _CUTS.get(key)
    if hit is not None:
        return list(hit)
    even = even_split(n, stages)
    best, best_score = even, score(even, seconds, owner)
    if math.comb(n - 1, stages - 1) <= EXHAUSTIVE:
        candidates = ([b - a for a, b in zip((0, *cuts), (*cuts, n))] for cuts in combinations(range(1, n), stages - 1))
    else:
        # three starts: the even cut, the least-bottleneck cut, and that cut made from the last layer back
        starts = (even, _greedy(seconds, stages), _greedy(seconds[::-1], stages)[::-1])
        candidates = (_descend(start, seconds, owner) for start in starts)
    for sizes in candidates:
        got = score(sizes, seconds, owner)
        if _better(got, best_score):
            best, best_score = sizes, got
    if len(_CUTS) > 4096:
        _CUTS.clear()
    _CUTS[key] = tuple(best)
    return best


def balance(
    rec: LayoutRecord, costs: ModelCosts, profile: Profile, skew: float | None = None, time_skew: float = 1.0
) -> LayoutRecord | None:
    """``rec`` with its pipeline's layers cut by their costs (``balanced_split``), or None: no
    pipeline, a split already given, or no cut whose busiest rank does ``GAIN`` less than the even
    split's."""
    if rec.pp == 1 or rec.pp_layers is not None or rec.pp_schedule not in SCHEDULES:
        return None
    plan = rec.plan(costs.num_layers)
    owner = [plan.rank_of(s) for s in range(plan.num_stages)]
    seconds = layer_seconds(rec, costs, profile, skew, time_skew)
    sizes = balanced_split(seconds, owner)
    even = [hi - lo for lo, hi in plan.ranges]
    if score(sizes, seconds, owner)[0] > (1.0 - GAIN) * score(even, seconds, owner)[0]:
        return None
    out = replace(rec, pp_layers=tuple(sizes))
    if layout_problem(out, costs.num_layers, costs.num_experts, costs.tied) is not None:
        return None
    return out


def with_balanced(recs, costs: ModelCosts, profile: Profile, skew: float | None = None) -> list[LayoutRecord]:
    """``recs`` with each pipeline layout followed by its cut by costs, where ``balance`` finds one."""
    out = []
    for rec in recs:
        out.append(rec)
        b = balance(rec, costs, profile, skew)
        if b is not None:
            out.append(b)
    return out
