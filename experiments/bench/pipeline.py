"""Pipeline schedules: measured bubble against theory, peak activation memory per stage, and the
cost of pp2 x ep2 x ZeRO-3 against pp=1 ZeRO-3 on the same 4 ranks.

    python -m experiments.bench.pipeline [--op-ms 20] [--steps 3] [--pp 2 4] [--microbatches 4 8] [--skip-trainer]

Part 1 (schedules). Every stage costs the same and every pass of every micro-batch takes a fixed
time: each layer's forward, input-gradient and weight-gradient passes each hold the CPU-free wait of
``--op-ms`` (two autograd nodes, one on the input path and one on the weight path, so torch's
zero-bubble schedules can run them apart). A rank's compute is therefore known exactly, and the
cores of a small machine never limit how many stages compute at once: what is measured is the
schedule (and its point-to-point traffic), which is what a bubble is. Bubble = 1 - compute / step
time on the busiest stage (all stages do the same compute; the worst rank is reported), the
median of ``--steps`` steps after one warm-up step. Theory: the closed forms (p-1)/(m+p-1) for
GPipe and 1F1B and (p-1)/(v*m+p-1) for interleaved 1F1B, and for every schedule the ideal bubble of
torch's own plan for it (``simulate``: each rank runs its actions in order as soon as their inputs
exist, F, I and W one unit each, a full backward two, communication free; DualPipeV's overlapped
forward-backward pairs start once both halves' inputs are there, as torch's runtime runs them),
which is the zero-bubble schedules' own formula evaluated for this p, v and m, and equals the closed
forms where they exist.

Peak activations: the bytes saved for backward that are alive at once on a stage (a saved-tensors
hook counts each saved tensor until autograd frees it), in micro-batches' worth: GPipe keeps all m,
1F1B at most p (stage 0), the interleaved ones in between.

Part 2 (trainer). ``experiments.train`` on 4 gloo ranks, ``parallel=pp2_ep2_zero3`` against
``parallel.ep=2 parallel.zero_stage=3`` (dp=4), the same model and global batch; tokens per second
of each, and their ratio. On a 2-core machine 4 ranks share the cores, so this is the overhead of
the pipeline's extra communication and bubble under contention, not a speed-up.
"""

from __future__ import annotations

import argparse
import statistics
import time
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from experiments.launch import init_rank, rendezvous_port
from zero import Layout, ZeroEngine
from zero.pipeline import SCHEDULES, Pipeline, plan_pipeline

# (schedule, virtual stages per rank)
CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_zb", 2), ("zbv", 2), ("dualpipev", 2)]


class _InputPath(torch.autograd.Function):
    """Identity that waits ``t_f`` in forward and ``t_i`` in backward, saving an activation."""

    @staticmethod
    def forward(ctx, x, t_f, t_i):
        time.sleep(t_f)
        ctx.t_i = t_i
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.saved_tensors  # noqa: B018 (unpacked, as a real layer's backward would)
        time.sleep(ctx.t_i)
        return g, None, None


class _WeightPath(torch.autograd.Function):
    """Zero contribution from ``w`` whose backward (the weight gradient) waits ``t_w``."""

    @staticmethod
    def forward(ctx, w, t_w):
        ctx.t_w = t_w
        return w * 0.0

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.t_w)
        return g, None


class TimedLayer(nn.Module):
    def __init__(self, d: int, t: float):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(d))
        self.t = t

    def forward(self, x):
        return _InputPath.apply(x, self.t, self.t) + _WeightPath.apply(self.w, self.t)


class Chunk(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class SavedBytes:
    """Bytes saved for backward and still alive, and their peak, through saved-tensor hooks."""

    def __init__(self):
        self.live = self.peak = 0

    def pack(self, t):
        holder = _Holder(t)
        self.live += t.nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(holder, self._free, t.nbytes)
        return holder

    def _free(self, n):
        self.live -= n

    @staticmethod
    def unpack(holder):
        return holder.t


class _Holder:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


def _compute_actions(pipe: Pipeline) -> dict[int, list[list]]:
    """torch's plan for the schedule: each rank's compute actions in order, idle slots dropped, as
    groups that start together: one action, or an overlapped forward-backward pair (DualPipeV),
    which torch's runtime starts only once the inputs of both halves have arrived."""
    sched = pipe.schedule
    order = (
        sched._get_pipeline_order()
        if hasattr(sched, "_get_pipeline_order") and not hasattr(sched, "pipeline_order")
        else sched.pipeline_order
    )
    out = {}
    for rank, actions in order.items():
        groups = []
        for a in actions:
            if a is None:
                continue
            group = [x for x in (a.sub_actions or [a]) if x.computation_type.value in "FIWB"]
            if group:
                groups.append(group)
        out[rank] = groups
    return out


def _deps(kind: str, s: int, mb: int, num_stages: int) -> list[tuple]:
    # a forward needs the previous stage's forward of that micro-batch, an input gradient the
    # next stage's ("G"), a weight gradient its own input gradient
    if kind == "F":
        return [] if s == 0 else [("F", s - 1, mb)]
    if kind in "IB":
        return [("F", s, mb)] + ([] if s == num_stages - 1 else [("G", s + 1, mb)])
    return [("G", s, mb)]


def simulate(actions: dict[int, list[list]], num_stages: int) -> float:
    """The schedule's ideal bubble: every rank runs its action groups in order, each as soon as the
    rank is free and the inputs of the whole group exist, the group's actions one after the other,
    with F, I and W one unit each, a full backward two, and communication free. Returns the worst
    rank's idle fraction."""
    dur = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}
    key = lambda a: (
        "G" if a.computation_type.value in "IB" else a.computation_type.value,
        a.stage_index,
        a.microbatch_index,
    )  # noqa: E731
    finish: dict[tuple, float] = {}
    free = {r: 0.0 for r in actions}
    busy = {r: 0.0 for r in actions}
    pos = {r: 0 for r in actions}
    remaining = sum(len(v) for v in actions.values())
    while remaining:
        progressed = False
        for r, groups in actions.items():
            while pos[r] < len(groups):
                group = groups[pos[r]]
                inside = {key(a) for a in group}
                deps = [
                    d
                    for a in group
                    for d in _deps(a.computation_type.value, a.stage_index, a.microbatch_index, num_stages)
                    if d not in inside
                ]
                if any(d not in finish for d in deps):
                    break
                t = max([free[r]] + [finish[d] for d in deps])
                for a in group:
                    t += dur[a.computation_type.value]
                    finish[key(a)] = t
                    busy[r] += dur[a.computation_type.value]
                free[r] = t
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("the schedule's actions cannot all run: a dependency is never met")
    step = max(free.values())
    return max(1 - b / step for b in busy.values())


def theory(schedule: str, p: int, v: int, m: int) -> float | None:
    """The closed forms: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for interleaved 1F1B."""
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    return None


def _schedules(rank, world, args, q):
    init_rank(rank, world, args.port, timeout_s=600)
    torch.set_num_threads(1)
    layout = Layout.build(pp=world)
    t = args.op_ms / 1000.0
    rows = []
    for schedule, v in CASES:
        if schedule not in args.schedules:
            continue
        for m in args.microbatches:
            try:
                plan = plan_pipeline(world * v, pp=world, pp_schedule=schedule, pp_microbatches=m, pp_virtual_stages=v)
            except ValueError as e:
                rows.append((schedule, world, m, None, None, None, str(e)))
                continue
            chunks = [Chunk([TimedLayer(args.d, t)]) for _ in plan.stages_of(layout.pp_rank)]
            holder = nn.ModuleList(chunks)
            engine = ZeroEngine(
                holder, layout, blocks=chunks, entries=chunks, optimizer=lambda g: torch.optim.SGD(g, lr=0.0)
            )
            pipe = Pipeline(chunks, plan, layout, engine, loss_fn=lambda out, y: out.mean())
            pipe.loss_scale = 1.0 / m
            # requires grad, so the first stage saves its activation like any other
            x = torch.randn(m * args.rows, args.seq, args.d, requires_grad=True)
            saved = SavedBytes()
            times = []
            for step in range(args.steps + 1):
                dist.barrier(group=layout.pp_group)
                start = time.perf_counter()
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                    pipe.step(x, x)
                engine.step()
                if step:
                    times.append(time.perf_counter() - start)
            compute = m * len(chunks) * 3 * t  # forward, input and weight gradient of every layer
            bubble = 1 - compute / statistics.median(times)
            per_mb = args.rows * args.seq * args.d * 4  # one micro-batch's saved activation per layer
            peak_mb = saved.peak / (per_mb * len(chunks))
            try:
                ideal = simulate(_compute_actions(pipe), plan.num_stages)
            except (RuntimeError, KeyError):  # torch 2.13's 1F1B plan is off by one micro-batch on later ranks
                ideal = None
            out = torch.tensor([bubble, peak_mb])
            gathered = [torch.zeros(2) for _ in range(world)]
            dist.all_gather(gathered, out)
            if rank == 0:
                worst = max(g[0].item() for g in gathered)
                peaks = [g[1].item() for g in gathered]
                rows.append((schedule, world, m, (theory(schedule, world, v, m), ideal), worst, peaks, None))
            engine.remove_hooks()
    if rank == 0:
        q.put(rows)
    dist.destroy_process_group()


def _trainer(rank, world, args, q):
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from experiments.training.loop import train

    init_rank(rank, world, args.port, timeout_s=600)
    torch.set_num_threads(1)
    base = [
        "model=tiny",
        "logger=none",
        "train.progress=false",
        "train.batch_size=16",
        "train.seq_len=64",
        f"train.steps={args.trainer_steps}",
        "train.eval_every=1000",
        "train.log_every=1000",
        "train.eval_batches=1",
    ]
    results = {}
    for name, overrides in (
        ("pp=1 ZeRO-3 ep=2 (dp=4)", ["parallel.ep=2", "parallel.zero_stage=3"]),
        ("pp=2 x ZeRO-3 ep=2 (dp=2)", ["parallel=pp2_ep2_zero3"]),
    ):
        with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=[*base, *overrides])
        summary = train(cfg)
        results[name] = summary["tokens_per_s"]
    if rank == 0:
        q.put(results)
    dist.destroy_process_group()


def _launch(fn, world, args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    args.port = rendezvous_port()
    mp.start_processes(fn, args=(world, args, q), nprocs=world, start_method="spawn", join=True)
    return q.get()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m experiments.bench.pipeline", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--op-ms", type=float, default=50.0, help="time of each layer's forward, input- and weight-gradient pass"
    )
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--skip-trainer", action="store_true")
    ap.add_argument("--trainer-steps", type=int, default=8)
    ap.add_argument("--schedules", nargs="+", default=[c for c, _ in CASES], choices=[c for c, _ in CASES])
    args = ap.parse_args(argv)
    assert set(dict(CASES)) == set(SCHEDULES)
    print(
        f"each pass of each layer {args.op_ms:g} ms; bubble = 1 - compute / step time on the worst rank; "
        f"peak activations in micro-batches' worth per stage (ranks 0..p-1)"
    )
    print(
        "| schedule | p | m | closed form | torch's plan, simulated | measured | within 0.05 "
        "| peak activations per rank |"
    )
    print("|---|---|---|---|---|---|---|---|")
    peaks = {}
    for p in args.pp:
        for schedule, world, m, th, measured, peak, why in _launch(_schedules, p, args):
            if why is not None:
                print(f"| {schedule} | {world} | {m} | refused: {why} | | | | |")
                continue
            peaks[(schedule, world, m)] = max(peak)
            closed, ideal = th
            ok = "yes" if abs(measured - (ideal if closed is None else closed)) <= 0.05 else "no"
            closed, ideal = ("-" if x is None else f"{x:.3f}" for x in (closed, ideal))
            print(
                f"| {schedule} | {world} | {m} | {closed} | {ideal} | {measured:.3f} | {ok} "
                f"| {', '.join(f'{x:.1f}' for x in peak)} |"
            )
    for p in args.pp:
        if ("gpipe", p, 8) in peaks and ("1f1b", p, 8) in peaks:
            ratio = peaks[("1f1b", p, 8)] / peaks[("gpipe", p, 8)]
            print(f"p={p}, m=8: 1F1B's peak activations / GPipe's = {ratio:.2f} (goal <= p/m = {p / 8:.2f})")
    if not args.skip_trainer:
        res = _launch(_trainer, 4, args)
        (a, ta), (b, tb) = res.items()
        print(f"\ntrainer on 4 gloo ranks, tokens/s: {a} {ta:.0f}, {b} {tb:.0f}; ratio {tb / ta:.2f}")


if __name__ == "__main__":
    main()
