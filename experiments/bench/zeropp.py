"""ZeRO++ (hpZ, qwZ, qgZ) against plain ZeRO-3: bytes per link tier per step, step time, and a
predicted speedup at the paper's scale.

    python -m experiments.bench.zeropp [--world 4] [--node-size 2] [--steps 4] [--mixed-precision bf16]

1. Measured, exact: every combination of the three options trains the same residual MLP (default
   2.1M parameters: 4 blocks of Linear(256, 1024) -> GELU -> Linear(1024, 256)) on ``--world`` ranks
   cut into nodes of ``--node-size``; the table gives the bytes one rank sent per optimizer step
   over intra-node and inter-node links, read from the engine's counters (``engine.comm_bytes()``,
   the byte model of ``zero.comm``), and the ratio to plain ZeRO-3's. The counts are the same on
   every rank and every step (the script checks).
2. Measured, here: the median step time of each (contenders take turns step by step, so load from
   other processes on a shared machine falls on all alike). On gloo over one machine's loopback
   every "link" is the same memory copy, so these times show the CPU cost of quantizing, not a
   network's: read them as overhead, not as speedup.
3. On paper, not measured: an alpha-beta model of one step at the paper's setting (384 V100s, 24
   nodes of 16, 4 x 100 Gbps InfiniBand per node, 1k and 2k tokens per GPU), beside the paper's
   reported gains. Compute and communication are added (no overlap) and maxed (perfect overlap),
   bounding what overlap the real system achieves; quantization kernels cost nothing in it.

torch only (no hydra or wandb); gloo on the CPU, NCCL on GPUs.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from experiments.bench.layers import MLP
from experiments.launch import init_rank, rendezvous_port


def contenders(bits: tuple[int, ...] = (4, 8)) -> dict[str, dict]:
    """Every combination of hpZ, qwZ and qgZ (qgZ at each of ``bits``), plain ZeRO-3 first."""
    out = {}
    for hpz, qwz, qgz in itertools.product((False, True), repeat=3):
        for b in bits if qgz else (None,):
            parts = [n for n, on in (("hpZ", hpz), ("qwZ", qwz)) if on] + ([f"qgZ int{b}"] if qgz else [])
            kw = {"hpz": hpz, "qwz": qwz, "qgz": qgz} | ({"qgz_bits": b} if qgz else {})
            out[" + ".join(parts) or "ZeRO-3"] = kw
    return out


def _run(rank, world, port, args, out_q):
    from zero import Layout
    from zero.engine import ZeroEngine

    device = init_rank(rank, world, port, timeout_s=600)
    layout = Layout.build(node_size=args.node_size)
    torch.manual_seed(100 + rank)
    x_TD = torch.randn(args.tokens, args.d_model, device=device)
    y_TD = torch.randn(args.tokens, args.d_model, device=device)
    engines = {}
    for name, kw in contenders().items():
        torch.manual_seed(0)
        model = MLP(args.d_model, args.d_ff, args.layers).to(device)
        engines[name] = ZeroEngine(
            model, layout, stage=3, lr=1e-4, mixed_precision=args.mixed_precision, quant_block=args.block, **kw
        )

    def step(engine):
        loss = nn.functional.mse_loss(engine(x_TD).float(), y_TD)
        engine.backward(loss)
        engine.step()

    for e in engines.values():
        for _ in range(args.warmup):
            step(e)
    times = {n: [] for n in engines}
    counts = {n: [] for n in engines}
    for _ in range(args.steps):
        for name, e in engines.items():
            dist.barrier()
            t0 = time.perf_counter()
            step(e)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
            counts[name].append(e.comm_bytes())
    rows = {}
    for name in engines:
        if any(c != counts[name][0] for c in counts[name]):
            raise RuntimeError(f"{name}: the byte counts changed between steps: {counts[name]}")
        c = counts[name][0]
        # the same on every rank (the model is symmetric): the max and the min over ranks agree
        t = torch.tensor([c["intra"], c["inter"], -c["intra"], -c["inter"]], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if t[0] != -t[2] or t[1] != -t[3]:
            raise RuntimeError(f"{name}: the byte counts differ between ranks")
        med = torch.tensor(statistics.median(times[name]))
        dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the slowest rank sets the step time
        rows[name] = (c["intra"], c["inter"], med.item())
    if rank == 0:
        n_params = sum(p.numel() for p in MLP(args.d_model, args.d_ff, args.layers).parameters())
        out_q.put((n_params, layout.describe(), rows))
    dist.destroy_process_group()


# --- on paper: an alpha-beta model at the paper's scale --------------------------------------


def paper_step_times(
    params: float,
    layers: int,
    tokens: int,
    *,
    nodes: int = 24,
    per_node: int = 16,
    inter_gbps: float = 400.0,
    intra_gbs: float = 150.0,
    alpha_inter_us: float = 10.0,
    alpha_intra_us: float = 3.0,
    tflops: float = 62.5,
    block: int = 256,
) -> dict[str, tuple[float, float]]:
    """Seconds of compute and of communication per step per GPU, ``{"ZeRO-3": (compute, comm),
    "ZeRO++": (...)}``, for a model of ``params`` parameters in ``layers`` blocks and ``tokens``
    tokens per GPU. Compute: 8 * params * tokens FLOPs (forward, backward, and the forward again
    under activation checkpointing) at ``tflops`` achieved (default half of a V100's 125 fp16
    peak). Each collective over W = nodes * per_node ranks is the two-level algorithm of
    ``zero.comm``: (n - 1) / W * N bytes across nodes at a GPU's share of the node's links
    (``inter_gbps / per_node``), (k - 1) / k * N inside at ``intra_gbs`` (NVSwitch), one alpha per
    hop, once per block; 16-bit weights and gradients (2 bytes), int8 qwZ, int4 qgZ, fp32 scales
    per ``block``."""
    n, k = nodes, per_node
    W = n * k
    inter_bw = inter_gbps / 8 * 1e9 / k  # bytes/s one GPU gets of its node's links
    intra_bw = intra_gbs * 1e9
    a_inter, a_intra = alpha_inter_us * 1e-6, alpha_intra_us * 1e-6

    def two_level(N: float) -> float:  # all-gather of N bytes out / reduce-scatter of N bytes in
        beta = (n - 1) / W * N / inter_bw + (k - 1) / k * N / intra_bw
        return beta + layers * ((n - 1) * a_inter + (k - 1) * a_intra)

    def intra_only(N: float) -> float:
        return (k - 1) / k * N / intra_bw + layers * (k - 1) * a_intra

    def row(m: float, bits: int) -> float:  # quantized bytes of m elements
        return m * bits / 8 + 4 * m / block

    compute = 8 * params * tokens / (tflops * 1e12)
    zero3 = 3 * two_level(2 * params)
    qgz = (
        (k - 1) * row(params / k, 4) / intra_bw
        + (n - 1) * row(params / W, 4) / inter_bw
        + layers * ((k - 1) * a_intra + (n - 1) * a_inter)
    )
    zeropp = two_level(row(params, 8)) + intra_only(2 * params) + qgz
    return {"ZeRO-3": (compute, zero3), "ZeRO++": (compute, zeropp)}


# as the ZeRO++ paper reports them at 384 GPUs and 4 x 100 Gbps (throughput over ZeRO-3, its models)
PAPER_REPORTED = {1024: "+28% to +36%", 2048: "+24% to +29%"}
# two GPT shapes at the ends of the paper's range (12 * layers * d^2 parameters; assumed, not the paper's)
PAPER_MODELS = {"18B (40 x 6144)": (18.1e9, 40), "138B (76 x 12288)": (137.7e9, 76)}


def paper_table(tflops: float) -> list[str]:
    lines = [
        "| model | tokens/GPU | ZeRO-3 comm / compute | predicted gain, no overlap | predicted gain, perfect overlap "
        "| paper reports |",
        "|---|---|---|---|---|---|",
    ]
    for label, (params, layers) in PAPER_MODELS.items():
        for tokens, reported in PAPER_REPORTED.items():
            t = paper_step_times(params, layers, tokens, tflops=tflops)
            (c, z3), (_, zp) = t["ZeRO-3"], t["ZeRO++"]
            serial = (c + z3) / (c + zp) - 1
            overlap = max(c, z3) / max(c, zp) - 1
            lines.append(f"| {label} | {tokens} | {z3 / c:.2f} | {serial:+.0%} | {overlap:+.0%} | {reported} |")
    return lines


def paper_profile(tflops: float):
    """The paper's cluster as a planner profile (the values ``paper_step_times`` takes): 24 nodes of
    16 V100 32 GB, 4 x 100 Gbps per node (3.125 GB/s a GPU), NVSwitch 150 GB/s, alpha 10 us across /
    3 us inside per step, ``tflops`` achieved on every product, V100 HBM2 900 GB/s."""
    from zero.plan import AlphaBeta, Profile

    ops = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "p2p")
    return Profile(
        name="zeropp_paper",
        device="V100 32GB, 16 a node (the ZeRO++ paper's cluster, as modelled here)",
        device_memory_bytes=32e9,
        node_size=16,
        matmul_flops={"bf16": [[8192, tflops * 1e12]], "fp32": [[8192, tflops * 1e12 / 8]]},
        memory_bandwidth=900e9,
        collectives={
            "intra": {op: AlphaBeta(3e-6, 150e9) for op in ops},
            "inter": {op: AlphaBeta(10e-6, 400e9 / 8 / 16) for op in ops},
        },
    )


def planner_paper_table(tflops: float) -> list[str]:
    """The planner's (``zero.plan.predict``) step time of ZeRO-3 and of ZeRO++ (hpZ + qwZ int8 +
    qgZ int4, blocks of 256) at the paper's setting: 384 GPUs, bf16 weights and gradients,
    activation checkpointing, one or two 1024-token sequences per GPU, for the two GPT shapes of
    ``PAPER_MODELS`` (vocabulary 50,304, 4x FFN, heads of 128)."""
    import dataclasses

    from moe import TransformerConfig
    from moe.costs import model_costs
    from zero.plan import LayoutRecord, predict

    profile = paper_profile(tflops)
    lines = [
        "| model | tokens/GPU | ZeRO-3 step (s) | ZeRO++ step (s) | planner's predicted gain | inter-node bytes/GPU "
        "ZeRO-3 -> ZeRO++ | paper reports |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, (_, layers) in PAPER_MODELS.items():
        d = 6144 if layers == 40 else 12288
        cfg = TransformerConfig(
            vocab_size=50304, d_model=d, n_layers=layers, n_heads=d // 128, d_ff=4 * d, max_seq_len=1024, moe_every=0
        )
        costs = model_costs(cfg, 1024, act_dtype="bf16")
        for tokens, reported in PAPER_REPORTED.items():
            base = LayoutRecord(
                world=384,
                batch_size=384 * tokens // 1024,
                zero_stage=3,
                mixed_precision="bf16",
                checkpoint_activations=True,
            )
            zpp = dataclasses.replace(base, zero_hpz=True, zero_qwz=True, zero_qgz=True)
            a, b = predict(base, costs, profile), predict(zpp, costs, profile)
            lines.append(
                f"| {label} | {tokens} | {a.step_s:.3g} | {b.step_s:.3g} | {a.step_s / b.step_s - 1:+.0%} "
                f"| {a.comm_bytes['inter'] / 1e9:.3g} GB -> {b.comm_bytes['inter'] / 1e9:.3g} GB | {reported} |"
            )
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--node-size", type=int, default=2, help="ranks per simulated node")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128, help="rows per rank per step")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--block", type=int, default=256, help="elements per fp32 scale (qwZ and qgZ)")
    ap.add_argument("--mixed-precision", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--paper-tflops", type=float, default=62.5, help="achieved TFLOP/s per V100 in the paper model")
    args = ap.parse_args(argv)
    if args.world % args.node_size:
        raise ValueError(f"--node-size {args.node_size} does not divide --world {args.world}")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.start_processes(
        _run, args=(args.world, rendezvous_port(), args, q), nprocs=args.world, start_method="spawn", join=True
    )
    n_params, layout, rows = q.get()
    base_intra, base_inter, base_t = rows["ZeRO-3"]
    print(
        f"measured: {n_params / 1e6:.2f}M-parameter MLP, ZeRO-3, {args.mixed_precision} weights and gradients, "
        f"{args.world} ranks ({'nccl' if torch.cuda.is_available() else 'gloo'}) as nodes of {args.node_size} "
        f"({layout.split(' rank=')[0]}), quant block {args.block}, {args.tokens} rows/rank; bytes one rank sends "
        f"per optimizer step (exact, from engine.comm_bytes()); step time the median of {args.steps} interleaved steps"
    )
    print("| options | intra-node bytes | inter-node bytes | inter vs ZeRO-3 | step (ms) | step vs ZeRO-3 |")
    print("|---|---|---|---|---|---|")
    for name, (intra, inter, t) in rows.items():
        print(
            f"| {name} | {intra:,} | {inter:,} | {base_inter / inter:.2f}x fewer | {t * 1e3:.0f} | {t / base_t:.2f} |"
        )
    print()
    print(
        f"on paper (alpha-beta model, not measured): 384 V100 = 24 nodes x 16, 4 x 100 Gbps per node, NVSwitch "
        f"150 GB/s, alpha 10 us across / 3 us inside per hop, {args.paper_tflops:g} TFLOP/s achieved, ZeRO++ = "
        f"hpZ + qwZ int8 + qgZ int4"
    )
    for line in paper_table(args.paper_tflops):
        print(line)
    print()
    print("on paper, the planner (zero.plan.predict, its own overlaps) on the same cluster as a profile:")
    for line in planner_paper_table(args.paper_tflops):
        print(line)


if __name__ == "__main__":
    main()
