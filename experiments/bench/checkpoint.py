"""Sharded checkpoint benchmark (``zero.checkpoint``): save and load time per rank, bytes written,
write throughput against a plain file write, and the training stall of an async save.

    python -m experiments.bench.checkpoint [--world 2] [--ep 2] [--stage 3] [--d-model 256] [--reps 3] [--dir /tmp/x]

Every rank builds the same MoE transformer (``moe.model.Transformer``) under the layout, takes one
AdamW step (so the optimizer state exists) and then, all ranks together:

- save (sync): ``zero.checkpoint.save`` (manifest included) into a new directory, ``--reps`` times;
  per rank the time until its save returned (the slowest rank's is the checkpoint's time), median over the reps;
- bytes: the data files written against ``zero.predict_memory``'s model-state bytes of the state a
  checkpoint holds (fp32 weights + Adam moments, each rank's ZeRO-3 share, summed over the ranks);
- throughput: after each save, each rank writes as many bytes to one file (one ``write`` of a
  ready buffer, fsync), all ranks at once; the ratio is that plain write's time over the save's
  (medians);
- verify: every rank re-reads its share of the checkpoint against the manifest's checksums
  (``zero.checkpoint.verify_together``, what a resume does before loading);
- load: ``zero.checkpoint.load`` of the same checkpoint (verification apart);
- async: ``Checkpointer(async_save=True).save`` blocks the loop only while the state is copied;
  its stall against the sync save's time.

Runs on gloo (CPU) or NCCL (GPU); imports no hydra or wandb.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zero
from experiments.launch import init_rank, rendezvous_port
from moe import MoEConfig
from moe.model import Transformer, TransformerConfig
from zero import checkpoint as zc


def _build(args, layout: zero.Layout, device) -> zero.ZeroEngine:
    D = args.d_model
    cfg = TransformerConfig(
        vocab_size=256,
        d_model=D,
        n_layers=args.layers,
        n_heads=max(1, D // 64),
        d_ff=4 * D,
        max_seq_len=64,
        moe=MoEConfig(d_model=D, d_ff=2 * D, num_experts=args.experts, top_k=2),
    )
    torch.manual_seed(0)
    model = Transformer(cfg, layout=layout).to(device)
    engine = zero.ZeroEngine(
        model,
        layout,
        stage=args.stage,
        offload=args.offload,
        optimizer=lambda g: torch.optim.AdamW(g, lr=1e-3, foreach=True),
    )
    x = torch.randint(0, 256, (2, 32), device=device)
    engine.backward(torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()))
    engine.step()
    return engine


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _timed(fn) -> float:
    _barrier()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _rank_bytes(path: Path, rank: int) -> int:
    return sum(p.stat().st_size for p in path.glob(f"__{rank}_*.distcp"))


def _plain_write(path: Path, nbytes: int) -> float:
    buf = bytearray(os.urandom(1 << 20)) * max(1, nbytes >> 20)
    buf = buf[:nbytes]

    def write():
        with open(path, "wb") as f:
            f.write(buf)
            f.flush()
            os.fsync(f.fileno())

    t = _timed(write)
    path.unlink()
    return t


def _run(rank, world, port, args, q):
    device = init_rank(rank, world, port) if world > 1 else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layout = zero.Layout.build(ep=args.ep, num_experts=args.experts) if world > 1 else zero.Layout.single()
    engine = _build(args, layout, device)
    root = Path(args.dir)
    path = root / "ckpt_0"
    _timed(lambda: zc.save(engine, path, step=1))  # warm-up: DCP's first plan
    written = _rank_bytes(path, rank)
    saves, plain = [], []
    for i in range(1, args.reps + 1):  # alternated, so the disk's and the machine's moods fall on both alike
        # each save into a new directory, as in training; the previous one is deleted untimed
        saves.append(_timed(lambda: zc.save(engine, root / f"ckpt_{i}", step=1)))
        plain.append(_plain_write(root / f"plain_{rank}", written))
        _barrier()
        if rank == 0:
            shutil.rmtree(path)
        path = root / f"ckpt_{i}"
    group = zc.new_group()
    digest = statistics.median(_timed(lambda: zc.verify_together(path, group)) for _ in range(args.reps))
    loads = [_timed(lambda: zc.load(engine, path, check=False)) for _ in range(args.reps)]
    stalls, totals = [], []
    ck = zc.Checkpointer(engine, root / "async", keep_last=2, async_save=True, group=group)
    for i in range(args.reps):
        stalls.append(_timed(lambda: ck.save(10 + i)))
        totals.append(stalls[-1] + _timed(ck.wait))
    ck.close()
    mem = zero.predict_memory(engine.module, stage=3, mixed_precision="fp32", layout=layout)
    predicted = sum(mem[k]["params"] + mem[k]["optimizer"] for k in ("dense", "expert"))
    q.put(
        (
            rank,
            {
                "save": statistics.median(saves),
                "digest": digest,
                "load": statistics.median(loads),
                "plain": statistics.median(plain),
                "stall": statistics.median(stalls),
                "async_total": statistics.median(totals),
                "written": written,
                "predicted": predicted,
                "params": sum(zero.count_params(engine.module, layout).values()),
            },
        )
    )
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory, removed after)")
    args = ap.parse_args(argv)
    tmp = args.dir is None
    args.dir = tempfile.mkdtemp(prefix="bench_ckpt_") if tmp else args.dir
    try:
        ctx = mp.get_context("spawn")
        q = ctx.SimpleQueue()
        if args.world == 1:
            args.ep = 1
            _run(0, 1, 0, args, q)
        else:
            mp.start_processes(
                _run, args=(args.world, rendezvous_port(), args, q), nprocs=args.world, start_method="spawn", join=True
            )
        rows = dict(q.get() for _ in range(args.world))
    finally:
        if tmp:
            shutil.rmtree(args.dir, ignore_errors=True)
    r = [rows[i] for i in range(args.world)]
    written, predicted = sum(x["written"] for x in r), sum(x["predicted"] for x in r)
    save = max(x["save"] for x in r)
    print(
        f"{r[0]['params'] / 1e6:.1f}M parameters, world {args.world} (ep {args.ep}, ZeRO-{args.stage}"
        f"{', offload' if args.offload else ''}), {'nccl' if torch.cuda.is_available() else 'gloo'}, "
        f"median of {args.reps}"
    )
    print(
        "| rank | save (s) | verify (s) | load (s) | written (MB) | plain write (s) | write throughput vs plain "
        "| async stall (s) | stall / sync save |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for i, x in enumerate(r):
        print(
            f"| {i} | {x['save']:.2f} | {x['digest']:.2f} | {x['load']:.2f} | {x['written'] / 1e6:.1f} "
            f"| {x['plain']:.2f} | "
            f"{x['plain'] / x['save']:.2f} | {x['stall']:.3f} | {x['stall'] / x['save']:.2f} |"
        )
    print(
        f"bytes written {written / 1e6:.1f} MB vs predict_memory's model state (fp32 weights + Adam moments) "
        f"{predicted / 1e6:.1f} MB: {written / predicted:.3f}x; checkpoint save {save:.2f} s "
        f"({written / save / 1e6:.0f} MB/s over all ranks); async save in the background "
        f"{max(x['async_total'] for x in r):.2f} s"
    )


if __name__ == "__main__":
    main()
