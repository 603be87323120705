"""Timing helpers every benchmark shares: medians of repeated calls, on the CPU and on CUDA.

torch only (triton's ``do_bench`` when present), so a benchmark that imports it still runs on a
GPU box that has nothing but torch and triton.
"""

from __future__ import annotations

import statistics
import time

import torch


def median_time(fn, reps: int, warmup: int = 1, clock=time.perf_counter) -> float:
    """Median seconds of ``reps`` calls after ``warmup`` untimed ones, by ``clock``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def time_cpu(fn, min_reps: int = 3, min_seconds: float = 0.3) -> float:
    """Median seconds per call after one warm-up: at least ``min_reps`` calls and ``min_seconds``."""
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_cuda(fn, rep_ms: int = 200) -> float:
    """Median seconds per call; triton's do_bench flushes L2 between calls, so large ops are
    measured from DRAM (our sizes are far beyond L2 anyway)."""
    try:
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") / 1e3
    except ImportError:
        pass
    return cuda_event_median(fn, 20)


def cuda_event_median(fn, reps: int) -> float:
    """Median seconds per call over ``reps`` calls after one warm-up, timed with CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work, so a host clock read after it covers that work."""
    if device.type == "cuda":
        torch.cuda.synchronize()
