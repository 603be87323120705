"""Switchyard ZeRO stages 1-3 against torch DDP and torch FSDP2 (``fully_shard``), in one launch.

    python -m experiments.bench.zero [--world 2] [--steps 10] [--contenders FSDP2 1 2 3] [--keep-freed-memory]

Every contender trains the same residual MLP (default 12.6M parameters: 6 blocks of
Linear(512, 2048) -> GELU -> Linear(2048, 512)) with AdamW in fp32 on the same per-rank batch.
Reported per contender: the median step time (forward, backward, gradient communication, AdamW)
as a ratio to DDP's, and model-state bytes per rank measured from the live tensors after a step
(weights + gradients + optimizer state; ZeRO-3 adds the most gathered-block bytes seen during the
forward). The contenders are built side by side and take turns step by step, each reporting its
median, so load from other processes on a shared machine falls on all of them alike.
Runs on gloo (CPU) or NCCL (GPU); imports no hydra or wandb.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from experiments.bench.layers import MLP
from experiments.launch import init_rank, rendezvous_port

CONTENDERS = ["DDP", "FSDP2", "Switchyard ZeRO-1", "Switchyard ZeRO-2", "Switchyard ZeRO-3"]


def _nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):  # FSDP2 keeps DTensor shards
            t = t.to_local()
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _torch_state_bytes(model, opt) -> int:
    params = list(model.parameters())
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
    return _nbytes(params) + _nbytes(p.grad for p in params) + _nbytes(state)


def _run(rank, world, port, args, out_q):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero import Layout
    from zero.engine import ZeroEngine
    from zero.memory import measure_memory

    device = init_rank(rank, world, port, timeout_s=600)
    layout = Layout.build()
    torch.manual_seed(100 + rank)
    x_TD = torch.randn(args.tokens, args.d_model, device=device)
    y_TD = torch.randn(args.tokens, args.d_model, device=device)

    def fresh():
        torch.manual_seed(0)
        return MLP(args.d_model, args.d_ff, args.layers).to(device)

    def make(name):
        model = fresh()
        measured = {}
        if name in ("DDP", "FSDP2"):
            if name == "DDP":
                model = DDP(model)
            else:
                for b in model.blocks:
                    fully_shard(b)
                fully_shard(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def step():
                nn.functional.mse_loss(model(x_TD), y_TD).backward()
                opt.step()
                # gradients count as model states: measure before zero_grad drops them
                measured["bytes"] = _torch_state_bytes(model, opt)
                opt.zero_grad()

            return step, lambda: measured["bytes"]
        stage = int(name[-1])
        engine = ZeroEngine(model, layout, stage=stage, lr=1e-4)
        peak = {"gathered": 0}
        if stage == 3:
            for b in model.blocks:  # after the engine's own pre-hook: the block and its prefetch are in
                b.register_forward_pre_hook(
                    lambda m, a: peak.__setitem__("gathered", max(peak["gathered"], measure_memory(engine)["gathered"]))
                )

        def step():
            engine.backward(nn.functional.mse_loss(engine(x_TD), y_TD))
            engine.step()

        return step, lambda: measure_memory(engine)["device_total"] + peak["gathered"]

    names = [n for n in CONTENDERS if n in args.contenders or n == "DDP"]
    # contenders take turns step by step, so a burst of load from another process on a shared
    # machine slows every contender's samples alike instead of one contender's whole run
    contenders = {name: make(name) for name in names}
    for step, _ in contenders.values():
        for _ in range(args.warmup):
            step()
    times = {name: [] for name in names}
    for _ in range(args.steps):
        for name, (step, _) in contenders.items():
            dist.barrier()
            t0 = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    best, mem = {}, {}
    for name in names:
        # the slowest rank sets the step time
        med = torch.tensor(statistics.median(times[name]))
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        best[name] = med.item()
        mem[name] = contenders[name][1]()
    if rank == 0:
        n_params = sum(p.numel() for p in fresh().parameters())
        out_q.put((n_params, best, mem))
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--d-ff", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=256, help="rows per rank per step")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="glibc: no mmap for large blocks, no trimming (a caching allocator's behaviour)",
    )
    ap.add_argument("--contenders", nargs="+", default=CONTENDERS[1:], help="DDP always runs: it is the baseline")
    args = ap.parse_args(argv)
    if args.keep_freed_memory:
        # glibc returns every freed block over ~32 MB to the OS, and the next allocation of it pays a
        # page fault per 4 KiB (~60 ms per 50 MB here). Sharded training frees and reallocates such
        # buffers every step (gathered weights, stage-2 gradients) where a GPU caching allocator
        # would reuse them; this keeps freed memory in the heap, for every contender alike. The
        # spawned ranks read it when they start.
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 32))
        os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 36))
    args.contenders = [
        c if c.startswith(("DDP", "FSDP", "Switchyard")) else f"Switchyard ZeRO-{c}" for c in args.contenders
    ]
    for c in args.contenders:
        if c not in CONTENDERS:
            raise ValueError(f"--contenders {c!r}: expected some of {CONTENDERS} (or 1, 2, 3 for Switchyard's stages)")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.start_processes(
        _run, args=(args.world, rendezvous_port(), args, q), nprocs=args.world, start_method="spawn", join=True
    )
    n_params, best, mem = q.get()
    ddp = best["DDP"]
    print(
        f"{n_params / 1e6:.1f}M-parameter MLP, {args.world} ranks ({'nccl' if torch.cuda.is_available() else 'gloo'}), "
        f"{args.tokens} rows/rank, fp32 AdamW; median of {args.steps} interleaved steps"
        f"{', --keep-freed-memory' if args.keep_freed_memory else ''}"
    )
    print("| contender | step (ms) | vs DDP | model states / rank (MB) |")
    print("|---|---|---|---|")
    for name, t in best.items():
        print(f"| {name} | {t * 1e3:.0f} | {t / ddp:.2f}x | {mem[name] / 1e6:.1f} |")


if __name__ == "__main__":
    main()
