"""Run a function on N gloo ranks on 127.0.0.1 and collect what each returns.

The function must live at module level (ranks are spawned, not forked: forking a process whose
OpenMP pool is running can deadlock). Each rank runs with one intra-op thread, so 4 ranks share the
2 cores of the test machine fairly. A rank's exception fails the test with its traceback; a hang
fails it after ``timeout`` seconds instead of stalling the suite.
"""
from __future__ import annotations

import datetime
import io
import os
import queue
import traceback

import torch
import torch.multiprocessing as mp

from experiments.launch import free_port  # noqa: F401  (re-exported for the tests)


def _worker(rank, world, port, fn, args, results, collective_timeout):
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=collective_timeout))
        out = fn(rank, world, *args)
        # tensors travel as bytes: a queued tensor is a shared-memory handle that dies with its rank
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            # a rank that leaves while another is still connecting breaks that rank's init
            try:
                dist.barrier()
            except Exception:
                pass
            dist.destroy_process_group()


def run_distributed(fn, world: int, *args, timeout: float = 240.0, collective_timeout: float = 120.0):
    """Returns ``[fn(0, world, *args), ..., fn(world - 1, world, *args)]``."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, results, collective_timeout), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out, errors = {}, {}
    try:
        for _ in range(world):
            try:
                rank, status, value = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"{world - len(out) - len(errors)} of {world} ranks did not finish within {timeout}s")
            if status == "ok":
                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors[rank] = value
            if errors:
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        rank = min(errors)
        raise RuntimeError(f"rank {rank} failed:\n{errors[rank]}")
    return [out[r] for r in range(world)]
