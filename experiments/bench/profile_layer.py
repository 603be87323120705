"""Where a MoE layer's forward + backward spends its time: torch.profiler's top ops.

    python -m experiments.bench.profile_layer [--device cpu|cuda] [--shape S1] [--dtype bfloat16] [--steps 5]

Shapes as in ``experiments.bench.moe_layer`` (``experiments.bench.layers``). On a GPU it lists the
ops by host time (launch-bound layers show up here) and by device time; on the CPU by time. Imports
only torch, ``moe`` and ``experiments.bench.layers``.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from experiments.bench.layers import GPU_SHAPES, layer_step
from moe import MoEConfig, MoELayer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shape", default="S1", choices=list(GPU_SHAPES))
    ap.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"], help="default: bfloat16 on a GPU, float32 on the CPU"
    )
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=20, help="ops to list")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    T, D, F, E, K = GPU_SHAPES[args.shape]
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K)).to(args.device, dtype)
    x = torch.randn(T, D, device=args.device, dtype=dtype, requires_grad=True)
    g = torch.randn(T, D, device=args.device, dtype=dtype)
    for _ in range(3):
        layer_step(layer, x, g)
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            layer_step(layer, x, g)
        if cuda:
            torch.cuda.synchronize()
    table = prof.key_averages()
    print(f"{args.shape} T={T} D={D} F={F} E={E} k={K} {dtype} on {args.device}, {args.steps} steps")
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if cuda:
        print(table.table(sort_by="self_cuda_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
