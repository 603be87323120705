"""Benchmark: forward + backward of the dropless MoELayer in fp32 on this CPU.

    python -m experiments.bench.moe_layer [--shapes S1 S2] [--reps 5] [--no-phases] [--per-core]
        [--threads N] [--cpu-time] [--keep-freed-memory]

Reports, measured in the same run, the fraction of the machine's dense matmul rate the layer
reaches: (ideal expert FLOPs / layer time) / (FLOP rate of a plain 2048^3 matmul). Ideal expert
FLOPs count only the routed experts' matmuls: 3 matmuls x 2*A*D*F, times 3 for forward plus the
two backward matmuls (data and weight gradient), with A = k*T assignments (SwiGLU; GELU has 2).
Everything else the layer does (router, permutation, elementwise work, losses) is overhead that
lowers the fraction.

The machine is shared, so every layer step is preceded by its own 2048^3 matmuls (after a rest,
see ``measure_side_by_side``) and each pair gives one fraction; the table shows the medians over
``--reps`` pairs (layer time, matmul rate and fraction each the median of its own column, so
fraction need not equal their quotient).
On a GPU (``--device cuda``, bf16 by default) there is no single "machine rate" to divide by, so
the layer is timed side by side with a dense SwiGLU FFN of the same matmul FLOPs (D -> k*F -> D on
the same T tokens), forward + backward: ``dense/layer`` is the dense time over the layer's (1.0: the
sparse layer costs what its FLOPs cost densely). ``--grouped-mm`` also times the expert computation
as one ``torch._grouped_mm`` per weight (where this torch has it) against the per-expert loop, after
checking that both give the same numbers (the layer itself uses ``_grouped_mm`` in bf16 on sm_90).
``--compile`` adds the same pair compiled (``torch.compile`` of the layer and of the dense FFN,
Inductor): ``dense/layer`` of the compiled pair compares like with like. The training step's MFU
is ``experiments.bench.mfu``.

Shapes follow the project's legend (docs/design.md).
"""

from __future__ import annotations

import argparse
import ctypes
import resource
import statistics
import time

import torch

import routing_kernels as rk
from experiments.bench.layers import GPU_SHAPES, SHAPES, layer_step, make_layer
from experiments.bench.timing import cuda_event_median, median_time
from moe import MoEConfig, MoELayer
from moe.experts import DenseFFN

# wall-clock by default; --cpu-time switches to process CPU time, which on one thread leaves out the
# time other jobs on a shared machine hold the core (with two threads it would count OpenMP spinning)
_clock = time.perf_counter


def _median_time(fn, reps: int, warmup: int = 1) -> float:
    return median_time(fn, reps, warmup, clock=_clock)  # _clock read now: --cpu-time sets it after import


def measure_side_by_side(
    layer, x_TD, grad_TD, flops: float, reps: int, n: int = 2048, rest: float = 2.0, per_core: bool = False
):
    """Alternate three n^3 matmuls with one layer step, ``reps`` times; each pair gives one
    fraction, so a neighbour's load that slows both for a while cancels in the ratio. Returns the
    medians of layer time, matmul rate, fraction, and the fraction against the per-core rate.

    Each pair starts after ``rest`` seconds idle, matmuls first: on the shared machine a matmul run
    within ~1 s after a step that kept both cores busy measured up to 10% slower (a throttle that
    fades within 2 s), which would flatter the layer. Rested, the matmul rate is the machine's best.

    The fraction divides by the rate of the n^3 matmul on every intra-op thread, as the goal is
    defined. The layer's lanes run one thread each and no barrier between them, so with
    ``per_core`` each pair also times the matmul on one thread, first (the layer then follows the
    all-thread matmuls, as without): the per-core fraction divides by threads x that rate, the sum
    of what the cores reach alone, a bound a multi-threaded matmul does not reach when one vCPU
    lags (None without ``per_core``). Opt-in, since it changes what precedes the layer."""
    threads = torch.get_num_threads()
    a, b = torch.randn(n, n), torch.randn(n, n)
    c = torch.empty(n, n)
    layer_step(layer, x_TD, grad_TD)
    torch.mm(a, b, out=c)
    times, rates, fracs, cores, core_fracs = [], [], [], [], []
    for _ in range(reps):
        time.sleep(rest)
        if per_core:  # one thread first, so the layer follows the all-thread matmuls
            torch.set_num_threads(1)
            t0 = _clock()
            torch.mm(a, b, out=c)
            t_one = _clock() - t0
            torch.set_num_threads(threads)
            cores.append(threads * 2 * n**3 / t_one)
        mm = []
        for _ in range(3):
            t0 = _clock()
            torch.mm(a, b, out=c)
            mm.append(_clock() - t0)
        t0 = _clock()
        layer_step(layer, x_TD, grad_TD)
        t_layer = _clock() - t0
        rate = 2 * n**3 / statistics.median(mm)
        times.append(t_layer)
        rates.append(rate)
        fracs.append(flops / t_layer / rate)
        if per_core:
            core_fracs.append(flops / t_layer / cores[-1])
    return (
        statistics.median(times),
        statistics.median(rates),
        statistics.median(fracs),
        statistics.median(core_fracs) if per_core else None,
    )


def ideal_expert_flops(T: int, D: int, F: int, K: int, matmuls: int = 3) -> float:
    A = K * T
    return matmuls * 2 * A * D * F * 3


def page_faults(fn) -> int:
    """Minor page faults of one call: each is a fresh 4 KB page touched for the first time, a cost
    the timings hide in whichever op writes first. Deterministic, unlike the timings here."""
    fn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def phase_times(layer: MoELayer, x_TD: torch.Tensor, grad_TD: torch.Tensor, reps: int) -> dict:
    """Seconds per phase, each timed on its own with the layer's own components.

    Forward: ``router`` (scores, top-k, weights), ``metadata`` (counts, destination rows, the one
    ``tolist``), then the three steps as separate ops, as CUDA and expert parallelism run them
    (``permute``, ``experts``, ``unpermute``), and ``tokens_fwd``, the experts in tokens mode (the
    one pass the CPU layer runs instead). ``forward`` and ``backward`` are the whole layer's;
    ``tokens_bwd`` is the backward of tokens mode alone (routed experts, their gather and weighted
    scatter), so ``backward - tokens_bwd`` is the router, losses and the rest.
    """
    experts = layer.experts
    ph = {}
    with torch.no_grad():
        routing = layer.router(x_TD)
        ids_TK, w_TK = routing.expert_ids_TK, routing.weights_TK
        ph["router"] = _median_time(lambda: layer.router(x_TD), reps)
        ph["metadata"] = _median_time(lambda: rk.routing_metadata(ids_TK, experts.num_local)[0].tolist(), reps)
        counts_E, _, dest_TK = rk.routing_metadata(ids_TK, experts.num_local)
        counts = counts_E.tolist()
        S = sum(counts)
        ph["permute"] = _median_time(lambda: rk.permute(x_TD, dest_TK, S), reps)
        x_SD = rk.permute(x_TD, dest_TK, S)
        ph["experts"] = _median_time(lambda: experts(x_SD, counts), reps)
        y_SD = experts(x_SD, counts)
        ph["unpermute"] = _median_time(lambda: rk.unpermute_combine(y_SD, dest_TK, w_TK), reps)
        ph["tokens_fwd"] = _median_time(lambda: experts(x_TD, counts, dest_TK=dest_TK, weights_TK=w_TK), reps)

    w_req = w_TK.detach().requires_grad_(True)

    def tokens_fwd_bwd():
        out = experts(x_TD, counts, dest_TK=dest_TK, weights_TK=w_req)
        t0 = _clock()
        torch.autograd.grad(out, [x_TD, w_req, *experts.parameters()], grad_TD)
        return _clock() - t0

    tokens_fwd_bwd()
    ph["tokens_bwd"] = statistics.median(tokens_fwd_bwd() for _ in range(reps))

    def layer_fwd_bwd():
        for p in layer.parameters():
            p.grad = None
        t0 = _clock()
        out = layer(x_TD)
        t1 = _clock()
        out.backward(grad_TD)
        return t1 - t0, _clock() - t1

    layer_fwd_bwd()
    fwd, bwd = zip(*(layer_fwd_bwd() for _ in range(reps)))
    ph["forward"], ph["backward"] = statistics.median(fwd), statistics.median(bwd)
    return ph


def keep_freed_memory() -> None:
    """Make glibc keep freed memory for reuse instead of returning it to the OS.

    By default glibc serves each allocation above its mmap threshold (at most 32 MB) with fresh
    pages, and the first touch of every 4 KB page faults: the layer's saved [S, F] activations
    (64 MB each at S1) pay that on every step. Caching allocators (jemalloc, tcmalloc, which
    PyTorch's CPU tuning guide recommends) avoid it; so does turning off mmap for large blocks.
    Process-wide, so only the benchmark does it, and only when asked.
    """
    libc = ctypes.CDLL("libc.so.6")
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)):
        raise RuntimeError("mallopt refused the settings")


# --- GPU: the layer against a dense FFN of the same FLOPs ----------------------------------------


def _grouped_mm_probe(T, D, F, E, K, dtype, reps):
    """The routed experts alone (SwiGLU, forward + backward) as ``torch._grouped_mm`` and as the
    per-expert loop (expert backends ``grouped_mm`` and ``loop``) on the same rows: the largest
    difference relative to each tensor's largest entry, and both times."""
    if not hasattr(torch, "_grouped_mm"):
        return "torch has no _grouped_mm"
    from moe.experts import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(E, D, F).cuda().to(dtype)
    counts = torch.bincount(torch.randint(0, E, (K * T,), device="cuda"), minlength=E).tolist()
    x = torch.randn(K * T, D, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(K * T, D, device="cuda", dtype=dtype)
    params = list(experts.parameters())

    def run(grouped: bool):
        with rk.use_expert_backend("grouped_mm" if grouped else "loop"):
            y = experts(x, counts)
            return y, torch.autograd.grad(y, [x, *params], g)

    try:
        ya, ga = run(False)
        yb, gb = run(True)
    except Exception as exc:  # report, do not fail the benchmark: this is a probe
        return f"_grouped_mm failed: {type(exc).__name__}: {str(exc)[:200]}"
    err = max(
        ((a.float() - b.float()).abs().max() / a.float().abs().max().clamp_min(1e-30)).item()
        for a, b in zip((ya, *ga), (yb, *gb))
    )
    t_loop, t_grouped = cuda_event_median(lambda: run(False), reps), cuda_event_median(lambda: run(True), reps)
    return (
        f"max rel diff {err:.2e}; per-expert loop {t_loop * 1e3:.2f} ms, _grouped_mm {t_grouped * 1e3:.2f} ms "
        f"({t_loop / t_grouped:.2f}x)"
    )


def gpu_main(args) -> None:
    dtype = getattr(torch, args.dtype)
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {args.dtype}, median of {args.reps}")
    rows = []
    for name in args.shapes:
        T, D, F, E, K = GPU_SHAPES[name]
        torch.manual_seed(0)
        layer = MoELayer(MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K)).cuda().to(dtype)
        dense = DenseFFN(D, K * F).cuda().to(dtype)
        x = torch.randn(T, D, device="cuda", dtype=dtype, requires_grad=True)
        g = torch.randn(T, D, device="cuda", dtype=dtype)
        times = {
            "layer": cuda_event_median(lambda: layer_step(layer, x, g), args.reps),
            "dense": cuda_event_median(lambda: layer_step(dense, x, g), args.reps),
        }
        if args.compile:
            # the same modules compiled (Inductor); a warm-up call inside cuda_event_median compiles
            for key, module in (("layer_c", layer), ("dense_c", dense)):
                compiled = torch.compile(module)
                times[key] = cuda_event_median(lambda: layer_step(compiled, x, g), args.reps)
        flops = ideal_expert_flops(T, D, F, K)
        probe = _grouped_mm_probe(T, D, F, E, K, dtype, args.reps) if args.grouped_mm else ""
        rows.append((name, T, D, F, E, K, times, flops, probe))
        layer = dense = x = g = None  # freed (not del: the timed closures name them)
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    print()
    compiled_head = " compiled layer (ms) | compiled dense (ms) | compiled dense/layer |" if args.compile else ""
    print(
        "| shape | T | D | F | E | k | layer fwd+bwd (ms) | dense FFN, same FLOPs (ms) | dense/layer | layer TFLOP/s |"
        + compiled_head
    )
    print("| --- " * (10 + 3 * args.compile) + "|")
    for name, T, D, F, E, K, tm, flops, _ in rows:
        line = (
            f"| {name} | {T} | {D} | {F} | {E} | {K} | {tm['layer'] * 1e3:.2f} | {tm['dense'] * 1e3:.2f} "
            f"| {tm['dense'] / tm['layer']:.2f} | {flops / tm['layer'] / 1e12:.0f} |"
        )
        if args.compile:
            line += f" {tm['layer_c'] * 1e3:.2f} | {tm['dense_c'] * 1e3:.2f} | {tm['dense_c'] / tm['layer_c']:.2f} |"
        print(line)
    if args.grouped_mm:
        print("\nrouted experts alone, forward + backward, per-expert loop vs torch._grouped_mm:")
        for name, *_, probe in rows:
            print(f"  {name}: {probe}")


# --- a training step's model-FLOPs utilisation ---------------------------------------------------


# model=base (conf/model/base.yaml) with moe=mixtral (conf/moe/mixtral.yaml) and data=tokens'
# vocabulary, as plain values: the GPU box has no hydra (tests/experiments/test_bench.py checks they match)
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--shapes", nargs="+", default=None, choices=list(GPU_SHAPES), help="default: S1 S2 (CPU), all (GPU)"
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"], help="default: float32 (CPU), bfloat16 (GPU)"
    )
    ap.add_argument("--grouped-mm", action="store_true", help="GPU: also probe torch._grouped_mm for the experts")
    ap.add_argument("--compile", action="store_true", help="GPU: also time the torch.compile'd layer")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-phases", action="store_true", help="skip the per-phase breakdown")
    ap.add_argument(
        "--per-core",
        action="store_true",
        help="also time the 2048^3 matmul on one thread in each pair (see measure_side_by_side)",
    )
    ap.add_argument(
        "--rest",
        type=float,
        default=2.0,
        help="seconds idle before each matmul + layer pair (see measure_side_by_side)",
    )
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's choice)")
    ap.add_argument(
        "--cpu-time", action="store_true", help="time in process CPU time; use with --threads 1 on a busy machine"
    )
    ap.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="glibc: no mmap for large blocks, no trimming (see keep_freed_memory)",
    )
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible")
    if args.device == "cuda":
        args.shapes = args.shapes or list(GPU_SHAPES)
        args.dtype = args.dtype or "bfloat16"
        gpu_main(args)
        return
    args.shapes = args.shapes or list(SHAPES)
    if any(s not in SHAPES for s in args.shapes) or args.dtype not in (None, "float32"):
        ap.error(f"the CPU benchmark runs fp32 at shapes {list(SHAPES)}")
    if args.keep_freed_memory:
        keep_freed_memory()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        if torch.get_num_threads() != 1:
            ap.error("--cpu-time needs --threads 1: with more threads, CPU time counts OpenMP spinning")
        global _clock
        _clock = time.process_time

    torch.set_grad_enabled(True)
    malloc = "glibc, freed memory kept" if args.keep_freed_memory else "glibc defaults"
    clock = "process CPU time" if args.cpu_time else "wall clock"
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, {clock}, median of {args.reps}, "
        f"malloc: {malloc}"
    )
    rows = []
    # the headline figures first, every shape back to back; the slower breakdown afterwards
    for name in args.shapes:
        T, D, F, E, K = SHAPES[name]
        layer, x_TD, grad_TD = make_layer(T, D, F, E, K)
        flops = ideal_expert_flops(T, D, F, K)
        t_layer, rate, frac, per_core = measure_side_by_side(
            layer, x_TD, grad_TD, flops, args.reps, rest=args.rest, per_core=args.per_core
        )
        faults = page_faults(lambda: layer_step(layer, x_TD, grad_TD))
        rows.append((name, T, D, F, E, K, t_layer, flops / t_layer / 1e9, rate / 1e9, frac, per_core, faults))
        del layer, x_TD, grad_TD
    for name in [] if args.no_phases else args.shapes:
        layer, x_TD, grad_TD = make_layer(*SHAPES[name])
        ph = phase_times(layer, x_TD, grad_TD, args.reps)
        print(f"{name} phases (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in ph.items()))

    print()
    print(
        "| shape | T | D | F | E | k | layer fwd+bwd (s) | expert GFLOP/s | 2048^3 matmul GFLOP/s | fraction "
        "| per-core fraction | page faults/step |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, T, D, F, E, K, t, gf, mr, frac, per_core, faults in rows:
        core = "-" if per_core is None else f"{per_core:.2f}"
        print(
            f"| {name} | {T} | {D} | {F} | {E} | {K} | {t:.3f} | {gf:.1f} | {mr:.1f} | {frac:.2f} | {core} | {faults} |"
        )


if __name__ == "__main__":
    main()
