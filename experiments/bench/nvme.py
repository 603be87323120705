"""NVMe offload (``ZeroEngine(offload="nvme")``): the optimizer step's I/O throughput against the
disk's own sequential bandwidth, and the training step against CPU offload and no offload.

    python -m experiments.bench.nvme [--dir /local_nvme/scratch] [--params 100e6] [--steps 8]

In one run, on the filesystem of ``--dir``:

1. the disk's sequential write and read bandwidth: a file of the size of the offloaded state,
   written and read back with O_DIRECT (where the filesystem takes it) twice over: one stream of
   64 MiB requests (what ``dd oflag=direct bs=64M`` does) and the offload's own I/O threads
   (``zero.nvme``: ``_IO_THREADS`` threads of 8 MiB requests), before and after the training;
   each direction's best counts, so the ratio below is against the best this disk did;
2. the same residual MLP (``--params`` fp32 parameters, AdamW, fused kernel by default) trained
   ``--steps`` steps (after one warm-up) with ``offload="none"``, ``"cpu"`` and ``"nvme"``, one
   process, stage 1, the three side by side taking turns. Reported: the median training step
   (forward, backward, optimizer) and the median optimizer step alone;
3. for NVMe, the bytes each optimizer step read and wrote and its I/O efficiency
   ``(read / read_bw + written / write_bw) / step time``: the fraction of the step the disk would
   need at its own sequential speed to move those bytes (1.0: the step runs at disk speed; the
   reads of the next sub-group and the writes of the last overlap the update of the current one,
   so the update's own time hides behind the I/O as long as it is shorter), and the same for the
   streaming loop with the update left out (the offload's I/O path alone: where the step falls
   short of it, the update, not the I/O, is what takes the time).

Runs on the CPU (the update runs there under both offloads); on a GPU machine the model trains on
the GPU and the copies cross PCIe. Imports no hydra or wandb.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import tempfile
import time

import torch
import torch.nn as nn

import routing_kernels
from zero import ZeroEngine, nvme

OPTIMIZERS = {
    # torch's AdamW: the single-tensor loop on the CPU, several passes over each tensor
    "adamw": lambda g: torch.optim.AdamW(g, lr=1e-4, weight_decay=0.1),
    # torch's fused AdamW kernel (CPU since torch 2.4): one pass, so the update hides behind the I/O sooner
    "adamw-fused": lambda g: torch.optim.AdamW(g, lr=1e-4, weight_decay=0.1, fused=True),
    "fusedadamw": lambda g: routing_kernels.FusedAdamW(g, lr=1e-4, weight_decay=0.1),  # the engine's default
}


class MLP(nn.Module):
    def __init__(self, d: int, f: int, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, f), nn.GELU(), nn.Linear(f, d)) for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def disk_bandwidth(directory: str, nbytes: int) -> dict:
    """Sequential O_DIRECT write and read of ``nbytes`` in ``directory``, bytes per second: the best
    of one stream of 64 MiB requests and the offload's thread pool of 8 MiB requests."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)
    path = os.path.join(directory, f".bench-nvme-{os.getpid()}")
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:  # no O_DIRECT here: buffered, as the offload falls back to
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.unlink(path)
    big = 64 << 20
    nbytes = max(big, nbytes // big * big)
    buf = nvme._aligned(big, torch.cuda.is_available())
    buf.random_(0, 255)
    mv = memoryview(buf.numpy())
    os.posix_fallocate(fd, 0, nbytes)
    out = {}
    pool = concurrent.futures.ThreadPoolExecutor(nvme._IO_THREADS)
    advise = not (getattr(os, "O_DIRECT", 0) & _getfl(fd))  # buffered: drop the pages, as the offload does
    try:
        for name, write in (("write", True), ("read", False)):
            best = 0.0
            for _ in range(2):
                os.fsync(fd)
                t0 = time.perf_counter()
                for off in range(0, nbytes, big):  # one stream of large requests
                    (os.pwritev if write else os.preadv)(fd, [mv], off)
                os.fsync(fd)
                best = max(best, nbytes / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                futs = []
                for off in range(0, nbytes, big):  # the offload's threads and request size
                    for start in range(0, big, nvme._IO_CHUNK):
                        part = mv[start : start + nvme._IO_CHUNK]
                        fn = nvme._pwrite if write else nvme._pread
                        futs.append(pool.submit(fn, fd, part, off + start, advise))
                for f in futs:
                    f.result()
                os.fsync(fd)
                best = max(best, nbytes / (time.perf_counter() - t0))
            out[name] = best
    finally:
        pool.shutdown()
        os.close(fd)
    return out


def _getfl(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


def build(offload: str, args, directory: str, device) -> ZeroEngine:
    torch.manual_seed(0)
    d = args.d
    f = 4 * d
    layers = max(1, round(args.params / (2 * d * f + d + f)))
    net = MLP(d, f, layers).to(device)
    extra = dict(offload_dir=directory, offload_sub_group_elems=args.sub_group) if offload == "nvme" else {}
    return ZeroEngine(net, None, stage=1, offload=offload, optimizer=OPTIMIZERS[args.optimizer], **extra)


def train(args, directory: str) -> dict:
    """The three placements side by side, taking turns step by step (load from other processes on
    a shared machine then falls on all alike); each one's medians."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    engines = {o: build(o, args, directory, device) for o in ("none", "cpu", "nvme")}
    x = torch.randn(args.batch, args.d, device=device)
    times = {o: ([], []) for o in engines}
    io = []
    for s in range(args.steps + 1):
        for o, engine in engines.items():
            t0 = time.perf_counter()
            engine.backward(engine(x).pow(2).mean())
            if device.type == "cuda":
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            before = dict(engine._nvme.stats) if engine._nvme is not None else None
            engine.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            if s == 0:
                continue  # warm-up: the first step creates the optimizer state
            times[o][0].append(t2 - t0)
            times[o][1].append(t2 - t1)
            if before is not None:
                io.append({k: engine._nvme.stats[k] - before[k] for k in before})
    out = {}
    for o, engine in engines.items():
        out[o] = {
            "params": sum(p.numel() for p in engine.module.parameters()),
            "step_s": statistics.median(times[o][0]),
            "optimizer_step_s": statistics.median(times[o][1]),
        }
    off = engines["nvme"]._nvme
    every = list(range(len(off.slots)))
    streams = []
    for _ in range(3):  # the same streaming loop without the update: the offload's I/O path alone
        t0 = time.perf_counter()
        off._stream(every, lambda sg, bs: None, write_slots=every)
        streams.append(time.perf_counter() - t0)
    out["nvme"].update(
        io_only_s=statistics.median(streams),
        update_s=statistics.median(i["update_s"] for i in io),
        read_bytes=statistics.median(i["read_bytes"] for i in io),
        write_bytes=statistics.median(i["write_bytes"] for i in io),
        io_wait_s=statistics.median(i["io_wait_s"] for i in io),
        direct=off.direct,
        buffer_bytes=sum(sum(r.numel() for r in b.raw) + b.grad.numel() * 4 for b in off.sets),
    )
    off.close()  # frees the files' space before the disk is measured
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="a directory on the disk to measure (default: a temp dir in .)")
    # 100M: the offloaded state (1.2 GB) six times the buffers (0.2 GB)
    ap.add_argument("--params", type=float, default=100e6, help="fp32 parameters of the MLP")
    ap.add_argument("--d", type=int, default=1024, help="the MLP's width (its hidden size is 4x)")
    ap.add_argument("--batch", type=int, default=8, help="rows per step (small: the optimizer dominates)")
    ap.add_argument("--steps", type=int, default=8, help="measured steps per placement (after one warm-up)")
    # the engine's default (4M elements, 16 MiB per state tensor and buffer set): smaller sub-groups
    # overlap the first read and the last write better but cost more per element here (1M: 3.6x the
    # update time of 4M on this machine's 2 shared cores, whose caches 4 MiB operands thrash less)
    ap.add_argument("--sub-group", type=int, default=nvme.DEFAULT_SUB_GROUP, help="offload_sub_group_elems")
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw-fused", help="the update's kernel")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(dir=args.dir or ".", prefix="bench-nvme-") as directory:
        state = int(args.params) * 12  # about: master + AdamW's two moments, fp32
        before = disk_bandwidth(directory, state)
        runs = train(args, directory)
        after = disk_bandwidth(directory, state)
        # the best the disk did, before or after: the efficiency is against that
        bw = {k: max(before[k], after[k]) for k in before}
        n = runs["nvme"]
    ideal = n["read_bytes"] / bw["read"] + n["write_bytes"] / bw["write"]
    eff = ideal / n["optimizer_step_s"]
    eff_io = ideal / n["io_only_s"]
    gb = 1e9
    print(
        f"disk ({'O_DIRECT' if n['direct'] else 'buffered'}, {directory}): sequential write "
        f"{bw['write'] / gb:.2f} GB/s, read {bw['read'] / gb:.2f} GB/s"
    )
    print(
        f"model: {n['params'] / 1e6:.1f}M fp32 parameters, {args.optimizer}; offloaded state {state / 1e6:.0f} MB, "
        f"buffers {n['buffer_bytes'] / 1e6:.0f} MB; torch threads {torch.get_num_threads()}"
    )
    print(
        f"nvme optimizer step: {n['optimizer_step_s'] * 1e3:.0f} ms, read {n['read_bytes'] / 1e6:.0f} MB + wrote "
        f"{n['write_bytes'] / 1e6:.0f} MB = {(n['read_bytes'] + n['write_bytes']) / n['optimizer_step_s'] / gb:.2f} "
        f"GB/s; at the disk's speed {ideal * 1e3:.0f} ms: I/O efficiency {eff:.2f}; "
        f"waiting on I/O {n['io_wait_s'] * 1e3:.0f} ms of it, updating {n['update_s'] * 1e3:.0f} ms"
    )
    print(
        f"nvme I/O path alone (the step's reads and writes, no update): {n['io_only_s'] * 1e3:.0f} ms, "
        f"{(n['read_bytes'] + n['write_bytes']) / n['io_only_s'] / gb:.2f} GB/s: I/O efficiency {eff_io:.2f}"
    )
    print("| offload | training step (ms) | optimizer step (ms) | vs none |")
    print("| --- | --- | --- | --- |")
    for o, r in runs.items():
        print(
            f"| {o} | {r['step_s'] * 1e3:.0f} | {r['optimizer_step_s'] * 1e3:.0f} | "
            f"{r['step_s'] / runs['none']['step_s']:.2f}x |"
        )
    figures = {"disk": bw, "runs": runs, "io_efficiency": eff, "io_path_efficiency": eff_io}
    if args.json:
        print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
