"""``python -m experiments.plan --calibrate``: measure the machine this runs on and write a
profile (``zero.plan.Profile``) under ``conf/cluster/``: matmul FLOP/s by size, causal attention's
FLOP/s and backward-to-forward ratio by sequence length and head dim, a large copy's
bandwidth, the fixed cost of one operator, the host optimizer's rate, other work's load on a shared
host, and each collective by message size on 2 local ranks (gloo on a CPU, timed between ranks
that compute before each call: ``measure_collectives``; NCCL on 2+ GPUs; α, β by least squares).
A shared CPU's speed moves from minute to minute: each figure is the median of ``--repeats`` whole
measurements (3 on a CPU, 1 on a GPU). ``experiments.plan`` (the planner's CLI) dispatches
``--calibrate`` here.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import statistics
import sys
import time
from pathlib import Path

import zero.plan as zplan


def _times(fn, repeats: int, sync=lambda: None) -> list[float]:
    """``repeats`` timed calls after one warm-up, least first."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return sorted(times)


def _time(fn, repeats: int, sync=lambda: None, best: bool = False) -> float:
    """The median (or ``best``: the least) of ``repeats`` timed calls after one warm-up."""
    times = _times(fn, repeats, sync)
    return times[0] if best else times[len(times) // 2]


_VIEWS = {"view", "as_strided", "slice", "select", "t", "transpose", "expand", "unsqueeze", "squeeze", "detach"}


def _dispatched(fn, traffic: bool = False):
    """Operators ``fn`` dispatches (views included), counted as moe.costs counts a block's; with
    ``traffic`` also (operators, bytes the non-view ones read and write: their inputs and outputs)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Count(TorchDispatchMode):
        n = nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Count.n += 1
            if func._schema.name.split("::")[1] not in _VIEWS:
                for t in tree_flatten((args, kwargs, out))[0]:
                    if isinstance(t, torch.Tensor):
                        Count.nbytes += t.numel() * t.element_size()
            return out

    with Count():
        fn()
    return (Count.n, Count.nbytes) if traffic else Count.n


# rows of the elementwise mixes' tensors: a CPU's rate falls as they outgrow its caches, so it is
# measured across the micro-batches CPU models run; a GPU's holds at its bandwidth from a few MB on
ELEMENTWISE_ROWS_CPU = (256, 1024, 4096, 16384)
ELEMENTWISE_ROWS_GPU = (16384,)


def _norm_rotary_residual(x, y, g, dtype):
    # an RMSNorm in fp32 with its gain, a rotary pair of products and their concatenation, a residual addition
    import torch

    x32 = x.float()
    h = (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + 1e-6)).to(dtype) * g
    return torch.cat([h * y, x * y], dim=-1), h + x


def _swiglu_passes(h1, h3, g, dtype):
    # the FFN activation's forward (silu(h1) * h3) and backward as the kernels run it: the
    # activation recomputed, the product's two gradients, silu's gradient (aten's fused backward)
    import torch
    import torch.nn.functional as nnf

    s = nnf.silu(h1)
    act = s * h3
    return act, torch.ops.aten.silu_backward(g * h3, h1), g * s


def measure_elementwise(device, sync, best: bool, op_overhead_s: float, quick: bool = False) -> dict:
    """``{"elementwise_bandwidth": [[rows, bytes/s], ...], "activation_bandwidth": [...]}``: the
    rates of a block's non-matmul operators, counted as ``moe.costs`` counts them (each operator's
    inputs read and its output written), less their fixed cost (``op_overhead_s``, which the planner
    counts apart), on tensors of ``rows`` rows at a model's widths (the CPU: fp32, 64 and 256 wide,
    the models a CPU trains, at 256 to 16,384 rows; a GPU: bf16, 16,384 rows of 1,024, 4,096 and
    16,384). Two mixes: an RMSNorm with its gain, a rotary pair of products and their
    concatenation, a residual addition (the elementwise rate); and the SwiGLU activation's forward
    and backward (the activation rate: a CPU computes silu's exponential at a fixed ~2.7 G values/s
    a core, well under its other operators' rate, while a GPU runs both near its bandwidth). On a
    CPU each call takes the next of enough operand sets to overflow its caches (64 MiB), as a
    training step's layers find theirs evicted by the layers between, and the rate falls with the
    rows as the intermediates outgrow the caches too (one core of a 2-core machine: the first mix
    at 39 GB/s at 256 rows, 23 at 4,096, 9 at 16,384, against a 17 GB/s copy of 128 MiB)."""
    import torch

    cuda = str(device).startswith("cuda")
    if cuda:
        all_rows, widths, dtype = ELEMENTWISE_ROWS_GPU, (1024, 4096, 16384), torch.bfloat16
    else:
        all_rows, widths, dtype = ELEMENTWISE_ROWS_CPU, (64, 256), torch.float32
    if quick:
        all_rows = all_rows[::2]
    out = {"elementwise_bandwidth": [], "activation_bandwidth": []}
    for key, mix in (("elementwise_bandwidth", _norm_rotary_residual), ("activation_bandwidth", _swiglu_passes)):
        for rows in all_rows:
            nbytes = seconds = 0.0
            for w in widths:
                per_set = 2 * rows * w * dtype.itemsize
                sets = 1 if cuda else max(1, min(64, (64 << 20) // per_set))
                # the norm's gain is one row; the activation's third operand its output's gradient
                third = (w,) if mix is _norm_rotary_residual else (rows, w)
                operands = [
                    (
                        torch.randn(rows, w, device=device, dtype=dtype),
                        torch.randn(rows, w, device=device, dtype=dtype),
                        torch.randn(*third, device=device, dtype=dtype),
                    )
                    for _ in range(sets)
                ]
                turn = itertools.cycle(operands)

                def call(mix=mix, turn=turn):
                    return mix(*next(turn), dtype)

                ops, b = _dispatched(call, traffic=True)
                reps = max(3, min(20, int(2e8 / (rows * w * 64))))
                t = _time(call, reps, sync, best=best)
                nbytes += b
                seconds += max(t - ops * op_overhead_s, 0.1 * t)
            out[key].append([float(rows), nbytes / seconds])
    return out


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


def measure_device(device: str, quick: bool = False, best: bool = True) -> dict:
    """The rates of this device. Each timing is the best of its repeats (``best``; else their
    median): the rate of the device itself, the share other work takes being ``background_load``
    (measured apart)."""
    import torch

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out: dict = {"matmul_flops": {}, "attention_flops": {}}
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
                    # a CPU's products in a training step find their operands out of cache (the
                    # layers before evicted them): each call takes the next of enough operand pairs
                    # to overflow it (64 MiB); a GPU's are bound by compute, not by its cache
                    sets = 1 if cuda else max(1, min(64, (64 << 20) // ((m * k + k * n) * dtype.itemsize)))
                    pairs = [
                        (torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype))
                        for _ in range(sets)
                    ]
                    flops = 2 * m * k * n
                    reps = 10 if cuda else max(2, min(20, int(2e8 / flops)))
                    turn = itertools.cycle(pairs)
                    t = _time(lambda: torch.mm(*next(turn)), reps, sync, best=best)
                    rows.append([m, k, n, flops / t])
        out["matmul_flops"][name] = rows
        out["attention_flops"][name] = measure_attention(device, dtype, quick, sync, best)
    n = (1 << 28) if cuda else (1 << 24 if quick else 1 << 25)  # 1 GiB / 64-128 MiB of fp32
    src = torch.empty(n, device=device)
    dst = torch.empty_like(src)
    out["memory_bandwidth"] = 2 * n * 4 / _time(lambda: dst.copy_(src), 10, sync, best=best)  # read and write
    # one dispatched operator's fixed cost: a chain of tiny ops, forward and backward (what the
    # elementwise mixes' timings are net of: each of their operators is one such call)
    x = torch.ones(8, device=device, requires_grad=True)

    def chain():
        y = x
        for _ in range(100):
            y = y * 1.0001
        y.sum().backward()

    chain_s = _time(chain, 10, sync, best=best) / _dispatched(chain)
    out.update(measure_elementwise(device, sync, best, chain_s, quick))
    out.update(measure_op_overhead(device, sync, best))
    if not cuda:
        out.update(measure_forward_elementwise(device, out, best, quick))
        out.update(measure_split_backward(device, best, quick))
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
        out["host_link_bandwidth"] = src.numel() * 4 / _time(lambda: dst.copy_(src), 10, best=best)
    p = torch.zeros(1 << 21, requires_grad=True)  # the host optimizer (ZeRO-Offload) on 2M parameters
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-3, foreach=True)
    out["host_adam_params_per_s"] = p.numel() / _time(opt.step, 5, best=best)
    return out


def _reference_model(device):
    """A tiny model of this code (``moe.model.Transformer``: 2 MoE blocks of 4 experts, top-2,
    widths of 16) and a batch of one 8-token sequence: a forward and backward whose time is its
    operators' fixed cost, the bytes and products being negligible."""
    import torch

    from moe import MoEConfig
    from moe.model import Transformer, TransformerConfig

    moe_cfg = MoEConfig(d_model=16, d_ff=16, num_experts=4, top_k=2)
    cfg = TransformerConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, d_ff=16, max_seq_len=8, moe=moe_cfg)
    torch.manual_seed(0)
    return Transformer(cfg).to(device), torch.randint(0, 32, (1, 8), device=device)


def _reference_block_config():
    """The MoE block ``measure_forward_elementwise`` times: width 96, 6 heads of 16, 4 experts of
    192, top-2, sequences of 128 (a shape of no shipped model: the planner's check on
    ``model=small`` stays a check)."""
    from moe import MoEConfig
    from moe.model import TransformerConfig

    moe_cfg = MoEConfig(d_model=96, d_ff=192, num_experts=4, top_k=2)
    return TransformerConfig(vocab_size=256, d_model=96, n_layers=1, n_heads=6, d_ff=192, max_seq_len=128, moe=moe_cfg)


def _rates_profile(rates: dict, device: str) -> zplan.Profile:
    """A profile of the rates measured so far (``measure_device``'s), the forward's other
    operators free: what a block's forward costs beyond them."""
    free = zplan.AlphaBeta(0.0, math.inf)
    return zplan.Profile(
        name="calibrating",
        device=device,
        device_memory_bytes=math.inf,
        node_size=1,
        matmul_flops=rates["matmul_flops"],
        attention_flops=rates["attention_flops"],
        memory_bandwidth=rates["memory_bandwidth"],
        collectives={t: {op: free for op in zplan.profile.COLLECTIVES} for t in zplan.profile.TIERS},
        op_overhead_s=rates["op_overhead_s"],
        backward_op_overhead_s=rates["backward_op_overhead_s"],
        elementwise_bandwidth=rates["elementwise_bandwidth"],
        activation_bandwidth=rates["activation_bandwidth"],
        forward_elementwise_bandwidth=math.inf,
        expert_kernel="grouped" if str(device).startswith("cuda") else "fused",
    )


def forward_rest_rate(block, tokens: int, measured_s: float, profile: zplan.Profile) -> float:
    """The bytes/s of ``block``'s (a ``BlockCost``) forward operators other than its products,
    attention kernel and activation, whose forward over ``tokens`` tokens took ``measured_s``: what
    the planner's forward on ``profile`` (those operators free) leaves of it, per byte they move
    (``moe.costs``' count). At most 10x the rate the time itself would give (a remainder under a
    tenth of the time is noise about a term the planner over-counts)."""
    from zero.plan.terms import _Costing

    costs = zplan.ModelCosts(blocks=(block,), seq_len=tokens)  # one sequence of all the tokens
    counted = _Costing(zplan.LayoutRecord(world=1, batch_size=1), costs, profile, None).compute(block)["F"]
    rest = (block.elementwise_bytes - block.activation_bytes) * tokens
    return rest / max(measured_s - counted, 0.1 * measured_s)


def measure_forward_elementwise(device, rates: dict, best: bool, quick: bool = False) -> dict:
    """``{"forward_elementwise_bandwidth": [[rows, bytes/s], ...]}``: the forward's non-matmul
    operators other than the activation, as a real block runs them. The reference MoE block
    (``_reference_block_config``) is timed forward (each forward then run backward, untimed, as
    training does) at the elementwise mixes' rows, and what its products, attention kernel,
    activation and operators' fixed cost leave of the time at the ``rates`` measured just before
    (``_rates_profile``) is divided into the bytes its other operators move (``forward_rest_rate``).
    The mixes time those operators alone; a block's forward also runs the router's softmax, top-k,
    logsumexp and sorts over rows of a few experts (150-600 ns a row on a CPU, whatever their
    bytes), the expert kernel's bookkeeping per block of rows and the rotary's strided views: the
    planner's forward came out 13-27% low without them (docs/design.md). The backward's remainder is
    a tenth of its time, too small to measure this way: it keeps the mixes' rate."""
    import torch

    from moe.costs import model_costs
    from moe.model import Transformer

    cfg = _reference_block_config()
    profile = _rates_profile(rates, device)
    block_cost = model_costs(cfg, cfg.max_seq_len, experts=profile.expert_kernel).blocks[1]
    torch.manual_seed(0)
    model = Transformer(cfg).to(device)
    block = model.blocks[0]
    L = cfg.max_seq_len
    cos, sin = model.rope_cos[:L], model.rope_sin[:L]
    table = []
    for rows in ELEMENTWISE_ROWS_CPU[::2] if quick else ELEMENTWISE_ROWS_CPU:
        x = torch.randn(rows // L, L, cfg.d_model, device=device, requires_grad=True)
        grad = torch.randn_like(x)
        times = []
        for _ in range(7 if rows <= 4096 else 5):
            t = time.perf_counter()
            y = block(x, cos, sin)
            times.append(time.perf_counter() - t)
            y.backward(grad)
        times = sorted(times[2:])  # two warm-ups: the kernel's pool, the autograd engine
        t = times[0] if best else statistics.median(times)
        table.append([float(rows), forward_rest_rate(block_cost, rows, t, profile)])
    return {"forward_elementwise_bandwidth": table}


def time_split_backward(blocks, h0, grad, cos, sin, repeats: int) -> tuple[list, list, list]:
    """Seconds of ``repeats`` backwards of ``blocks`` (run in order on ``h0``) each way, through
    torch.distributed.pipelining's own functions: ``(whole, input pass, weight pass)``, one
    ``stage_backward``, then after another forward ``stage_backward_input`` and
    ``stage_backward_weight``."""
    import torch
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

    params = list(torch.nn.ModuleList(blocks).parameters())

    def forward():
        x = h0.clone().requires_grad_()
        y = x
        for b in blocks:
            y = b(y, cos, sin)
        return x, y

    whole, inputs, weights = [], [], []
    for _ in range(repeats):
        x, y = forward()
        t = time.perf_counter()
        stage_backward(y, grad, [x])
        whole.append(time.perf_counter() - t)
        x, y = forward()
        t = time.perf_counter()
        _, groups = stage_backward_input([y], [grad], [x], iter(params))
        t1 = time.perf_counter()
        stage_backward_weight(iter(params), groups)
        inputs.append(t1 - t)
        weights.append(time.perf_counter() - t1)
        for p in params:
            p.grad = None
    return whole, inputs, weights


def measure_split_backward(device, best: bool, quick: bool = False) -> dict:
    """``{"split_input_share": [[rows, share], ...], "split_weight_share": [...]}``: the
    zero-bubble schedules' split backward against a whole one. Two reference MoE blocks
    (``_reference_block_config``) at the elementwise mixes' rows are run backward by
    torch.distributed.pipelining's own ``stage_backward`` and, after another forward, by its
    ``stage_backward_input`` then ``stage_backward_weight``; each pass's time over the whole's. The
    weight pass walks the graph a second time, so the two add to more than the whole (1.5-1.7x on
    a 2-core CPU at 512 tokens, falling as the products grow: docs/design.md)."""
    import dataclasses

    import torch

    from moe.model import Transformer

    cfg = dataclasses.replace(_reference_block_config(), n_layers=2)
    torch.manual_seed(0)
    model = Transformer(cfg).to(device)
    blocks = list(model.blocks)
    L = cfg.max_seq_len
    cos, sin = model.rope_cos[:L], model.rope_sin[:L]
    pick = min if best else statistics.median
    inputs, weights = [], []
    for rows in ELEMENTWISE_ROWS_CPU[::2] if quick else ELEMENTWISE_ROWS_CPU:
        h0 = torch.randn(rows // L, L, cfg.d_model, device=device)
        grad = torch.randn_like(h0)
        whole, inp, wt = time_split_backward(blocks, h0, grad, cos, sin, 7 if rows <= 4096 else 5)
        w = pick(whole[2:])  # two warm-ups: the kernel's pool, the autograd engine
        inputs.append([float(rows), pick(inp[2:]) / w])
        weights.append([float(rows), pick(wt[2:]) / w])
    return {"split_input_share": inputs, "split_weight_share": weights}


def measure_op_overhead(device, sync, best: bool) -> dict:
    """``op_overhead_s`` and ``backward_op_overhead_s``: one operator's fixed cost in the forward,
    and in the backward per forward operator over the planner's 1.7 backward operators for each,
    as this code dispatches them: the reference model's forward and backward at a tiny input
    (``_reference_model``), each over the forward's operators (views included, as ``moe.costs``
    counts them). More than a chain of bare products costs: the modules' Python, the saved tensors
    and the autograd nodes of real layers, the router's bookkeeping (measured on a 2-core CPU: 4.0
    us a forward operator, 2.0 a backward one, against 2.8 for the chain's)."""
    import torch.nn.functional as nnf

    model, x = _reference_model(device)

    def forward():
        return nnf.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())

    ops = _dispatched(forward)
    for _ in range(3):  # warm: the kernels' pools and the autograd engine
        forward().backward()
    f_times, b_times = [], []
    for _ in range(15):
        sync()
        t0 = time.perf_counter()
        loss = forward()
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        f_times.append(t1 - t0)
        b_times.append(time.perf_counter() - t1)
    pick = min if best else statistics.median
    return {"op_overhead_s": pick(f_times) / ops, "backward_op_overhead_s": pick(b_times) / (1.7 * ops)}


def measure_attention(device, dtype, quick: bool = False, sync=lambda: None, best: bool = True) -> list:
    """Causal SDPA, the model's attention kernel (``moe.attention.attend``), by sequence length L
    and head dim J: ``[[L, J, flop_s, backward_ratio], ...]``, the forward's FLOP/s counted as
    ``moe.costs`` counts attention (scores and weighted values, 2 L^2 J each, at half: causal) and
    the backward's time over the forward's (dQ, dK, dV and the recomputed scores)."""
    import torch
    import torch.nn.functional as nnf

    cuda = str(device).startswith("cuda")
    Ls = [512, 2048, 8192] if cuda else [64, 128, 512]
    Js = [64, 128, 192] if cuda else [16, 64, 128]
    if quick:
        Ls, Js = Ls[:2], Js[:2]
    rows = []
    for L in Ls:
        for J in Js:
            BH = max(8, (1 << 17) // L) if cuda else max(4, 4096 // L)  # batch x heads
            q, k, v = (torch.randn(BH, 1, L, J, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
            grad = torch.randn(BH, 1, L, J, device=device, dtype=dtype)
            flops = 2 * (2 * L * L * J) * 0.5 * BH
            reps = 10 if cuda else max(3, min(10, int(1e8 / flops)))

            def fwd():
                with torch.no_grad():
                    nnf.scaled_dot_product_attention(q, k, v, is_causal=True)

            def fwd_bwd():
                nnf.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

            t_f = _time(fwd, reps, sync, best=best)
            t_fb = _time(fwd_bwd, reps, sync, best=best)
            rows.append([L, J, flops / t_f, max(t_fb - t_f, 1e-9) / t_f])
    return rows


# the device's scalar rates measure_device returns (a profile's fields of the same names)
_RATES = (
    "memory_bandwidth",
    "elementwise_bandwidth",
    "activation_bandwidth",
    "forward_elementwise_bandwidth",  # a CPU's only
    "split_input_share",  # a CPU's only
    "split_weight_share",
    "op_overhead_s",
    "backward_op_overhead_s",
    "host_link_bandwidth",
    "host_adam_params_per_s",
)


def _busy_worker(rank: int, quick: bool, barrier, q) -> None:
    import torch

    torch.set_num_threads(1)
    barrier.wait()
    q.put((rank, measure_device("cpu", quick=quick, best=False)))


def measure_cpu_busy(cores: int, quick: bool = False) -> dict:
    """The CPU's rates as one of ``cores`` ranks sees them while every core computes: one
    single-thread ``measure_device`` per core, all started at once, each timing the median of its
    repeats; per rate the mean over the processes. A rank of a training run shares the caches, the
    memory bandwidth and the clock with the others, and runs at its typical speed, not its best."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(cores), ctx.Queue()
    procs = [ctx.Process(target=_busy_worker, args=(r, quick, barrier, q)) for r in range(cores)]
    for pr in procs:
        pr.start()
    got = [q.get() for _ in procs]
    for pr in procs:
        pr.join()
    runs = [m for _, m in sorted(got, key=lambda x: x[0])]
    out = {"matmul_flops": {}, "attention_flops": {}}
    for dtype, rows in runs[0]["matmul_flops"].items():
        out["matmul_flops"][dtype] = [
            [*row[:3], sum(r["matmul_flops"][dtype][i][3] for r in runs) / len(runs)] for i, row in enumerate(rows)
        ]
    for dtype, rows in runs[0]["attention_flops"].items():
        out["attention_flops"][dtype] = [
            [*row[:2], *(sum(r["attention_flops"][dtype][i][j] for r in runs) / len(runs) for j in (2, 3))]
            for i, row in enumerate(rows)
        ]
    for key in (k for k in _RATES if k in runs[0]):
        if isinstance(runs[0][key], list):  # a table [[x, rate], ...]: the rates' mean per row
            out[key] = [[row[0], sum(r[key][i][1] for r in runs) / len(runs)] for i, row in enumerate(runs[0][key])]
        else:
            out[key] = sum(r[key] for r in runs) / len(runs)
    return out


COLL_SIZES = [1 << 12, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24]


def _coll_worker(rank: int, world: int, port: int, backend: str, sizes, busy: bool, q) -> None:
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
    idle = {op: [] for op in zplan.profile.COLLECTIVES}
    compute = _busy_segment(BUSY_SEGMENT_S) if busy else None
    beside = {op: [] for op in BESIDE_OPS}

    def pingpong(t):  # ranks 0 and 1 (the others wait at the next barrier); half of it counts: there and back
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            dist.send(t, 0)

    for nbytes in sizes:
        n = nbytes // 4 // world * world  # whole shards for reduce-scatter and all-gather
        full = torch.ones(n, device=device)
        part = torch.ones(n // world, device=device)
        ops = {
            "all_reduce": lambda async_op=False: dist.all_reduce(full, async_op=async_op),
            "reduce_scatter": lambda async_op=False: reduce_scatter_into(part, full, None, async_op=async_op),
            "all_gather": lambda async_op=False: all_gather_into(full, part, None, async_op=async_op),
            "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(full), full),
            "p2p": lambda: pingpong(full),
        }
        for op, fn in ops.items():
            # back to back: each call waits for its peer, so a batch's mean is one call's time
            reps = 20 if nbytes <= (1 << 20) else 5

            def batch(fn=fn, reps=reps, work=None):
                dist.barrier()
                for _ in range(reps):
                    if work is not None:
                        work()
                    fn()

            def per_call(work=None):
                # a batch less one without the collective (the barrier, and the work if any)
                nothing = lambda: None  # noqa: E731
                t_with = _times(lambda: batch(work=work), 5, sync)
                t_without = _times(lambda: batch(fn=nothing, work=work), 5, sync)
                return per_call_time(t_with, t_without, reps, op, typical=work is not None)

            t = per_call()
            idle[op].append(max(t, 1e-7))
            if compute is not None:
                # between computing ranks: at least what it costs on idle cores (the difference of
                # two noisy batches can come out below)
                t = max(t, per_call(compute))
            res[op].append(max(t, 1e-7))
        if busy:
            for op in BESIDE_OPS:
                async_fn = functools.partial(ops[op], async_op=True)
                async_fn().wait()  # warm
                reps = 20 if nbytes <= (1 << 20) else 5
                beside[op].append(cpu_per_call(async_fn, reps, 3, dist.barrier))
    if busy:  # every rank's CPU pays for its calls: their mean
        for op in BESIDE_OPS:
            mean = torch.tensor(beside[op], dtype=torch.float64)
            dist.all_reduce(mean)
            beside[op] = [max(v / world, 1e-7) for v in mean.tolist()]
    if rank == 0:
        q.put((res, idle, beside))
    dist.barrier()
    dist.destroy_process_group()


def per_call_time(t_with: list[float], t_without: list[float], reps: int, op: str, typical: bool) -> float:
    """One call's time from the timings of several batches of ``reps`` calls (``t_with``) and of
    the same batches without the calls (``t_without``); a point-to-point batch goes there and
    back, so half of it counts.

    Which batch counts depends on what is timed. On idle cores (``typical`` False) the least: the
    others carry the neighbours' noise, and this is the floor. Between computing ranks (``typical``)
    the median, the typical batch, as the compute rates beside it are (``measure_cpu_busy``): there
    a call now and then waits milliseconds for its peer's thread to be scheduled (a traced ep2
    step's All-to-Alls: median 0.7-0.8 ms, mean 1.1-1.5 ms, docs/design.md), and a training step
    pays those waits too."""
    pick = statistics.median if typical else min
    return (pick(t_with) - pick(t_without)) / reps / (2 if op == "p2p" else 1)


# a CPU's ranks compute between their collectives: each timed call follows this much work
BUSY_SEGMENT_S = 0.003

# the asynchronous collectives a step runs beside its compute (ZeRO-3's prefetched gathers, the
# gradient reductions launched as the backward goes)
BESIDE_OPS = ("all_reduce", "reduce_scatter", "all_gather")


def cpu_per_call(launch, reps: int, batches: int, barrier, clock=time.process_time) -> float:
    """What one asynchronous collective takes from its rank's cores: the process's CPU time (every
    thread's: the launch, gloo's worker, the system calls that copy its bytes; ``clock``) over
    ``batches`` batches of ``reps`` (launch, wait), per call, the median batch. Its waits, asleep,
    take none: beside compute that time is the compute's to use."""
    per_batch = []
    for _ in range(batches):
        barrier()
        t = clock()
        for _ in range(reps):
            launch().wait()
        per_batch.append((clock() - t) / reps)
    return statistics.median(per_batch)


def _busy_segment(seconds: float):
    """A function of about ``seconds`` of one thread's training work: forwards of the reference
    MoE block (``_reference_block_config``) over one sequence, sized here, once. What a rank runs
    before a collective decides what the collective costs it: on a 2-core CPU a 16-element
    all-reduce after a block's forward took 3.7-4.5 ms, after as long of bare matrix products
    1.0-1.8 (docs/design.md)."""
    import torch

    from moe.model import Transformer

    cfg = _reference_block_config()
    torch.manual_seed(0)
    model = Transformer(cfg)
    block, L = model.blocks[0], cfg.max_seq_len
    cos, sin = model.rope_cos[:L], model.rope_sin[:L]
    x = torch.randn(1, L, cfg.d_model)

    @torch.no_grad()
    def one():
        block(x, cos, sin)

    for _ in range(3):  # warm: the kernel's pool
        one()
    t = time.perf_counter()
    for _ in range(5):
        one()
    n = max(1, round(seconds / max((time.perf_counter() - t) / 5, 1e-9)))

    def work():
        for _ in range(n):
            one()

    return work


def measure_collectives(backend: str, world: int = 2, sizes=None, busy: bool | None = None) -> dict:
    """Each collective by message size on ``world`` local ranks; α, β by least squares. ``busy``
    (default: on gloo, a CPU's): each call follows ``BUSY_SEGMENT_S`` of computation on every rank,
    whose time alone is taken off, and the fit is of these times (``raw``; ``idle``: on idle
    cores, a floor to them): on a CPU whose cores all compute, gloo's threads take their time
    from the ranks' and each message waits for its peer's thread to be scheduled, so a collective
    costs a training step more than on idle cores (about 1 ms more per call below 1 MB, seen on 2
    cores). A GPU's collectives run beside its compute: timed idle."""
    import torch.multiprocessing as mp

    from experiments.launch import rendezvous_port

    sizes = sizes or COLL_SIZES
    busy = backend == "gloo" if busy is None else busy
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = rendezvous_port()
    mp.start_processes(_coll_worker, args=(world, port, backend, sizes, busy, q), nprocs=world, start_method="spawn")
    res, idle, beside = q.get()
    return _collectives(res, idle, world, sizes, busy, beside)


def _collectives(res: dict, idle: dict, world: int, sizes, busy: bool, beside: dict | None = None) -> dict:
    """``measure_collectives``' result from each op's times by size: α, β fitted to ``res``, and
    (between computing ranks) to what each asynchronous one costs beside compute (``beside``)."""
    fitted = {}
    for op, times in res.items():
        ab = zplan.fit_alpha_beta(op, world, sizes, times)
        fitted[op] = {"alpha": ab.alpha, "beta": ab.beta}
    beside = {op: t for op, t in (beside or {}).items() if t}
    fitted_beside, unfitted = {}, {}
    for op, times in beside.items():
        try:
            ab = zplan.fit_alpha_beta(op, world, sizes, times)
        except ValueError as e:
            # too noisy to give a bandwidth: the profile leaves the op out, and the planner takes its
            # bytes alone (the collective's time less its waits), as on a profile measured before
            unfitted[op] = str(e)
            continue
        fitted_beside[op] = {"alpha": ab.alpha, "beta": ab.beta}
    return {
        "fitted": fitted,
        "fitted_beside": fitted_beside,
        "beside_unfitted": unfitted,
        "raw": {op: list(zip(sizes, t)) for op, t in res.items()},
        "idle": {op: list(zip(sizes, t)) for op, t in idle.items()},
        "beside": {op: list(zip(sizes, t)) for op, t in beside.items()},
        "busy": busy,
        "world": world,
    }


def median_collectives(runs: list[dict]) -> dict:
    """Several ``measure_collectives`` results as one: each timing's median, fitted again."""
    first = runs[0]
    sizes = [s for s, _ in next(iter(first["raw"].values()))]
    times = {
        key: median_of([{op: [t for _, t in pts] for op, pts in r.get(key, {}).items()} for r in runs])
        for key in ("raw", "idle", "beside")
    }
    return _collectives(times["raw"], times["idle"], first["world"], sizes, first["busy"], times["beside"])


def median_of(runs: list):
    """The element-wise median of equally shaped measurements (dicts, lists and numbers)."""
    first = runs[0]
    if isinstance(first, dict):
        return {k: median_of([r[k] for r in runs]) for k in first}
    if isinstance(first, (list, tuple)):
        return [median_of([r[i] for r in runs]) for i in range(len(first))]
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return float(statistics.median(runs))
    return first


def run_calibrate(argv: list[str]) -> int:
    import torch

    ap = argparse.ArgumentParser(prog="python -m experiments.plan --calibrate", description="measure this machine")
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--out", default=None, help="profile yaml to write (default conf/cluster/<name>.yaml)")
    ap.add_argument("--name", default=None)
    ap.add_argument("--base", default=None, help="profile whose values fill what is not measured here")
    ap.add_argument("--quick", action="store_true", help="fewer sizes (a test's smoke run)")
    ap.add_argument("--no-collectives", action="store_true")
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="whole measurements whose median is kept (default: 3 on a CPU, 1 on a GPU)",
    )
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda:0" if cuda else "cpu"
    if not cuda:
        torch.set_num_threads(1)  # torchrun's OMP_NUM_THREADS=1 per rank: what one rank gets
    cores = os.cpu_count() or 1
    name = a.name or (Path(a.out).stem if a.out else ("cuda" if cuda else f"cpu_{cores}core"))
    base = zplan.load_profile(a.base).to_dict() if a.base else {}
    # a GPU is its own; a CPU's cores are shared by its ranks: measured with every core busy
    repeats = a.repeats if a.repeats is not None else (1 if cuda or a.quick else 3)
    if repeats < 1:
        raise ValueError(f"--repeats={repeats} is invalid: expected a positive integer")

    # a shared CPU's speed moves from one minute to the next: each figure is the median of
    # ``repeats`` whole measurements
    def measure():
        return measure_device(device, quick=a.quick) if cuda else measure_cpu_busy(cores, quick=a.quick)

    m = median_of([measure() for _ in range(repeats)])
    d = dict(base)
    d.update(name=name, notes="")
    sources = dict(base.get("sources") or {})
    for key in ("matmul_flops", "attention_flops", *(k for k in _RATES if k in m)):
        d[key] = m[key]
        sources[key] = (
            f"measured by python -m experiments.plan --calibrate on {device}, "
            + ("best of repeats" if cuda else f"median of repeats, one process on each of the {cores} cores at once")
            + (f"; the median of {repeats} such measurements" if repeats > 1 else "")
        )
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
            collective_copies=True,
            node_size=16,
            compute_slots=cores,
        )
        d["host_memory_bytes"] = float(mem)
        d["background_load"] = background_load(cores, 0.5 if a.quick else 2.0)
        sources["background_load"] = "other work in busy processes: cores / (a busy process's share of a core) - cores"
        sources["expert_kernel"] = "the CPU's routed-expert kernel (routing_kernels.cpu_experts)"
        sources["collective_copies"] = "gloo: reduce-scatter and all-gather copy their tensor (zero.plan.profile)"
        sources["device_memory_bytes"] = "os.sysconf: the host's memory, shared by its ranks"
        sources["node_size"] = "every local rank is in one node (one host; gloo over loopback)"
        sources["compute_slots"] = "os.cpu_count(): ranks beyond it share cores"
    raw = None
    can_coll = not a.no_collectives and (not cuda or torch.cuda.device_count() >= 2)
    if can_coll:
        coll = median_collectives([measure_collectives("nccl" if cuda else "gloo") for _ in range(repeats)])
        raw = coll["raw"]
        tiers = {"intra": dict(coll["fitted"])}
        # one machine: its only link; a profile for several nodes takes the inter tier from --base
        tiers["inter"] = (base.get("collectives") or {}).get("inter") or dict(coll["fitted"])
        d["collectives"] = tiers
        for op, why in coll["beside_unfitted"].items():
            print(f"warning: {op} beside computation left out of the profile: {why}", file=sys.stderr)
        # measured here or not at all: a --base profile's figures are another machine's
        d["collectives_beside"] = dict(coll["fitted_beside"])
        sources.pop("collectives_beside", None)
        if coll["fitted_beside"]:
            sources["collectives_beside"] = (
                "2 local gloo ranks, the process CPU time (every thread) per asynchronous call, the mean of "
                f"the ranks, least squares over {COLL_SIZES} bytes"
                + (f"; each timing the median of {repeats} measurements" if repeats > 1 else "")
            )
        sources["collectives.intra"] = (
            f"2 local ranks, {'nccl' if cuda else 'gloo'}, least squares over {COLL_SIZES} bytes"
            + (f", each call after {BUSY_SEGMENT_S * 1e3:g} ms of computation (taken off)" if coll["busy"] else "")
            + (f"; each timing the median of {repeats} measurements" if repeats > 1 else "")
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
        where = ", between computing ranks" if coll["busy"] else ""

        def lines(by_op: dict) -> str:
            return "\n".join(f"  {op}: " + ", ".join(f"({s}, {t:.3g})" for s, t in pts) for op, pts in by_op.items())

        header += f"\nraw collective timings (bytes, seconds), 2 ranks{where}:\n" + lines(raw)
        if coll["beside"]:
            header += "\nasynchronous, a rank's CPU seconds per call:\n" + lines(coll["beside"])
    zplan.save_profile(profile, out, header=header)
    print(f"wrote {out}")
    return 0
