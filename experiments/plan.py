"""Which layout? Every layout the trainer accepts for a model, world size and global batch, each one's
predicted peak memory per rank and step time on a machine profile, ranked fastest first.

    python -m experiments.plan [train overrides] plan.world=8 plan.cluster=h100_node [plan.out=plan.json]
        [plan.top=20] [plan.skew=1.5] [plan.max_virtual=4]
    python -m experiments.plan --calibrate [--out conf/cluster/<name>.yaml] [--base h200_node]

The first form composes the trainer's own config (``conf/train.yaml`` and the same overrides as
``python -m experiments.train``), so the model, ``moe.*``, ``train.batch_size``/``seq_len``,
``precision`` and ``parallel.zero_mixed_precision`` are the run's. A layout key given explicitly
(``parallel.pp=2``, ``parallel.ep=2``, ``parallel.zero_stage=3``, ``parallel.zero_offload=true``,
``parallel.pp_schedule=...``, ``parallel.pp_virtual_stages=...``, ``parallel.pp_microbatches=...``,
``model.checkpoint_activations=true``, ``train.grad_accum=...``) is held at that value; every other
one is searched. It prints a table (fastest first: step time, tokens/s, memory per rank, fits
or not against the profile's device memory) and the fastest layout that fits, writes the JSON list
``[{overrides, memory_bytes, memory_parts, step_s, fits, ...}]`` fastest first to ``plan.out``, and
a chart of memory and time per layout beside it (``plan.png``; needs matplotlib, the ``plan`` extra).

``plan.*`` keys (parsed here, never seen by Hydra): ``world`` (ranks, required), ``cluster`` (a
profile name under ``conf/cluster`` or a yaml path, required), ``out`` (JSON path), ``chart`` (PNG
path; default beside ``out``), ``top`` (table rows, default 20), ``skew`` (dropless MoE: worst-case
rows over the mean; default the worst case possible), ``max_virtual`` (interleaved schedules:
the most virtual stages per rank tried).

``--calibrate`` measures the machine it runs on: matmul FLOP/s by size, a large copy's bandwidth,
the fixed cost of one operator, the host optimizer's rate, and each collective by message size on 2
local ranks (gloo on a CPU, NCCL on 2+ GPUs; α, β by least squares), and writes a profile yaml.
With one GPU the collectives cannot be measured: ``--base`` names the profile whose values fill
what was not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import zero.plan as zplan
from zero.plan import LayoutRecord, Prediction

CONF = Path(__file__).resolve().parents[1] / "conf"
PLAN_KEYS = {"world": int, "cluster": str, "out": str, "chart": str, "top": int, "skew": float, "max_virtual": int}
# LayoutRecord field of each trainer key a user may hold fixed
FIXED = {v: k for k, v in zplan.KEYS.items()}


def _parse_bool(v: str) -> bool:
    if v.lower() in ("true", "1", "yes"):
        return True
    if v.lower() in ("false", "0", "no"):
        return False
    raise ValueError(f"expected true or false, got {v!r}")


def _parse_offload(v: str) -> bool:
    """``parallel.zero_offload``: none/false or cpu/true (the planner models no NVMe offload)."""
    if v.lower() in ("none", "cpu"):
        return v.lower() == "cpu"
    if v.lower() == "nvme":
        raise ValueError("parallel.zero_offload=nvme: the planner models none and cpu only")
    return _parse_bool(v)


def split_args(argv: list[str]) -> tuple[dict, list[str]]:
    """``plan.*`` values (typed) and the remaining Hydra overrides."""
    plan, rest = {}, []
    for a in argv:
        if a.startswith("plan."):
            key, sep, value = a[len("plan.") :].partition("=")
            if not sep or key not in PLAN_KEYS:
                raise ValueError(
                    f"{a!r}: expected plan.<key>=<value> with key one of {sorted(PLAN_KEYS)} "
                    f"(e.g. plan.world=8 plan.cluster=h100_node)"
                )
            try:
                plan[key] = PLAN_KEYS[key](value)
            except ValueError:
                raise ValueError(f"plan.{key}={value!r} is invalid: expected {PLAN_KEYS[key].__name__}") from None
        else:
            rest.append(a)
    return plan, rest


def fixed_keys(overrides: list[str]) -> dict:
    """The layout keys an override sets explicitly, as ``LayoutRecord`` fields."""
    out = {}
    for o in overrides:
        key, sep, value = o.lstrip("+~").partition("=")
        if not sep or key not in FIXED:
            continue
        field = FIXED[key]
        if field == "zero_offload":
            out[field] = _parse_offload(value)
        elif field == "checkpoint_activations":
            out[field] = _parse_bool(value)
        elif field == "pp_schedule":
            out[field] = value
        elif field == "pp_microbatches" and value.lower() in ("null", "none"):
            continue
        else:
            out[field] = int(value)
    return out


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import experiments.training.schema  # noqa: F401  (the schemas and the ${div:} resolver)

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose("train", overrides=list(overrides))


def _model_config(cfg):
    from experiments.training.schema import model_config

    return model_config(cfg)


def costs_of(cfg, profile: zplan.Profile | None = None) -> zplan.ModelCosts:
    from moe.costs import model_costs

    act = "bf16" if cfg.precision == "bf16" or cfg.parallel.zero_mixed_precision == "bf16" else "fp32"
    kernel = profile.expert_kernel if profile is not None else "grouped"
    return model_costs(_model_config(cfg), int(cfg.train.seq_len), act_dtype=act, experts=kernel)


def plan_layouts(cfg, world: int, profile: zplan.Profile, fixed: dict | None = None, **kw):
    """``[(LayoutRecord, Prediction), ...]`` fastest first for the composed config ``cfg``."""
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"plan.world={world!r} is invalid: expected a positive integer (the number of ranks)")
    costs = costs_of(cfg, profile)
    skew = kw.pop("skew", None)
    recs = zplan.enumerate(
        costs,
        world=world,
        batch_size=int(cfg.train.batch_size),
        mixed_precision=str(cfg.parallel.zero_mixed_precision),
        fixed=fixed,
        **kw,
    )
    if not recs:
        raise ValueError(
            f"no layout of {world} ranks is valid for train.batch_size={cfg.train.batch_size}, "
            f"{costs.num_layers} pipeline layers, {costs.num_experts or 'no'} experts"
            + (f" with {fixed}" if fixed else "")
            + ": the batch must split over dp x train.grad_accum (x micro-batches); try another plan.world or batch"
        )
    ranked = [(r, zplan.predict(r, costs, profile, skew=skew)) for r in recs]
    ranked.sort(key=lambda rp: (rp[1].step_s, rp[1].memory_bytes))
    return costs, ranked


def _gb(x: float) -> str:
    return f"{x / 1e9:.3g}"


def table(ranked: list[tuple[LayoutRecord, Prediction]], profile: zplan.Profile, top: int) -> str:
    cap = _gb(profile.device_memory_bytes)
    lines = [
        f"| # | layout | step (s) | tokens/s | memory/rank (GB) | of {cap} GB | fits | bubble |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, (rec, p) in enumerate(ranked[:top], 1):
        lines.append(
            f"| {i} | {rec.label()} | {p.step_s:.4g} | {p.tokens_per_s:.4g} | {_gb(p.memory_bytes)} "
            f"| {p.memory_bytes / profile.device_memory_bytes:.0%} | {'yes' if p.fits else 'NO'} | {p.bubble:.2f} |"
        )
    return "\n".join(lines)


def to_json(ranked) -> list[dict]:
    return [
        {"overrides": rec.overrides(), "label": rec.label(), "world": rec.world, **p.to_dict()} for rec, p in ranked
    ]


def chart(ranked, profile: zplan.Profile, path: Path, top: int = 20) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(15, 6), gridspec_kw={"width_ratios": [1, 1.4]})
    for fits, colour in ((True, "tab:blue"), (False, "tab:red")):
        pts = [(p.step_s, p.memory_bytes / 1e9) for _, p in ranked if p.fits == fits]
        if pts:
            ax0.scatter(*zip(*pts), s=8, c=colour, label="fits" if fits else "does not fit", alpha=0.6)
    ax0.axhline(profile.device_memory_bytes / 1e9, color="k", lw=0.8, ls="--", label="device memory")
    ax0.set_xscale("log")
    ax0.set_yscale("log")
    ax0.set_xlabel("predicted step time (s)")
    ax0.set_ylabel("predicted peak memory per rank (GB)")
    ax0.set_title(f"{len(ranked)} layouts on {profile.name}")
    ax0.legend()
    best = ranked[:top]
    names = [r.label() for r, _ in best][::-1]
    y = range(len(best))
    ax1.barh(y, [p.step_s for _, p in best][::-1], color=["tab:blue" if p.fits else "tab:red" for _, p in best][::-1])
    ax1.set_yticks(list(y), names, fontsize=7)
    ax1.set_xlabel("step time (s), fastest on top; red: does not fit")
    twin = ax1.twiny()
    twin.plot([p.memory_bytes / 1e9 for _, p in best][::-1], list(y), "k.", label="memory per rank (GB)")
    twin.set_xlabel("memory per rank (GB, dots)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_plan(argv: list[str]) -> int:
    opts, overrides = split_args(argv)
    for key in ("world", "cluster"):
        if key not in opts:
            raise ValueError(
                f"plan.{key} is required: python -m experiments.plan [train overrides] plan.world=N "
                f"plan.cluster=<profile> (profiles: {zplan.available_profiles()})"
            )
    profile = zplan.load_profile(opts["cluster"])
    fixed = fixed_keys(overrides)
    cfg = compose(overrides)
    if cfg.optim.name != "adamw" and cfg.optim.name != "adam":
        print(
            f"note: the model states assume Adam's two moments; optim.name={cfg.optim.name} keeps fewer",
            file=sys.stderr,
        )
    kw = {k: opts[k] for k in ("skew", "max_virtual") if k in opts}
    costs, ranked = plan_layouts(cfg, opts["world"], profile, fixed, **kw)
    params = costs.param_counts()
    print(
        f"{len(ranked)} layouts of {opts['world']} ranks on {profile.name} ({profile.device}); model "
        f"{params['dense'] + params['expert']:,} parameters ({params['expert']:,} expert), "
        f"{costs.num_layers} pipeline layers; global batch {cfg.train.batch_size} x {cfg.train.seq_len} tokens"
        + (f"; held: {fixed}" if fixed else "")
    )
    print(table(ranked, profile, opts.get("top", 20)))
    if "out" in opts:
        out = Path(opts["out"])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(to_json(ranked), indent=1))
        print(f"wrote {out}")
    chart_path = opts.get("chart") or (str(Path(opts["out"]).with_suffix(".png")) if "out" in opts else None)
    if chart_path:
        try:
            print(f"wrote {chart(ranked, profile, Path(chart_path), opts.get('top', 20))}")
        except ImportError:
            print("no chart: matplotlib is missing (pip install -e '.[plan]')", file=sys.stderr)
    fitting = [(r, p) for r, p in ranked if p.fits]
    if not fitting:
        least = min(ranked, key=lambda rp: rp[1].memory_bytes)
        print(
            f"nothing fits: the smallest layout ({least[0].label()}) needs {_gb(least[1].memory_bytes)} GB per rank "
            f"and {profile.name} has {_gb(profile.device_memory_bytes)} GB; try more ranks (plan.world), "
            f"model.checkpoint_activations=true, a smaller train.batch_size, or another profile",
            file=sys.stderr,
        )
        return 2
    rec, p = fitting[0]
    print(
        f"picked: {rec.label()}: {p.step_s:.4g} s/step, {p.tokens_per_s:.4g} tokens/s, "
        f"{_gb(p.memory_bytes)} GB per rank\n  torchrun --nproc_per_node={rec.world} -m experiments.train "
        + " ".join(overrides + rec.overrides())
    )
    return 0


# ----- calibration ---------------------------------------------------------------------------------


def _time(fn, repeats: int, sync=lambda: None, best: bool = False) -> float:
    """The median (or ``best``: the least) of ``repeats`` timed calls after one warm-up."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[0] if best else times[len(times) // 2]


def _dispatched(fn) -> int:
    """Operators ``fn`` dispatches (views included), counted as moe.costs counts a block's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


_BUSY = (
    "import time\n"
    "w, c, x = time.perf_counter(), time.process_time(), 0\n"
    "while time.perf_counter() - w < {s}:\n"
    "    x += 1\n"
    "print((time.process_time() - c) / (time.perf_counter() - w))\n"
)


def background_load(cores: int, seconds: float = 2.0) -> float:
    """Other work on this host, in busy processes: ``cores`` busy processes each get a share
    s = cores / (cores + load) of a core (process time over wall time), so load = cores / s - cores.
    Processes, not threads: threads of one interpreter would also wait for each other's lock."""
    import subprocess

    procs = [
        subprocess.Popen([sys.executable, "-c", _BUSY.format(s=seconds)], stdout=subprocess.PIPE, text=True)
        for _ in range(cores)
    ]
    shares = [float(p.communicate()[0]) for p in procs]
    share = min(1.0, sum(shares) / len(shares))
    return max(0.0, cores / share - cores)


def measure_device(device: str, quick: bool = False) -> dict:
    """The rates of this device. Each timing is the best of its repeats: the rate of the device
    itself, the share other work takes being ``background_load`` (measured apart)."""
    import torch

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out: dict = {"matmul_flops": {}}
    # shapes [m, k, n]: tokens (or an expert's rows) by a model's widths
    ms = [256, 1024, 4096, 16384] if cuda else [64, 256, 1024, 4096]
    ks = [256, 1024, 4096, 8192] if cuda else [16, 64, 256, 1024]
    if quick:
        ms, ks = ms[:2], ks[:2]
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        rows = []
        for m in ms:
            for k in ks:
                for n in ks:
                    a = torch.randn(m, k, device=device, dtype=dtype)
                    b = torch.randn(k, n, device=device, dtype=dtype)
                    flops = 2 * m * k * n
                    reps = 10 if cuda else max(2, min(20, int(2e8 / flops)))
                    rows.append([m, k, n, flops / _time(lambda: torch.mm(a, b), reps, sync, best=True)])
        out["matmul_flops"][name] = rows
    n = (1 << 28) if cuda else (1 << 24 if quick else 1 << 25)  # 1 GiB / 64-128 MiB of fp32
    src = torch.empty(n, device=device)
    dst = torch.empty_like(src)
    out["memory_bandwidth"] = 2 * n * 4 / _time(lambda: dst.copy_(src), 10, sync, best=True)  # read and write
    # one dispatched operator's fixed cost: a chain of tiny ops, forward and backward
    x = torch.ones(8, device=device, requires_grad=True)

    def chain():
        y = x
        for _ in range(100):
            y = y * 1.0001
        y.sum().backward()

    out["op_overhead_s"] = _time(chain, 10, sync, best=True) / _dispatched(chain)
    if cuda:
        host = torch.empty(1 << 26, pin_memory=True)
        dev = torch.empty(1 << 26, device=device)
        out["host_link_bandwidth"] = (
            host.numel() * 4 / _time(lambda: dev.copy_(host, non_blocking=True), 10, sync, best=True)
        )
        out["device_memory_bytes"] = float(torch.cuda.get_device_properties(device).total_memory)
        out["device"] = torch.cuda.get_device_name(device)
    else:
        src = torch.empty(1 << 24)
        dst = torch.empty_like(src)
        out["host_link_bandwidth"] = src.numel() * 4 / _time(lambda: dst.copy_(src), 10, best=True)
    p = torch.zeros(1 << 21, requires_grad=True)  # the host optimizer (ZeRO-Offload) on 2M parameters
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-3, foreach=True)
    out["host_adam_params_per_s"] = p.numel() / _time(opt.step, 5, best=True)
    return out


COLL_SIZES = [1 << 12, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24]


def _coll_worker(rank: int, world: int, port: int, backend: str, sizes, q) -> None:
    import torch
    import torch.distributed as dist

    from experiments.launch import init_process_group_on
    from routing_kernels.runtime import all_gather_into, reduce_scatter_into

    torch.set_num_threads(1)
    init_process_group_on(port, rank, world, backend, 300.0)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)
    res = {op: [] for op in zplan.profile.COLLECTIVES}

    def pingpong(t):  # half of it counts: there and back
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)

    for nbytes in sizes:
        n = nbytes // 4
        full = torch.ones(n, device=device)
        part = torch.ones(n // world, device=device)
        ops = {
            "all_reduce": lambda: dist.all_reduce(full),
            "reduce_scatter": lambda: reduce_scatter_into(part, full, None),
            "all_gather": lambda: all_gather_into(full, part, None),
            "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(full), full),
            "p2p": lambda: pingpong(full),
        }
        for op, fn in ops.items():
            # back to back: each call waits for its peer, so a batch's mean is one call's time
            reps = 20 if nbytes <= (1 << 20) else 5

            def batch(fn=fn, reps=reps):
                dist.barrier()
                for _ in range(reps):
                    fn()

            # the least of several batches: on a shared machine the others are the neighbours' noise
            t = (_time(batch, 5, sync, best=True) - _time(dist.barrier, 5, sync, best=True)) / reps
            res[op].append(max(t / (2 if op == "p2p" else 1), 1e-7))
    if rank == 0:
        q.put(res)
    dist.barrier()
    dist.destroy_process_group()


def measure_collectives(backend: str, world: int = 2, sizes=None) -> dict:
    import torch.multiprocessing as mp

    from experiments.launch import rendezvous_port

    sizes = sizes or COLL_SIZES
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = rendezvous_port()
    mp.start_processes(_coll_worker, args=(world, port, backend, sizes, q), nprocs=world, start_method="spawn")
    res = q.get()
    fitted = {}
    for op, times in res.items():
        ab = zplan.fit_alpha_beta(op, world, sizes, times)
        fitted[op] = {"alpha": ab.alpha, "beta": ab.beta}
    return {"fitted": fitted, "raw": {op: list(zip(sizes, t)) for op, t in res.items()}}


def run_calibrate(argv: list[str]) -> int:
    import torch

    ap = argparse.ArgumentParser(prog="python -m experiments.plan --calibrate", description="measure this machine")
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--out", default=None, help="profile yaml to write (default conf/cluster/<name>.yaml)")
    ap.add_argument("--name", default=None)
    ap.add_argument("--base", default=None, help="profile whose values fill what is not measured here")
    ap.add_argument("--quick", action="store_true", help="fewer sizes (a test's smoke run)")
    ap.add_argument("--no-collectives", action="store_true")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda:0" if cuda else "cpu"
    if not cuda:
        torch.set_num_threads(1)  # torchrun's OMP_NUM_THREADS=1 per rank: what one rank gets
    cores = os.cpu_count() or 1
    name = a.name or (Path(a.out).stem if a.out else ("cuda" if cuda else f"cpu_{cores}core"))
    base = zplan.load_profile(a.base).to_dict() if a.base else {}
    m = measure_device(device, quick=a.quick)
    d = dict(base)
    d.update(name=name, notes="")
    sources = dict(base.get("sources") or {})
    for key in ("matmul_flops", "memory_bandwidth", "op_overhead_s", "host_link_bandwidth", "host_adam_params_per_s"):
        d[key] = m[key]
        sources[key] = f"measured by python -m experiments.plan --calibrate on {device}, best of repeats"
    if cuda:
        d["device"], d["device_memory_bytes"] = m["device"], m["device_memory_bytes"]
        sources["device_memory_bytes"] = "torch.cuda.get_device_properties().total_memory"
        d.setdefault("node_size", torch.cuda.device_count())
    else:
        import platform

        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        d.update(
            device=f"{platform.processor() or platform.machine()} CPU, {cores} cores, gloo ranks",
            device_memory_bytes=float(mem),
            memory_shared_by_node=True,
            expert_kernel="fused",
            node_size=16,
            compute_slots=cores,
        )
        d["host_memory_bytes"] = float(mem)
        d["background_load"] = background_load(cores, 0.5 if a.quick else 2.0)
        sources["background_load"] = "other work in busy processes: cores / (a busy process's share of a core) - cores"
        sources["expert_kernel"] = "the CPU's routed-expert kernel (routing_kernels.cpu_experts)"
        sources["device_memory_bytes"] = "os.sysconf: the host's memory, shared by its ranks"
        sources["node_size"] = "every local rank is in one node (one host; gloo over loopback)"
        sources["compute_slots"] = "os.cpu_count(): ranks beyond it share cores"
    raw = None
    can_coll = not a.no_collectives and (not cuda or torch.cuda.device_count() >= 2)
    if can_coll:
        coll = measure_collectives("nccl" if cuda else "gloo")
        raw = coll["raw"]
        tiers = {"intra": dict(coll["fitted"])}
        # one machine: its only link; a profile for several nodes takes the inter tier from --base
        tiers["inter"] = (base.get("collectives") or {}).get("inter") or dict(coll["fitted"])
        d["collectives"] = tiers
        sources["collectives.intra"] = (
            f"2 local ranks, {'nccl' if cuda else 'gloo'}, least squares over {COLL_SIZES} bytes"
        )
        if "inter" not in (base.get("collectives") or {}):
            sources["collectives.inter"] = "one machine: the intra figures (no second node to measure)"
    elif "collectives" not in d:
        raise ValueError(
            "collectives cannot be measured here (one GPU, or --no-collectives) and no --base profile gives them: "
            f"pass --base <profile> (one of {zplan.available_profiles()})"
        )
    d["sources"] = sources
    profile = zplan.Profile.from_dict(d)
    out = Path(a.out) if a.out else zplan.profile.PROFILE_DIR / f"{name}.yaml"
    header = f"{name}: measured {time.strftime('%Y-%m-%d')} by python -m experiments.plan --calibrate"
    if raw:
        header += "\nraw collective timings (bytes, seconds), 2 ranks:\n" + "\n".join(
            f"  {op}: " + ", ".join(f"({s}, {t:.3g})" for s, t in pts) for op, pts in raw.items()
        )
    zplan.save_profile(profile, out, header=header)
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if "--calibrate" in argv:
            return run_calibrate(argv)
        if not argv or argv[0] in ("-h", "--help"):
            print(__doc__)
            return 0
        return run_plan(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
