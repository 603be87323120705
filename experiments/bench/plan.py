"""How good are the planner's predictions? (a) measured here: the trainer run for a few steps per
layout on gloo ranks, against ``zero.plan``'s step time and model-state memory on the
``cpu_2core`` profile, or with ``--calibrate`` on a profile measured just before each round;
(b) on paper: two published large runs against the planner on vendor profiles; (r) one rank's
bare forward and backward on ``model=small`` and shapes around it against the planner's compute;
(s) the zero-bubble schedules' split backward against a whole one; (h) a pipeline's hand-over
between two computing ranks against the planner's rule for it; (m) (a)'s peak memory alone, every
layout once for three steps (memory does not move with the machine's speed: minutes, not half an
hour; ``--sample N``: N layouts drawn at random from everything the planner lists on 2 and 4
ranks instead); (v) the machine's own variation: the same step timed back to back for a minute on every
core, and how far a run of (a)'s length would land from the typical step with no model involved;
(k) checkpointing under a split backward: each zero-bubble schedule's step and recomputations
with torch's checkpoint against ``moe.recompute.checkpoint_once``; (c) one layout's census: the
blocks alive at each rank's measured peak, by the pipeline action and operators that allocated
them, beside the planner's parts (``--world N --layout JSON``).

    python -m experiments.bench.plan [--part a|b|ab|r|s|h|m|v|k|c] [--steps 8] [--rounds 3] [--quick] [--calibrate]
                                     [--profile cpu_2core] [--seconds 60] [--alone] [--sample N] [--seed 0]
                                     [--out results.json]

(a) ``model=small`` (the trainer's default model: 4 MoE blocks of 8 experts, d_model 64) with
``train.batch_size=16 train.seq_len=128``, on 2 and 4 gloo ranks of this machine, one layout at a
time through ``tests.support.dist.run_distributed`` (the trainer's ``train`` on each rank, one
intra-op thread per rank, as torchrun's ``OMP_NUM_THREADS=1``): dp, ep, ZeRO 1-3, offload, pipelines
under four schedules (DualPipeV with its pairs overlapped), accumulation, checkpointing. Measured
step time: the median over the steps after the first two of each step's time (``metrics.jsonl``'s
tokens_per_s per step; validation excluded), the median over ``--rounds`` runs of the layout made
round robin (minutes apart). The machine is shared: its other work's load (``background_load``, in
busy processes) is measured for 2 s before each run and the prediction made with it.
``--calibrate``: before each round this machine is calibrated afresh (``python -m experiments.plan
--calibrate``, 2-3 minutes) and the round's runs are predicted on that profile, the shipped
profile's predictions kept beside; each calibration's drift from the shipped profile is printed
(``profile_drift``). A shared machine's speed moves by up to 1.4x over tens of minutes, and a
profile measured at another time carries that into every prediction. ``SpeedProbe`` times
model=small's forward and backward on every core right after each calibration and before each run,
and each run's prediction times that ratio is reported beside the plain one: the machine's drift
told from the model's error. Measured model-state bytes: ``zero.measure_memory`` of the engine after
the last step's gradient reduction (the largest over the ranks), less the gradients of a ZeRO-2/3
group of one rank, which live only from the backward to the step. Measured peak: the trainer's
``summary.json`` memory (the CPU allocator's high-water mark through the profiler over the build and
the first two steps, ``experiments.training.peak_memory``), the busiest rank's against the predicted
peak (the busiest rank's; with offload plus its host bytes: one memory on the CPU). Printed: each
layout's predicted and measured step time and memory, the mean absolute error in percent and
Spearman's rank correlation of the step times, the largest relative error of the model-state bytes
and the peak's mean and largest relative error.

(b) DeepSeek-V3 (671B, MLA, 256 routed experts + 1 shared, top-8) on 2048 H800 as published (PP16
DualPipe, its forward-backward pairs overlapped: ``pp_overlap``, EP64, ZeRO-1, node-limited
dispatch: ``ep_dispatch=node``, the flat All-to-All predicted beside it; 180K H800 GPU-hours per
trillion tokens, i.e. ~1,540 tokens/s per GPU, batch 15,360 x 4,096; DeepSeek-V3 technical report,
arXiv:2412.19437) and Mixtral-8x7B on 64 H100 (EP8 PP4 VP8, 468 TFLOP/s per GPU bf16, Megatron-Core
MoE README as of MCore v0.9; a global batch of 256 x 4,096 assumed): the planner's prediction for
the published layout, its throughput against the published one, and where the published layout
ranks among the planner's layouts (node dispatch searched too, where an ep group spans two or more
of the profile's nodes; dualpipev with and without the overlap). For DeepSeek-V3 also what the run
had and this trainer lacks, added one at a time (``missing_features``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import zero.plan as zplan
from moe import MoEConfig
from moe.costs import model_costs
from moe.model import TransformerConfig

BASE = [
    "model=small",
    "logger=none",
    "train.batch_size=16",
    "train.seq_len=128",
    "train.eval_every=1000",
    "train.eval_batches=1",
    "train.log_every=1",
    "train.progress=false",
    "train.checkpoint.every=0",
    "train.resume=none",
    "optim.warmup_steps=2",
    "train.memory_steps=2",  # the peak-memory meter's window: the steps timed (after the first two) run unwatched
]

OVERLAP = dict(pp_overlap=True)
# (world, layout fields): 2 and 4 ranks, every dimension the planner searches
LAYOUTS = [
    (2, dict()),
    (2, dict(ep=2)),
    (2, dict(zero_stage=1)),
    (2, dict(zero_stage=2)),
    (2, dict(zero_stage=3)),
    (2, dict(zero_stage=1, zero_offload=True)),
    (2, dict(grad_accum=2)),
    (2, dict(checkpoint_activations=True)),
    (2, dict(pp=2, pp_schedule="1f1b", pp_microbatches=4)),
    (2, dict(pp=2, pp_schedule="gpipe", pp_microbatches=4)),
    (2, dict(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2, pp_microbatches=4)),
    (2, dict(pp=2, pp_schedule="zbv", pp_virtual_stages=2, pp_microbatches=4)),
    (4, dict(ep=4)),
    (4, dict(ep=2, zero_stage=3)),
    (4, dict(pp=2, ep=2, zero_stage=3, pp_schedule="1f1b", pp_microbatches=4)),
    (4, dict(zero_stage=2, grad_accum=2, checkpoint_activations=True)),
    # the planner's cut by cost of zbv's layers (zero.plan.split): rank 0 the embedding, a block, a
    # block and the head, rank 1 two blocks, where the even cut gives rank 1 three
    (2, dict(pp=2, pp_schedule="zbv", pp_virtual_stages=2, pp_microbatches=4, pp_layers=(2, 1, 1, 2))),
    # DualPipeV with each pair's forward and backward at once (the backward's exchanges on twin groups)
    (4, dict(pp=2, ep=2, zero_stage=1, pp_schedule="dualpipev", pp_virtual_stages=2, pp_microbatches=4) | OVERLAP),
    # ZeRO-2's full-size gradients and gloo's copies at their largest against the activations: the
    # peak lies late in the backward, where the kernel pool's hiddens are still allocated
    (4, dict(zero_stage=2)),
]
QUICK = [0, 1, 4, 5, 8, 10, 12, 14]
# --drift: one rank alone, then 2-rank data parallelism and a pipeline, at once after one calibration
# (is a round's error the model's, or the machine's moving over the minutes a round takes?)
DRIFT = [(1, dict()), LAYOUTS[0], LAYOUTS[8]]


def _train(overrides, run_dir) -> dict:
    """The trainer's ``train`` on the project's config with ``overrides``: its summary."""
    from hydra import compose, initialize_config_dir

    from experiments.train import train

    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    return train(cfg, run_dir=run_dir)


def _rank_fn(rank, world, overrides, run_dir):
    """One rank: the trainer on ``overrides``; the engine's model-state bytes after the last
    reduction (a wrapped ``_wait_reductions``: each call is after a step's reduction completed)."""
    from experiments.training.loop import Trainer
    from zero.engine import ZeroEngine
    from zero.memory import measure_memory

    seen = {"step": 0}
    original, original_step = ZeroEngine._wait_reductions, Trainer.train_step

    def wait_and_measure(self):
        # in the untimed first two steps only: measure_memory walks every tensor, which would add
        # its own time to the steps timed (the model states are the same bytes from the first step on)
        original(self)
        if seen["step"] < 2:
            seen["memory"] = measure_memory(self)
            # the states kept from step to step, as the planner's model_states counts them: a
            # ZeRO-2/3 group of one rank frees its gradients after each step (zero.flat)
            seen["memory"]["device_total"] -= sum(
                f.grad_shard_C.untyped_storage().nbytes()
                for f in self.flats
                if f.stage >= 2 and f.world == 1 and f.grad_shard_C is not None
            )

    def counted_step(self, step):
        seen["step"] = step
        return original_step(self, step)

    ZeroEngine._wait_reductions, Trainer.train_step = wait_and_measure, counted_step
    try:
        summary = _train(overrides, run_dir)  # every rank the same: only rank 0 writes
    finally:
        ZeroEngine._wait_reductions, Trainer.train_step = original, original_step
    return seen["memory"]["device_total"], summary["memory"]["measured_peak_bytes"]


def _small_step(batch: int, seq: int):
    """model=small's forward and backward on ``batch`` x ``seq`` tokens, on one thread, as a call
    (what ``SpeedProbe`` and ``part_v`` time)."""
    import torch
    import torch.nn.functional as nnf

    from moe.model import Transformer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = _one_rank_config({})
    model = Transformer(cfg)
    x = torch.randint(0, cfg.vocab_size, (batch, seq))

    def step():
        nnf.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()

    return step


def _probe_worker(conn, batch: int, seq: int) -> None:
    """One core's share of ``SpeedProbe``: model=small's forward and backward on ``batch`` x ``seq``
    tokens (one thread), timed on request (the median of the steps asked for, after two)."""
    from experiments.calibrate import _times

    step = _small_step(batch, seq)
    step()
    while (steps := conn.recv()) is not None:
        conn.send(statistics.median(_times(step, steps)))


class SpeedProbe:
    """How fast this machine runs the trainer's kind of work now, against when it was calibrated.

    One process per core (as the runs' ranks: every core busy, one thread each) runs model=small's
    forward and backward on one rank's micro-batch of the 2-rank layouts, all at once; the probe
    is the median of their times. ``reference()`` takes it right after a calibration; ``factor()``
    just before a run: its time over the reference's. A shared machine's speed moves by up to 1.4x
    over tens of minutes, and more in the trainer's memory-bound operators than in the
    calibration's matrix products (one session: a calibration predicted 2-rank data parallelism at
    0.113 s, the runs minutes later took 0.157, the same runs 50 minutes earlier 0.113): the
    factor scales a run's prediction to the machine it ran on. The processes wait, asleep, between
    probes; a probe takes about half a second."""

    def __init__(self, workers: int | None = None, batch: int = 8, seq: int = 128, steps: int = 5):
        import multiprocessing as mp
        import os

        ctx = mp.get_context("spawn")
        self.steps, self.conns, self.procs = steps, [], []
        for _ in range(workers or os.cpu_count() or 1):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_probe_worker, args=(there, batch, seq), daemon=True)
            proc.start()
            self.conns.append(here)
            self.procs.append(proc)
        self.ref: float | None = None

    def __call__(self) -> float:
        for c in self.conns:  # every worker starts at once
            c.send(self.steps)
        return statistics.median(c.recv() for c in self.conns)

    def reference(self) -> float:
        self.ref = self()
        return self.ref

    def factor(self) -> float:
        if self.ref is None:
            raise RuntimeError("SpeedProbe.factor() before reference(): take the reference after the calibration")
        return self() / self.ref

    def close(self) -> None:
        for c in self.conns:
            c.send(None)
        for proc in self.procs:
            proc.join(timeout=10)


def _rank_skew(rows: list[dict], ep: int) -> float:
    """The largest, over the logged rows and MoE layers, of the busiest ep rank's routed rows over
    the ep ranks' mean (rank r holds experts [r E/ep, (r + 1) E/ep)); 1 without expert parallelism."""
    worst = 1.0
    for row in rows:
        for load in row.get("expert_load") or []:
            per = len(load) // ep
            ranks = [sum(load[r * per : (r + 1) * per]) for r in range(ep)]
            if sum(ranks) > 0:
                worst = max(worst, max(ranks) * ep / sum(ranks))
    return worst


def _rank_rows_skew(rows: list[dict], ep: int, groups: list[list[int]] | None = None) -> float:
    """The largest, over the logged rows and ``groups`` of MoE layers (a pipeline rank's; None:
    all of them), of the busiest ep rank's routed rows summed over the group's layers, over the ep
    ranks' mean of that sum: the memory's skew (at a forward's end every layer's rows are saved
    at once, and a rank holds its own in each layer; ``_rank_skew``, the largest single layer's,
    charged to every layer overstates it); 1 without expert parallelism."""
    worst = 1.0
    for row in rows:
        loads = row.get("expert_load") or []
        for group in groups if groups is not None else [range(len(loads))]:
            ranks = [0.0] * ep
            for layer in group:
                per = len(loads[layer]) // ep
                for r in range(ep):
                    ranks[r] += sum(loads[layer][r * per : (r + 1) * per])
            if sum(ranks) > 0:
                worst = max(worst, max(ranks) * ep / sum(ranks))
    return worst


def _moe_layers_by_rank(rec: zplan.LayoutRecord, costs) -> list[list[int]] | None:
    """Each pipeline rank's MoE layers, numbered in model order (``expert_load``'s rows); None
    without a pipeline."""
    plan = rec.plan(len(costs.blocks))
    if plan is None:
        return None
    moe = [j for j, b in enumerate(costs.blocks) if b.is_moe]
    out = []
    for r in range(rec.pp):
        layers = {j for s in plan.stages_of(r) for j in range(*plan.ranges[s])}
        out.append([n for n, j in enumerate(moe) if j in layers])
    return out


def _memory_at_routing(rec: zplan.LayoutRecord, costs, profile: zplan.Profile, rows: list[dict]):
    """``(skew, prediction)``: the layout's predicted peak at the routing of the logged ``rows``.
    The planner takes one skew for every layer; a pipeline rank holds its own layers, so each
    pipeline rank's peak is predicted at its own layers' skew (``_rank_rows_skew``), and the
    prediction is the one whose rank's peak is the largest."""
    groups = _moe_layers_by_rank(rec, costs)
    if groups is None:
        skew = _rank_rows_skew(rows, rec.ep)
        return skew, zplan.predict(rec, costs, profile, skew=skew)
    best = None
    for r, group in enumerate(groups):
        skew = _rank_rows_skew(rows, rec.ep, [group])
        p = zplan.predict(rec, costs, profile, skew=skew)
        parts = p.memory_parts_by_pp_rank[r]
        total = sum(parts.values())
        if best is None or total > best[1]:
            best = (skew, total, dataclasses.replace(p, memory_parts=dict(parts)))
    skew, peak, p = best
    return skew, dataclasses.replace(p, memory_bytes=peak)


def _spearman(a, b) -> float:
    def ranks(x):
        x = np.asarray(x, dtype=float)
        order = x.argsort()
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for v in np.unique(x):  # ties share their mean rank
            r[x == v] = r[x == v].mean()
        return r

    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def profile_drift(now: zplan.Profile, then: zplan.Profile) -> dict:
    """How far a fresh calibration ``now`` lies from ``then``, rate by rate: the median over the
    matrix-product shapes both measured of now's FLOP/s over then's, and the ratios of the copy
    bandwidth, an operator's fixed cost and the intra-node All-to-All's time for 256 KiB."""
    ratios = [
        now.matmul_rate(dtype, *row[:3]) / then.matmul_rate(dtype, *row[:3])
        for dtype, rows in then.matmul_flops.items()
        for row in rows
        if len(row) == 4
    ]
    a2a = lambda p: p.link("intra", "all_to_all").time("all_to_all", 1 << 18, 2)  # noqa: E731
    return dict(
        matmul_rate=statistics.median(ratios) if ratios else 1.0,
        memory_bandwidth=now.memory_bandwidth / then.memory_bandwidth,
        op_overhead=now.op_overhead_s / then.op_overhead_s if then.op_overhead_s else 1.0,
        all_to_all_256k=a2a(now) / a2a(then),
    )


def calibrate_here(path: Path) -> zplan.Profile:
    """This machine as it is now: ``python -m experiments.plan --calibrate`` (its defaults: the
    median of three measurements, collectives between computing ranks) into ``path``."""
    from experiments.calibrate import run_calibrate

    run_calibrate(["--calibrate", "--out", str(path), "--name", path.stem])
    return zplan.load_profile(path)


def layout_row(rec: zplan.LayoutRecord, rs: list[dict]) -> dict:
    """One layout's runs as one row: its step time the median over the runs of each run's median
    step, as typical as the profile's rates (each the median of its repeats), and its prediction
    the median of the runs' own (each run predicted at its background load and routing, on its
    round's profile). A run slowed by the machine's other work now and then stays out of both,
    where a mean would take it in: on this shared machine one run of a layout took 196 ms a step
    and the next five 136-164. Peaks: the largest measured (the prediction is a bound)."""
    med = lambda key: statistics.median(r[key] for r in rs)  # noqa: E731
    return dict(
        world=rec.world,
        layout=rec.label(),
        overrides=rec.overrides(),
        runs=rs,
        predicted_s=med("predicted_s"),
        predicted_s_shipped=med("predicted_s_shipped"),
        predicted_s_at_speed=med("predicted_s_at_speed"),
        measured_s=med("measured_s"),
        predicted_model_states=rs[0]["predicted_model_states"],
        measured_model_states=max(r["measured_model_states"] for r in rs),
        predicted_peak=rs[0]["predicted_peak"],
        measured_peak=max(r["measured_peak"] for r in rs),
    )


def part_a(steps: int, quick: bool, rounds: int = 3, calibrate: bool = False, layouts=None) -> dict:
    import os

    from experiments.plan import background_load, compose, costs_of
    from tests.support.dist import run_distributed

    shipped = zplan.load_profile("cpu_2core")
    cfg = compose(BASE)
    costs = costs_of(cfg, shipped)
    tokens = int(cfg.train.batch_size) * int(cfg.train.seq_len)
    chosen = layouts or ([LAYOUTS[i] for i in QUICK] if quick else LAYOUTS)
    recs = []
    for world, fields in chosen:
        rec = zplan.LayoutRecord(world=world, batch_size=int(cfg.train.batch_size), **fields)
        problem = zplan.layout_problem(rec, costs.num_layers, costs.num_experts, costs.tied)
        if problem:
            raise ValueError(f"{rec.label()}: {problem}")
        recs.append(rec)
    runs: dict[int, list[dict]] = {i: [] for i in range(len(recs))}
    calibrations = []
    with contextlib.closing(SpeedProbe()) as probe:
        # round robin: each layout's runs lie minutes apart, under whatever the neighbours run then
        for rnd in range(rounds):
            base = shipped
            if calibrate:
                # the machine's speed moves over tens of minutes: each round is predicted on a profile
                # measured just before it (the shipped profile's predictions are kept beside)
                with tempfile.TemporaryDirectory() as tmp:
                    base = calibrate_here(Path(tmp) / f"cpu_round{rnd + 1}.yaml")
                calibrations.append(
                    dict(
                        round=rnd + 1,
                        drift_from_shipped=profile_drift(base, shipped),
                        profile=base.to_dict(),
                        probe_s=probe.reference(),
                    )
                )
                print(
                    f"| calibrated before round {rnd + 1}: against the shipped profile "
                    + ", ".join(f"{k} x{v:.2f}" for k, v in calibrations[-1]["drift_from_shipped"].items())
                    + " |",
                    flush=True,
                )
            for i, rec in enumerate(recs):
                # the machine is shared and its other work comes and goes: the profile's background
                # load is measured just before each run
                load = background_load(os.cpu_count() or 1, 2.0)
                profile = dataclasses.replace(base, background_load=load)
                # the machine's speed now against at the round's calibration (without --calibrate: at
                # the first run, the shipped profile being another machine's)
                if probe.ref is None:
                    probe.reference()
                speed = probe.factor()
                overrides = [*BASE, f"train.steps={steps}", *rec.overrides()]
                with tempfile.TemporaryDirectory() as tmp:
                    t0 = time.perf_counter()
                    got = run_distributed(_rank_fn, rec.world, overrides, str(Path(tmp) / "run"), timeout=900)
                    wall = time.perf_counter() - t0
                    lines = (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()
                rows_logged = [json.loads(x) for x in lines]
                times = [tokens / r["tokens_per_s"] for r in rows_logged][2:]  # the first two warm up
                # the peak's routing: the busiest ep rank's routed rows over all its layers, over the
                # mean, in the steps the memory meter watched, the skew the memory is predicted at
                # (dropless; the planner's default is the worst case, which no run of a trained
                # router comes near)
                skew, pred_mem = _memory_at_routing(rec, costs, profile, rows_logged[:2])
                # the time's: the same ratio, the mean over the steps timed (the All-to-Alls wait for it)
                time_skew = statistics.mean(_rank_skew([r], rec.ep) for r in rows_logged[2:])
                pred = zplan.predict(rec, costs, profile, time_skew=time_skew)
                # without --calibrate the round's profile is the shipped one: the same prediction
                at_load = dataclasses.replace(shipped, background_load=load)
                on_shipped = zplan.predict(rec, costs, at_load, time_skew=time_skew) if calibrate else pred
                run = dict(
                    predicted_s=pred.step_s,
                    predicted_s_shipped=on_shipped.step_s,
                    speed_factor=speed,
                    predicted_s_at_speed=pred.step_s * speed,
                    measured_s=statistics.median(times),
                    step_times=times,
                    background_load=profile.background_load,
                    predicted_model_states=pred.memory_parts["model_states"],
                    measured_model_states=max(m for m, _ in got),
                    # the CPU ranks' one memory holds the offloaded optimizer state too
                    predicted_peak=pred_mem.memory_bytes + pred_mem.host_bytes,
                    predicted_parts=pred_mem.memory_parts,
                    skew=skew,
                    time_skew=time_skew,
                    predicted_peak_worst_case=pred.memory_bytes + pred.host_bytes,
                    measured_peak=max(got[0][1]),  # the busiest rank's, as the prediction is
                    measured_peaks=got[0][1],
                    wall_s=wall,
                )
                runs[i].append(run)
                print(
                    f"| {rnd + 1} | {rec.world} | {rec.label()} | {run['background_load']:.1f} | {pred.step_s:.3f} "
                    f"| {run['measured_s']:.3f} | {abs(pred.step_s - run['measured_s']) / run['measured_s']:.0%} "
                    f"| {run['predicted_model_states'] / 1e6:.3f} | {run['measured_model_states'] / 1e6:.3f} "
                    f"| {run['predicted_peak'] / 1e6:.2f} | {run['measured_peak'] / 1e6:.2f} "
                    f"| {run['measured_peak'] / run['predicted_peak'] - 1:+.1%} |",
                    flush=True,
                )
    rows = [layout_row(rec, runs[i]) for i, rec in enumerate(recs)]
    p = np.array([r["predicted_s"] for r in rows])
    m = np.array([r["measured_s"] for r in rows])
    pm = np.array([r["predicted_model_states"] for r in rows])
    mm = np.array([r["measured_model_states"] for r in rows])
    pk = np.array([r["predicted_peak"] for r in rows])
    mk = np.array([r["measured_peak"] for r in rows])
    # how well the machine repeats itself: one layout's runs against their mean
    spread = [np.std([r["measured_s"] for r in row["runs"]]) / row["measured_s"] for row in rows] if rounds > 1 else [0]
    ps = np.array([r["predicted_s_shipped"] for r in rows])
    pv = np.array([r["predicted_s_at_speed"] for r in rows])
    summary = dict(
        layouts=len(rows),
        rounds=rounds,
        profile="calibrated before each round" if calibrate else "cpu_2core (shipped)",
        step_mae_pct=float(np.mean(np.abs(p - m) / m) * 100),
        step_spearman=_spearman(p, m),
        step_mae_pct_shipped=float(np.mean(np.abs(ps - m) / m) * 100),
        step_spearman_shipped=_spearman(ps, m),
        step_mae_pct_at_speed=float(np.mean(np.abs(pv - m) / m) * 100),
        step_spearman_at_speed=_spearman(pv, m),
        speed_factors=[round(r["speed_factor"], 3) for row in rows for r in row["runs"]],
        calibrations=calibrations,
        repeat_spread_pct=float(np.mean(spread) * 100),
        # how much one run's own steps move (std / mean of its timed steps), over every run
        within_run_spread_pct=float(
            np.mean([np.std(r["step_times"]) / np.mean(r["step_times"]) for row in rows for r in row["runs"]]) * 100
        ),
        model_states_max_rel_err=float(np.max(np.abs(pm - mm) / mm)),
        peak_mean_abs_err_pct=float(np.mean(np.abs(pk - mk) / mk) * 100),
        peak_max_abs_err_pct=float(np.max(np.abs(pk - mk) / mk) * 100),
        peak_within_5pct=int(np.sum(np.abs(pk - mk) / mk <= 0.05)),
    )
    print(
        f"\n{summary['layouts']} layouts x {rounds} runs (each the median of its runs), on {summary['profile']}: "
        f"step time MAE {summary['step_mae_pct']:.1f}%, Spearman rho {summary['step_spearman']:.2f}"
        + (
            f" (on the shipped profile: {summary['step_mae_pct_shipped']:.1f}%, "
            f"rho {summary['step_spearman_shipped']:.2f})"
            if calibrate
            else ""
        )
        + f"; at the machine's speed of each run (SpeedProbe): {summary['step_mae_pct_at_speed']:.1f}%, "
        f"rho {summary['step_spearman_at_speed']:.2f} (factors {min(summary['speed_factors']):.2f}-"
        f"{max(summary['speed_factors']):.2f})" + f"; a layout's runs spread "
        f"{summary['repeat_spread_pct']:.0f}% (std / mean) on this shared machine, a run's own steps "
        f"{summary['within_run_spread_pct']:.0f}%; model-state bytes within "
        f"{summary['model_states_max_rel_err']:.2%} of measured; peak memory (the busiest rank's) off by "
        f"{summary['peak_mean_abs_err_pct']:.1f}% on average, {summary['peak_max_abs_err_pct']:.1f}% at most, "
        f"{summary['peak_within_5pct']} of {len(rows)} within 5%"
    )
    return dict(rows=rows, summary=summary)


# ----- (v) the machine's own variation --------------------------------------------------------------


def _trace_worker(conn, seconds: float, batch: int, seq: int) -> None:
    """One core's share of ``part_v``: model=small's forward and backward on ``batch`` x ``seq``
    tokens (one thread) back to back for ``seconds`` after the start signal, each step's start
    (seconds since the start) and duration sent back."""
    step = _small_step(batch, seq)
    for _ in range(3):  # warm: the kernel's pool, the autograd engine
        step()
    conn.send("ready")
    conn.recv()
    trace, t0 = [], time.perf_counter()
    while (start := time.perf_counter()) - t0 < seconds:
        step()
        trace.append((start - t0, time.perf_counter() - start))
    conn.send(trace)


def window_medians(trace: list, width: float) -> list[float]:
    """The median step of each ``width``-second window of ``trace`` ((start, seconds) per step, in
    order), by the step's start; windows without a step left out."""
    windows: dict[int, list[float]] = {}
    for start, seconds in trace:
        windows.setdefault(int(start // width), []).append(seconds)
    return [statistics.median(v) for _, v in sorted(windows.items())]


def block_medians(trace: list, steps: int) -> list[float]:
    """The median of each run of ``steps`` consecutive steps of ``trace`` (the last, shorter one left
    out): what a run timed over that many steps would have measured at each point of the trace."""
    times = [seconds for _, seconds in trace]
    return [statistics.median(times[i : i + steps]) for i in range(0, len(times) - steps + 1, steps)]


def _spread(values: list[float]) -> dict:
    mean, median = statistics.fmean(values), statistics.median(values)
    return dict(
        n=len(values),
        min=min(values),
        median=median,
        max=max(values),
        std_over_mean=statistics.pstdev(values) / mean if len(values) > 1 else 0.0,
        mean_abs_dev_from_median=statistics.fmean(abs(v / median - 1) for v in values),
    )


def part_v(seconds: float = 60.0, busy: bool = True, run_steps=(6, 14), batch: int = 8, seq: int = 128) -> dict:
    """How much the same work's time moves on this machine, whatever a model predicts: one process
    a core (``busy``; else one process, the other cores idle) runs model=small's forward and
    backward on one rank's micro-batch of the 2-rank layouts back to back for ``seconds``, every
    step timed. Reported per process: the steps' spread, the medians of 1- and 5-second windows,
    and the medians of consecutive blocks of ``run_steps`` steps (the steps (a) times in a run of
    8 and of 16 steps): their mean absolute deviation from their median is the error a perfect
    prediction would show against one run, the floor under (a)'s step-time error."""
    import multiprocessing as mp
    import os

    ctx = mp.get_context("spawn")
    workers = (os.cpu_count() or 1) if busy else 1
    conns, procs = [], []
    for _ in range(workers):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_trace_worker, args=(there, seconds, batch, seq), daemon=True)
        proc.start()
        conns.append(here)
        procs.append(proc)
    for c in conns:
        c.recv()  # every worker warm
    for c in conns:  # then all start at once
        c.send("go")
    traces = [c.recv() for c in conns]
    for proc in procs:
        proc.join(timeout=30)
    out = []
    for w, trace in enumerate(traces):
        row = dict(
            worker=w,
            steps=_spread([s for _, s in trace]),
            windows_1s=_spread(window_medians(trace, 1.0)),
            windows_5s=_spread(window_medians(trace, 5.0)),
            runs={n: _spread(block_medians(trace, n)) for n in run_steps},
            trace=trace,
        )
        out.append(row)
        runs = "; ".join(
            f"runs of {n} steps: {r['min'] * 1e3:.0f}-{r['max'] * 1e3:.0f} ms, "
            f"{r['mean_abs_dev_from_median']:.1%} from their median on average"
            for n, r in row["runs"].items()
        )
        print(
            f"| {w} | {len(trace)} | {row['steps']['median'] * 1e3:.1f} "
            f"| {row['windows_1s']['min'] * 1e3:.0f}-{row['windows_1s']['max'] * 1e3:.0f} "
            f"| {row['windows_5s']['min'] * 1e3:.0f}-{row['windows_5s']['max'] * 1e3:.0f} | {runs} |",
            flush=True,
        )
    return dict(workers=out, seconds=seconds, busy=busy, batch=batch, seq=seq)


# ----- (r) one rank's compute --------------------------------------------------------------------

# (label, TransformerConfig fields over model=small's, sequences, tokens each): model=small and
# shapes around it, each dimension moved once
ONE_RANK = [
    ("model=small", {}, 16, 128),
    ("model=small", {}, 8, 128),
    ("model=small", {}, 4, 128),
    ("model=small, checkpointed", dict(checkpoint=True), 16, 128),
    ("model=small, checkpointed", dict(checkpoint=True), 8, 128),
    (
        "width 96, 6 heads, 2 blocks, 4 experts of 192",
        dict(d_model=96, n_heads=6, d_ff=192, experts=4, n_layers=2),
        16,
        64,
    ),
    ("width 96, 6 heads", dict(d_model=96, n_heads=6), 16, 128),
    ("experts of 128", dict(d_ff=128), 16, 128),
    ("width 128, 8 heads, experts of 512", dict(d_model=128, n_heads=8, d_ff=512), 8, 128),
]


def sampled_layouts(n: int, seed: int = 0, worlds=(2, 4)) -> list[tuple[int, dict]]:
    """``n`` layouts of (a)'s model and batch drawn at random (``seed``) from everything the planner
    enumerates on ``worlds`` ranks (4,116 on 2 and 4), as ``(world, fields)`` like ``LAYOUTS``:
    the hand-picked layouts test what their picker thought of; a draw tests the rest."""
    import random

    from experiments.plan import _model_config, compose

    costs = model_costs(_model_config(compose(BASE)), 128)
    pool = [rec for w in worlds for rec in zplan.enumerate(costs, world=w, batch_size=16)]
    if not isinstance(n, int) or not 1 <= n <= len(pool):
        raise ValueError(
            f"--sample {n!r} is invalid: expected an integer in [1, {len(pool)}] (the layouts on {worlds} ranks)"
        )
    drawn = random.Random(seed).sample(pool, n)
    return [
        (rec.world, {k: v for k, v in dataclasses.asdict(rec).items() if k not in ("world", "batch_size")})
        for rec in drawn
    ]


def _census_rank(rank, world, overrides, run_dir):
    """One rank: the trainer on ``overrides`` with the meter's census at its peak
    (``experiments.training.peak_memory.census_at_peak``)."""
    from experiments.training import peak_memory

    seen = {}
    original = peak_memory.PeakMemory._finish

    def finish(self):
        prof = self._prof
        original(self)
        seen["blocks"] = peak_memory.census_at_peak(prof.profiler.kineto_results.experimental_event_tree())
        seen["peak"] = self._peak

    peak_memory.PeakMemory._finish = finish
    try:
        _train(overrides, run_dir)
    finally:
        peak_memory.PeakMemory._finish = original
    return seen


def census_groups(blocks, top: int = 12) -> list[tuple[str, str, int, int]]:
    """``(pipeline action, operators, bytes, blocks)`` of a census, grouped by the pipeline action
    that allocated each block (``PP:...``, or "-") and its three innermost operators, largest first."""
    groups: dict[tuple[str, str], list[int]] = {}
    for n, chain in blocks:
        action = next((c for c in chain if c.startswith("PP:")), "-")
        ops = " < ".join(c[:40] for c in chain[:3]) or "(outside any operator)"
        g = groups.setdefault((action, ops), [0, 0])
        g[0] += n
        g[1] += 1
    rows = [(a, o, b, k) for (a, o), (b, k) in groups.items()]
    return sorted(rows, key=lambda r: -r[2])[:top]


def part_c(world: int, fields: dict, top: int = 12) -> dict:
    """One layout's census: the blocks alive at each rank's measured peak (three steps, as
    ``--part m``), grouped by the pipeline action and operators that allocated them, beside the
    planner's parts for that rank at the routing measured. Where a layout's peak misses, this is
    what tells which part of the model is wrong."""
    from experiments.plan import _model_config, compose
    from tests.support.dist import run_distributed

    profile = zplan.load_profile("cpu_2core")
    costs = model_costs(_model_config(compose(BASE)), 128, experts=profile.expert_kernel)
    rec = zplan.LayoutRecord(world=world, batch_size=16, **fields)
    with tempfile.TemporaryDirectory() as tmp:
        got = run_distributed(
            _census_rank, world, [*BASE, "train.steps=3", *rec.overrides()], str(Path(tmp) / "run"), timeout=900
        )
        logged = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    skew, pred = _memory_at_routing(rec, costs, profile, logged[:2])
    by_pp = pred.memory_parts_by_pp_rank or [pred.memory_parts]
    print(f"{rec.label()}: predicted {(pred.memory_bytes + pred.host_bytes) / 1e6:.2f} MB at skew {skew:.2f}")
    out = []
    for r, seen in enumerate(got):
        parts = by_pp[r // (world // rec.pp)] if rec.pp > 1 else by_pp[0]
        print(f"rank {r}: measured {seen['peak'] / 1e6:.2f} MB; predicted parts (MB):")
        print("  " + ", ".join(f"{k} {v / 1e6:.2f}" for k, v in parts.items() if v))
        for action, ops, b, k in census_groups(seen["blocks"], top):
            print(f"  {b / 1e6:8.3f} MB {k:4d}  {action:8s} {ops}")
        out.append(dict(rank=r, peak=seen["peak"], groups=census_groups(seen["blocks"], top)))
    return dict(layout=rec.label(), predicted=pred.memory_bytes + pred.host_bytes, ranks=out)


def part_m(layouts=None) -> dict:
    """(a)'s peak memory alone: each layout once, three steps (the meter watches the build and the
    first two), the busiest rank's measured peak against the prediction at the routing of the
    steps watched (``_memory_at_routing``) on the shipped ``cpu_2core`` profile (memory takes no
    rates). Prints a row a layout, then the mean and largest error and how many lie within 5%.
    ``layouts``: ``(world, fields)`` pairs (default ``LAYOUTS``; ``--sample``: ``sampled_layouts``)."""
    from experiments.plan import _model_config, compose
    from tests.support.dist import run_distributed

    profile = zplan.load_profile("cpu_2core")
    costs = model_costs(_model_config(compose(BASE)), 128, experts=profile.expert_kernel)
    rows = []
    for world, fields in layouts or LAYOUTS:
        rec = zplan.LayoutRecord(world=world, batch_size=16, **fields)
        with tempfile.TemporaryDirectory() as tmp:
            got = run_distributed(
                _rank_fn, world, [*BASE, "train.steps=3", *rec.overrides()], str(Path(tmp) / "run"), timeout=900
            )
            logged = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        peaks = got[0][1]
        skew, pred = _memory_at_routing(rec, costs, profile, logged[:2])
        predicted = pred.memory_bytes + pred.host_bytes
        row = dict(layout=rec.label(), skew=skew, predicted=predicted, measured=max(peaks), by_rank=peaks)
        row["error"] = row["measured"] / predicted - 1
        rows.append(row)
        print(
            f"| {row['layout']} | {skew:.2f} | {predicted / 1e6:.2f} | {row['measured'] / 1e6:.2f} "
            f"({', '.join(f'{x / 1e6:.2f}' for x in peaks)}) | {row['error']:+.1%} |",
            flush=True,
        )
    errs = [abs(r["error"]) * 100 for r in rows]
    out = dict(rows=rows, mean_pct=float(np.mean(errs)), max_pct=max(errs), within_5=sum(e <= 5 for e in errs))
    print(
        f"\npeak memory, {len(rows)} layouts: mean {out['mean_pct']:.1f}%, largest {out['max_pct']:.1f}%, "
        f"{out['within_5']} of {len(rows)} within 5%"
    )
    return out


def _one_rank_config(fields: dict) -> TransformerConfig:
    f = dict(d_model=64, n_layers=4, n_heads=4, d_ff=256, experts=8, checkpoint=False) | fields
    m = MoEConfig(d_model=f["d_model"], d_ff=f["d_ff"], num_experts=f["experts"], top_k=2)
    return TransformerConfig(
        vocab_size=256,
        d_model=f["d_model"],
        n_layers=f["n_layers"],
        n_heads=f["n_heads"],
        d_ff=f["d_ff"],
        max_seq_len=128,
        moe=m,
        checkpoint_activations=f["checkpoint"],
    )


def part_r(profile_name: str, steps: int = 9) -> dict:
    """One rank's bare forward and backward (the model and a cross-entropy loss, one thread, the
    median of ``steps`` after two) on each ``ONE_RANK`` shape, against the planner's compute for
    one rank (``zero.plan``'s F, I and W passes, no trainer around them) on ``profile_name``."""
    import torch
    import torch.nn.functional as nnf

    from experiments.calibrate import _times
    from moe.model import Transformer
    from zero.plan.terms import _Costing

    torch.set_num_threads(1)
    profile = dataclasses.replace(zplan.load_profile(profile_name), background_load=0.0)
    rows = []
    for label, fields, B, L in ONE_RANK:
        cfg = _one_rank_config(fields)
        costs = model_costs(cfg, L, experts=profile.expert_kernel)
        rec = zplan.LayoutRecord(world=1, batch_size=B, checkpoint_activations=cfg.checkpoint_activations)
        cst = _Costing(rec, costs, profile, None)
        # a checkpointed block's forward runs again in its backward
        predicted = sum(sum(cst.compute(b).values()) + cst.recomputes(b) * cst.compute(b)["F"] for b in costs.blocks)
        torch.manual_seed(0)
        model = Transformer(cfg)
        x = torch.randint(0, cfg.vocab_size, (B, L))

        def step():
            nnf.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()

        step()  # and _times' own warm-up: two untimed steps
        times = _times(step, steps)
        measured = statistics.median(times)
        rows.append(dict(shape=f"{label}, {B} x {L}", measured_s=measured, predicted_s=predicted))
        print(
            f"| {label}, {B} x {L} | {measured * 1e3:.1f} | {predicted * 1e3:.1f} | {predicted / measured - 1:+.0%} |"
        )
    mae = float(np.mean([abs(r["predicted_s"] / r["measured_s"] - 1) for r in rows]) * 100)
    print(f"\none rank's forward and backward on {profile.name}: mean absolute error {mae:.1f}%")
    return dict(rows=rows, mae_pct=mae, profile=profile.name)


# ----- (s) the split backward ------------------------------------------------------------------------


def _recompute_rank(rank, world, overrides, run_dir, once: bool):
    """One rank of ``part_k``: the trainer, each block's forwards counted; ``once=False`` puts
    torch's checkpoint where a split backward takes ``moe.recompute.checkpoint_once``."""
    import torch
    from torch.utils.checkpoint import checkpoint

    import moe.model as mm

    if not once:

        def per_pass(fn, *args, context_fn=None):
            return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn)

        mm.checkpoint_once = per_pass
    seen = {"n": 0}
    forward = mm.Block.forward

    def counted(self, *args, **kwargs):
        if torch.is_grad_enabled() and self.training:
            seen["n"] += 1
        return forward(self, *args, **kwargs)

    mm.Block.forward = counted
    _rank_fn(rank, world, overrides, run_dir)
    return seen["n"]


RECOMPUTED = [
    dict(pp=2, pp_schedule="zbv", pp_virtual_stages=2, pp_microbatches=4, checkpoint_activations=True),
    dict(pp=2, pp_schedule="interleaved_zb", pp_virtual_stages=2, pp_microbatches=4, checkpoint_activations=True),
    dict(pp=2, pp_schedule="dualpipev", pp_virtual_stages=2, pp_microbatches=4, checkpoint_activations=True),
]


def part_k(steps: int = 8, repeats: int = 2, layouts=None) -> dict:
    """(k) checkpointing under a split backward: ``model=small`` on 2 ranks under each zero-bubble
    schedule with activation checkpointing, its blocks checkpointed with torch's checkpoint (one
    recomputation per graph task: the input pass, and each parameter group of the weight pass) and
    with ``moe.recompute.checkpoint_once`` (one), alternately, ``repeats`` times: the median step
    (steps 3 on) and each rank's block forwards per block and micro-batch beyond the first."""
    from tests.support.dist import run_distributed

    rows = []
    for fields in layouts or RECOMPUTED:
        rec = zplan.LayoutRecord(world=2, batch_size=16, **fields)
        blocks = 4  # model=small's
        out = dict(layout=rec.label(), torch=[], once=[])
        for _ in range(repeats):
            for mode in ("torch", "once"):
                with tempfile.TemporaryDirectory() as tmp:
                    run = str(Path(tmp) / "run")
                    counts = run_distributed(
                        _recompute_rank, 2, [*BASE, f"train.steps={steps}", *rec.overrides()], run, mode == "once"
                    )
                    logged = [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]
                step = statistics.median(16 * 128 / r["tokens_per_s"] for r in logged[2:])
                # every block runs once a micro-batch in the forward; the rest are recomputations
                again = sum(counts) / (steps * rec.pp_microbatches * blocks) - 1
                out[mode].append(dict(step_s=step, recomputations=again))
        rows.append(out)
        t, o = ([r["step_s"] for r in out[k]] for k in ("torch", "once"))
        print(
            f"| {rec.label()} | {', '.join(f'{x:.3f}' for x in t)} | {', '.join(f'{x:.3f}' for x in o)} "
            f"| {statistics.median(t) / statistics.median(o):.2f}x "
            f"| {out['torch'][0]['recomputations']:.2f} | {out['once'][0]['recomputations']:.2f} |",
            flush=True,
        )
    return dict(rows=rows)


def part_s(steps: int = 10) -> dict:
    """The zero-bubble schedules' split backward against a whole one, on one process: two blocks of
    ``model=small`` (dense, and MoE on the CPU kernel and on the reference loop; dense also at
    widths 256 and 512) on one micro-batch of 4 x 128 tokens, torch.distributed.pipelining's
    ``stage_backward`` against its ``stage_backward_input`` then ``stage_backward_weight`` (the
    median of ``steps`` after two).
    The planner takes the measured shares where the profile has them (docs/design.md)."""
    import torch

    import routing_kernels as rk
    from experiments.calibrate import time_split_backward
    from experiments.plan import _model_config, compose
    from moe.model import Transformer

    torch.set_num_threads(1)
    small = _model_config(compose(BASE))
    torch.manual_seed(0)
    moe_model = Transformer(small)

    def dense(width: int):  # model=small's blocks made dense, at width (and FFN 4x width, heads of 16)
        return Transformer(
            dataclasses.replace(
                small, moe_every=0, moe=None, n_layers=2, d_model=width, d_ff=4 * width, n_heads=width // 16
            )
        )

    out = {}
    for label, model, backend in (
        ("2 dense blocks", dense(small.d_model), None),
        ("2 MoE blocks, CPU kernel", moe_model, None),
        ("2 MoE blocks, reference loop", moe_model, "loop"),
        ("2 dense blocks at width 256", dense(256), None),
        ("2 dense blocks at width 512", dense(512), None),
    ):
        blocks = list(model.blocks[:2])
        width = model.cfg.d_model
        cos, sin = model.rope_cos[:128], model.rope_sin[:128]
        h0, grad = torch.randn(4, 128, width), torch.randn(4, 128, width)
        with rk.use_expert_backend(backend) if backend else contextlib.nullcontext():
            whole, inputs, weights = time_split_backward(blocks, h0, grad, cos, sin, steps + 2)
        w, i, wt = (statistics.median(v[2:]) for v in (whole, inputs, weights))
        out[label] = dict(whole_s=w, input_s=i, weight_s=wt)
        print(f"| {label} | {w * 1e3:.2f} | {i * 1e3:.2f} | {wt * 1e3:.2f} | {(i + wt) / w:.2f}x |")
    return out


# ----- (h) a pipeline's hand-over between computing ranks ------------------------------------------

HAND_SIZES = (4096, 131072, 1048576)  # model=small's activation of a 4 x 128 micro-batch is 131,072 bytes


def _hand_rank(rank, world, sizes, items, repeats):
    """Rank 0 and 1 of ``part_h``: per message size, ``repeats`` rounds of three timings, each an
    item's seconds: the compute alone (both ranks at once), as a chain (0 computes then sends, 1
    receives then computes: a pipeline's forwards) and both ways (each computes, then sends to and
    receives from the other: 1F1B's steady state), through ``dist.batch_isend_irecv`` as
    torch.distributed.pipelining posts its transfers. Returns each size's rounds, each
    ``(alone, chain, both)``; the ranks time each round at once (between barriers)."""
    import torch
    import torch.distributed as dist

    from experiments.calibrate import _busy_segment

    torch.set_num_threads(1)
    work = _busy_segment(0.008)  # about 8 ms of a reference block's forwards, as a chunk of model=small
    peer = 1 - rank

    def alone():
        for _ in range(items):
            work()

    def chain(x, y):
        sends = []
        for _ in range(items):
            if rank == 0:
                work()
                sends += dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer)])
            else:
                for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, y, peer)]):
                    w.wait()
                work()
        for w in sends:
            w.wait()

    def both(x, y):
        for _ in range(items):
            work()
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, peer)]):
                w.wait()

    def timed(fn, *a):
        dist.barrier()
        t = time.perf_counter()
        fn(*a)
        return (time.perf_counter() - t) / items

    out = {}
    for size in sizes:
        x, y = torch.randn(size // 4), torch.empty(size // 4)
        out[size] = [(timed(alone), timed(chain, x, y), timed(both, x, y)) for _ in range(repeats)]
    return out


def hand_extras(ranks: list, items: int) -> tuple[float, list[float], dict]:
    """``ranks[r]``: rank r's rounds of ``_hand_rank``, each ``(alone, chain, both)`` seconds an
    item. The two ranks' cores need not run at one speed, and a chain and both ways go at the
    slower rank's pace: each round's extra is over the slower rank's compute alone in that round
    (the machine's speed moves between rounds), and of the rounds the median. The chain's
    receiver first waits for one item, so its time holds items + 1 paces. Returns the slower
    rank's compute alone, each rank's, and ``{"chain": s, "both": s}``: the extra an item."""
    slower = [[max(t[i] for t in rnd) for i in range(3)] for rnd in zip(*ranks)]
    for x in slower:
        x[1] *= items / (items + 1)
    alone = statistics.median(x[0] for x in slower)
    extra = {k: statistics.median(x[i] - x[0] for x in slower) for i, k in ((1, "chain"), (2, "both"))}
    return alone, [statistics.median(t[0] for t in rounds) for rounds in ranks], extra


def part_h(profile_name: str, items: int = 20, repeats: int = 9) -> dict:
    """A pipeline's hand-over between two ranks that compute, each on a core of this machine (2 gloo
    ranks of one thread): each item's time beyond the slower rank's compute alone, as a chain and both ways
    (``_hand_rank``), against the planner's rule with no core to spare: the transfer's calibrated
    time h (``profile_name``'s intra-node p2p) on the sender's action and on the receiver's, so a
    chain paces at compute + h and both ways at compute + 2h. Were it a wait between the ranks
    (the rule with a core to spare) a chain would pace at the compute alone."""
    from tests.support.dist import run_distributed

    profile = zplan.load_profile(profile_name)
    link = profile.link("intra", "p2p")
    res = run_distributed(_hand_rank, 2, HAND_SIZES, items, repeats, timeout=600)
    rows = []
    for size in HAND_SIZES:
        alone, by_rank, extra = hand_extras([r[size] for r in res], items)
        h = link.time("p2p", size, 2)
        row = dict(bytes=size, alone_s=alone, alone_by_rank_s=by_rank, h_s=h)
        rows.append(dict(row, chain_s=extra["chain"], both_s=extra["both"]))
        print(
            f"| {size:,} | {alone * 1e3:.2f} ({', '.join(f'{t * 1e3:.2f}' for t in by_rank)}) "
            f"| {extra['chain'] * 1e3:.2f} | {h * 1e3:.2f} "
            f"| {extra['both'] * 1e3:.2f} | {2 * h * 1e3:.2f} |"
        )
    return dict(rows=rows, profile=profile.name)


# ----- (b) on paper ---------------------------------------------------------------------------------


def deepseek_v3() -> TransformerConfig:
    """DeepSeek-V3's architecture (its config.json on the Hugging Face Hub; the report's table 1): 61
    blocks, the first 3 dense (FFN 18,432), MLA (128 heads, q rank 1,536, kv rank 512, rope 64 +
    nope 128, value 128), 256 routed experts of 2,048 and one shared, top-8 of 8 groups limited to 4,
    sigmoid scores. The multi-token-prediction module is left out."""
    m = MoEConfig(
        d_model=7168,
        d_ff=2048,
        num_experts=256,
        top_k=8,
        score_func="sigmoid",
        num_groups=8,
        topk_groups=4,
        route_scale=2.5,
        expert_bias=True,
        aux_loss_coef=0.0,
        seq_aux_loss_coef=1e-4,
        z_loss_coef=0.0,
        num_shared_experts=1,
        shared_d_ff=2048,
    )
    return TransformerConfig(
        vocab_size=129280,
        d_model=7168,
        n_layers=61,
        n_heads=128,
        d_ff=18432,
        max_seq_len=4096,
        moe=m,
        first_k_dense=3,
        attention="mla",
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
    )


def mixtral_8x7b() -> TransformerConfig:
    """Mixtral-8x7B (its config.json): 32 blocks, d_model 4,096, 32 heads, 8 key/value heads, 8
    experts of 14,336, top-2."""
    m = MoEConfig(d_model=4096, d_ff=14336, num_experts=8, top_k=2)
    return TransformerConfig(
        vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336, max_seq_len=4096, moe=m
    )


CASES = {
    "DeepSeek-V3 on 2048 H800": dict(
        cfg=deepseek_v3,
        profile="h800_node",
        world=2048,
        batch=15360,
        # node-limited dispatch (at most 4 nodes a token: its 4 groups of 8, a node each), as run;
        # the flat All-to-All is predicted beside it for comparison
        # DualPipe's overlapped pairs (each pass's All-to-All beside the other's compute), as run
        published=dict(
            pp=16,
            ep=64,
            zero_stage=1,
            pp_schedule="dualpipev",
            pp_virtual_stages=2,
            pp_overlap=True,
            ep_dispatch="node",
        ),
        published_tokens_per_gpu=1e12 / (180e3 * 3600),
        # what the search varies around the published layout (the whole space is ~10^5 layouts of
        # simulated 16-32 stage pipelines: hours of Python): pp, ep, ZeRO, checkpointing, schedule
        fixed=dict(grad_accum=1),
        microbatches=(15, 20, 30, 40, 60, 120),
        # what the run had and this trainer has not (the comparison adds them one at a time)
        lacks="its memory savings without full recomputation, FP8 products",
    ),
    "Mixtral-8x7B on 64 H100": dict(
        cfg=mixtral_8x7b,
        profile="h100_node",
        world=64,
        batch=256,
        # Megatron-Core keeps the embedding on the first pipeline stage and the head on the last,
        # each beside the one block of every one of the 32 virtual stages: layers 2/1/.../1/2
        published=dict(
            pp=4, ep=8, zero_stage=1, pp_schedule="interleaved_1f1b", pp_virtual_stages=8, pp_layers=(2, *[1] * 30, 2)
        ),
        published_tflops=468e12,
        fixed=dict(grad_accum=1),
        microbatches=(4, 8, 16),
        # the pipeline schedules Megatron-Core picks from (schedules.get_forward_backward_func: none,
        # 1F1B, interleaved 1F1B); the run had no zero-bubble, GPipe or DualPipe schedule, nor
        # overlapped pairs. The published layout is also ranked among the layouts these run
        run_schedules=(None, "1f1b", "interleaved_1f1b"),
    ),
}


def _published(case: dict, costs, profile: zplan.Profile, skew: float, **override):
    """The published layout (``override`` on it) at its best micro-batch count, with and without
    recomputation: ``(record, prediction)``, one that fits before one that does not, then the faster."""
    best = None
    for ckpt in (False, True):
        for m in case["microbatches"]:
            rec = zplan.LayoutRecord(
                world=case["world"],
                batch_size=case["batch"],
                mixed_precision="bf16",
                pp_microbatches=m,
                checkpoint_activations=ckpt,
                **{**case["published"], **override},
            )
            if zplan.layout_problem(rec, costs.num_layers, costs.num_experts, costs.tied, profile.node_size):
                continue
            p = zplan.predict(rec, costs, profile, skew=skew)
            if best is None or (p.fits, -p.step_s) > (best[1].fits, -best[1].step_s):
                best = (rec, p)
    return best


def fp8_products(profile: zplan.Profile) -> zplan.Profile:
    """``profile`` with its bf16 products at twice the rate: FP8 tensor cores (an H800's and an
    H100's dense FP8 peak is 1,979 TFLOP/s, twice bf16's 989: NVIDIA's product briefs), at the same
    share of peak as the profile's bf16 figure. Attention's own products stay at bf16's rate (DeepSeek-V3 ran
    its attention core in bf16): a profile without an attention table gets its bf16 product rate
    as one. For the comparison with a published run only; this trainer has no FP8 products."""
    d = profile.to_dict()
    bf16 = d["matmul_flops"].get("bf16")
    if not bf16:
        raise ValueError(f"profile {profile.name} has no bf16 product rates to double: {sorted(d['matmul_flops'])}")
    d["matmul_flops"] = dict(d["matmul_flops"], bf16=[[*shape, 2 * rate] for *shape, rate in bf16])
    if not d.get("attention_flops"):
        # one point: its rate everywhere, with the planner's backward-to-forward ratio for attention (2.5)
        d["attention_flops"] = {"bf16": [[4096.0, 128.0, max(rate for *_, rate in bf16), 2.5]]}
    d["name"] = f"{profile.name}, products in fp8"
    return zplan.Profile.from_dict(d)


def missing_features(rec: zplan.LayoutRecord, costs, profile: zplan.Profile, skew: float) -> list[dict]:
    """The planner's arithmetic for what a published run had that this trainer lacks, added one at
    a time to ``rec`` (the published layout as this trainer runs it, DualPipe's overlapped pairs
    included where it asks for them: ``pp_overlap``): no recomputation (the run's memory savings
    let it keep its activations) and FP8 products (``fp8_products``). Tokens/s of the whole run,
    step seconds and the predicted peak (what the trainer would need to hold without the run's
    memory savings)."""
    whole = dataclasses.replace(rec, checkpoint_activations=False)
    out = []
    for label, r, prof in (
        ("as this trainer runs it", rec, profile),
        ("without recomputation", whole, profile),
        ("and FP8 products", whole, fp8_products(profile)),
    ):
        p = zplan.predict(r, costs, profile=prof, skew=skew)
        out.append(
            dict(
                what=label,
                step_s=p.step_s,
                tokens_per_s=p.tokens_per_s,
                memory_gb=p.memory_bytes / 1e9,
                moe_comm_s=p.time_parts["moe_comm"],
            )
        )
    return out


def _position(rec, p, ranked) -> int:
    """Where ``rec`` would rank among ``ranked`` (the published cut need not be one the planner lists)."""
    key = (not p.fits, p.step_s, p.memory_bytes)
    return 1 + sum(1 for r, q in ranked if r != rec and (not q.fits, q.step_s, q.memory_bytes) < key)


def with_schedules(ranked, schedules) -> list:
    """Of ``ranked`` (``(record, prediction)`` pairs), those whose pipeline schedule is one of
    ``schedules`` (None: no pipeline), without overlapped pairs: the layouts a published run's
    toolkit could have run."""
    return [(r, q) for r, q in ranked if r.pp_schedule in schedules and not r.pp_overlap]


def part_b(skew: float) -> dict:
    out = {}
    for name, case in CASES.items():
        cfg = case["cfg"]()
        costs = model_costs(cfg, 4096, act_dtype="bf16")
        profile = zplan.load_profile(case["profile"])
        t0 = time.perf_counter()
        recs = [
            r
            for r in zplan.enumerate(
                costs,
                world=case["world"],
                batch_size=case["batch"],
                mixed_precision="bf16",
                fixed=case["fixed"],
                max_virtual=8,
                node_size=profile.node_size,  # ep_dispatch=node too, where an ep group spans whole nodes
            )
            if r.pp == 1 or r.pp_microbatches in case["microbatches"]
        ]
        recs = zplan.with_balanced(recs, costs, profile, skew)  # as python -m experiments.plan lists them
        ranked = zplan.rank(costs, profile, recs, skew=skew)
        elapsed = time.perf_counter() - t0
        flops = costs.model_flops_per_token()
        if "published_tokens_per_gpu" in case:
            published = case["published_tokens_per_gpu"]
        else:
            published = case["published_tflops"] / flops
        rec, p = _published(case, costs, profile, skew)
        position = _position(rec, p, ranked)
        fitting = sum(1 for _, q in ranked if q.fits)
        tok_gpu = p.tokens_per_s / case["world"]
        res = dict(
            layout=rec.label(),
            predicted_tokens_per_gpu=tok_gpu,
            published_tokens_per_gpu=published,
            ratio=tok_gpu / published,
            predicted_tflops_per_gpu=tok_gpu * flops / 1e12,
            published_tflops_per_gpu=published * flops / 1e12,
            memory_gb=p.memory_bytes / 1e9,
            memory_parts_gb={k: v / 1e9 for k, v in p.memory_parts.items()},
            fits=p.fits,
            bubble=p.bubble,
            time_parts=p.time_parts,
            rank=position,
            layouts=len(ranked),
            layouts_fitting=fitting,
            best=[(r.label(), q.tokens_per_s / case["world"], q.memory_bytes / 1e9) for r, q in ranked[:5]],
            search_s=elapsed,
            layouts_node=sum(1 for r, _ in ranked if r.ep_dispatch == "node"),
            layouts_overlap=sum(1 for r, _ in ranked if r.pp_overlap),
        )
        if rec.ep_dispatch == "node":  # the flat All-to-All beside it
            f_rec, f_p = _published(case, costs, profile, skew, ep_dispatch="flat")
            res["flat"] = dict(
                layout=f_rec.label(),
                predicted_tokens_per_gpu=f_p.tokens_per_s / case["world"],
                ratio=f_p.tokens_per_s / case["world"] / published,
                memory_gb=f_p.memory_bytes / 1e9,
                fits=f_p.fits,
                moe_comm_s=f_p.time_parts["moe_comm"],
                rank=_position(f_rec, f_p, ranked),
            )
        if rec.pp_overlap:  # the pairs one pass after the other beside it
            o_rec, o_p = _published(case, costs, profile, skew, pp_overlap=False)
            res["no_overlap"] = dict(
                layout=o_rec.label(),
                predicted_tokens_per_gpu=o_p.tokens_per_s / case["world"],
                ratio=o_p.tokens_per_s / case["world"] / published,
                step_s=o_p.step_s,
                rank=_position(o_rec, o_p, ranked),
            )
        if case.get("run_schedules"):
            theirs = with_schedules(ranked, case["run_schedules"])
            res["run_schedules"] = dict(
                schedules=[s or "none" for s in case["run_schedules"]],
                rank=_position(rec, p, theirs),
                layouts=len(theirs),
                best=[(r.label(), q.tokens_per_s / case["world"], q.memory_bytes / 1e9) for r, q in theirs[:3]],
            )
        if case.get("lacks"):
            res["missing_features"] = missing_features(rec, costs, profile, skew)
        out[name] = res
        print(f"\n{name} ({profile.name}, skew {skew}): published layout {rec.label()}")
        print(
            f"  predicted {tok_gpu:,.0f} tokens/s per GPU ({res['predicted_tflops_per_gpu']:.0f} TFLOP/s model), "
            f"published {published:,.0f} ({res['published_tflops_per_gpu']:.0f}): ratio {res['ratio']:.2f}"
        )
        print(
            f"  memory {res['memory_gb']:.1f} GB per GPU ({'fits' if p.fits else 'does NOT fit'} in "
            f"{profile.device_memory_bytes / 1e9:.0f}), bubble {p.bubble:.2f}; "
            + ", ".join(f"{k} {v:.1f}" for k, v in res["memory_parts_gb"].items())
        )
        print(f"  All-to-All {p.time_parts['moe_comm']:.1f} s of the {p.step_s:.1f} s step")
        if "flat" in res:
            f = res["flat"]
            print(
                f"  flat dispatch instead: {f['layout']}: {f['predicted_tokens_per_gpu']:,.0f} tokens/s per GPU "
                f"(ratio {f['ratio']:.2f}), All-to-All {f['moe_comm_s']:.1f} s, {f['memory_gb']:.1f} GB, "
                f"rank {f['rank']}"
            )
        if "no_overlap" in res:
            o = res["no_overlap"]
            print(
                f"  without the overlap: {o['layout']}: {o['predicted_tokens_per_gpu']:,.0f} tokens/s per GPU "
                f"(ratio {o['ratio']:.2f}), step {o['step_s']:.1f} s, rank {o['rank']}"
            )
        print(
            f"  rank {position} of {len(ranked)} layouts searched ({res['layouts_node']} with node dispatch, "
            f"{res['layouts_overlap']} with overlapped pairs; "
            f"{fitting} fit) in {elapsed:.0f} s; planner's top 5 (tokens/s per GPU, GB):"
        )
        for label, t, g in res["best"]:
            print(f"    {label}: {t:,.0f}, {g:.1f}")
        if "run_schedules" in res:
            rs = res["run_schedules"]
            print(
                f"  among the {rs['layouts']} layouts of the run's own schedules ({', '.join(rs['schedules'])}; "
                f"no overlapped pairs): rank {rs['rank']}; their top 3:"
            )
            for label, t, g in rs["best"]:
                print(f"    {label}: {t:,.0f}, {g:.1f}")
        if "missing_features" in res:
            print(f"  what the run had that this trainer lacks ({case['lacks']}), added one at a time:")
            for w in res["missing_features"]:
                t = w["tokens_per_s"] / case["world"]
                print(
                    f"    {w['what']}: {t:,.0f} tokens/s per GPU (ratio {t / published:.2f}), "
                    f"step {w['step_s']:.1f} s, {w['memory_gb']:.0f} GB"
                )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.bench.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="ab", choices=["a", "b", "ab", "r", "s", "h", "m", "v", "k", "c"])
    ap.add_argument("--profile", default="cpu_2core", help="(r, h): the profile predicted on")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="(a): runs of each layout, round robin")
    ap.add_argument("--quick", action="store_true", help=f"(a): {len(QUICK)} of the {len(LAYOUTS)} layouts")
    ap.add_argument(
        "--drift",
        action="store_true",
        help="(a): one calibration, then at once one rank alone, pp1 dp2 and pp2 1f1b (one round)",
    )
    ap.add_argument(
        "--calibrate",
        action="store_true",
        help="(a): calibrate this machine before each round and predict the round on that profile",
    )
    ap.add_argument("--seconds", type=float, default=60.0, help="(v): how long each process steps")
    ap.add_argument("--alone", action="store_true", help="(v): one process, the other cores idle")
    ap.add_argument(
        "--sample",
        type=int,
        default=None,
        help="(m): this many layouts drawn at random from all the planner lists on 2 and 4 ranks, not (a)'s",
    )
    ap.add_argument("--seed", type=int, default=0, help="(m): the draw's seed")
    ap.add_argument("--world", type=int, default=2, help="(c): ranks")
    ap.add_argument(
        "--layout",
        default="{}",
        help='(c): the layout\'s LayoutRecord fields as JSON, e.g. \'{"pp": 2, "pp_schedule": "zbv", '
        '"pp_virtual_stages": 2}\'',
    )
    ap.add_argument("--skew", type=float, default=1.5, help="(b): dropless experts' worst rows over the mean")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    results = {}
    if "a" in a.part:
        print(
            "| run | ranks | layout | background load | predicted s/step | measured s/step | error "
            "| predicted model states (MB) | measured (MB) | predicted peak (MB) | measured peak (MB) | peak error |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        if a.drift:
            results["a"] = part_a(a.steps, quick=False, rounds=1, calibrate=True, layouts=DRIFT)
        else:
            results["a"] = part_a(a.steps, a.quick, a.rounds, a.calibrate)
    if "b" in a.part:
        results["b"] = part_b(a.skew)
    if a.part == "s":
        print("| two blocks, 4 x 128 tokens | whole backward ms | input pass ms | weight pass ms | split / whole |")
        print("|---|---|---|---|---|")
        results["s"] = part_s()
    if a.part == "h":
        print(
            "| message bytes | compute alone ms (rank 0, 1) | chain: measured extra ms | chain: planner ms (h) "
            "| both ways: measured extra ms | both ways: planner ms (2h) |\n|---|---|---|---|---|---|"
        )
        results["h"] = part_h(a.profile)
    if a.part == "m":
        print(
            "| layout | memory skew | predicted peak (MB) | measured peak (MB; by rank) | error |\n"
            "|---|---|---|---|---|"
        )
        results["m"] = part_m(sampled_layouts(a.sample, a.seed) if a.sample is not None else None)
    if a.part == "v":
        print(
            "| process | steps | median step ms | 1 s windows' medians, ms | 5 s windows' medians, ms "
            "| a run's median step |\n|---|---|---|---|---|---|"
        )
        results["v"] = part_v(a.seconds, busy=not a.alone)
    if a.part == "k":
        print(
            "| layout | torch's checkpoint s/step | checkpoint_once s/step | speed-up | recomputations a block "
            "and micro-batch: torch's | checkpoint_once |\n|---|---|---|---|---|---|"
        )
        results["k"] = part_k(a.steps)
    if a.part == "c":
        try:
            fields = json.loads(a.layout)
        except json.JSONDecodeError as e:
            raise SystemExit(
                f"--layout {a.layout!r} is not JSON ({e}): give LayoutRecord fields, e.g. '{{\"pp\": 2}}'"
            ) from None
        results["c"] = part_c(a.world, fields)
    if a.part == "r":
        print("| shape (sequences x tokens) | measured ms | predicted ms | error |\n|---|---|---|---|")
        results["r"] = part_r(a.profile)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1, default=lambda o: dataclasses.asdict(o)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
