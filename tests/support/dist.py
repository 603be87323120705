"""Run a function on N gloo ranks on 127.0.0.1 and collect what each returns.

The function must live at module level. Ranks start from a fork server (multiprocessing's
``forkserver``): a process that has imported torch, numpy and Hydra once and has run no op, so no
OpenMP pool or other thread of torch's can be caught mid-lock by the fork (forking the test process
itself could deadlock). Each rank then imports only the test module and the project, not torch
again: about 2 s of CPU less per rank, a third of the distributed suite's CPU. A forked rank would
keep the server's environment, so it takes the test process's environment of the moment it starts
(``_worker``) before it imports anything of the project. Each rank runs with one intra-op thread, so 4 ranks share the
2 cores of the test machine fairly. A rank's exception fails the test with its traceback, a rank
that exits without returning fails it at once, and a hang fails it after ``timeout`` seconds
instead of stalling the suite.

Rendezvous: this (the test) process serves the store on a port the OS picks and every rank joins
it as a client, the way torchrun's agent does (``experiments.launch``): no port is chosen, closed
and handed out for another process to take first. The ranks wait for each other on a barrier once
their imports are done, and the process group connects under a long rendezvous timeout; only then
does the collective timeout (``collective_timeout``, short in the timeout tests) apply, so a rank
that starts seconds late no longer fails the others' start ("1/2 clients joined").
"""

from __future__ import annotations

import io
import os
import pickle
import queue
import time
import traceback

import torch
import torch.multiprocessing as mp

from experiments.launch import init_process_group_on, start_rendezvous

# "0" while pytest runs a test without the ``distributed`` marker (tests/conftest.py)
MARKED_ENV = "SWITCHYARD_TEST_DISTRIBUTED"


def require_distributed_marker(what: str) -> None:
    """Refuse to start processes from a test without ``@pytest.mark.distributed``: it would run under
    ``-m "not distributed"``, which promises the single-process suite."""
    if os.environ.get(MARKED_ENV) == "0":
        raise RuntimeError(f"{what} in a test without @pytest.mark.distributed: mark the test or its module")


class RankExited:
    """What ``run_distributed(..., allow_exit=True)`` returns for a rank that exited without returning."""

    def __init__(self, exitcode):
        self.exitcode = exitcode

    def __repr__(self):
        return f"RankExited(exitcode={self.exitcode})"


def _exit_with_parent(parent: int) -> None:
    """A rank outlives a pytest killed by a signal (daemon processes are reaped only on a normal
    exit) and would idle on its collective holding memory: it ends itself once the test process is
    gone (a forked rank's parent is the fork server, so the test process is watched by its pid)."""
    while True:
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            os._exit(1)
        time.sleep(1.0)


# what the fork server imports once (third-party only: the project's modules read the environment,
# TRITON_INTERPRET among it, when imported, so each rank imports them itself under the test's)
_PRELOAD = ["torch", "torch.distributed", "numpy", "omegaconf", "hydra"]
_context = None


def _rank_context():
    global _context
    if _context is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _context = ctx
    return _context


def _worker(rank, world, port, fn_env, args, results, collective_timeout, started, init, parent):
    # the test process's environment now, not the fork server's of when it started; then the test
    # module (fn is pickled by reference, so this unpickles it: imports it) under that environment
    fn_ref, env = fn_env
    os.environ.clear()
    os.environ.update(env)
    import pickle
    import threading

    import torch.distributed as dist

    fn = pickle.loads(fn_ref)

    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    torch.set_num_threads(1)
    # torchrun's environment, agent store included: a rank function may also initialise the process
    # group itself (init=False), e.g. through zero.init_distributed, and joins the same store
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    try:
        started.wait()  # every rank has finished its imports: the rendezvous starts together
        if init:
            init_process_group_on(port, rank, world, "gloo", collective_timeout)
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


def run_distributed(
    fn,
    world: int,
    *args,
    timeout: float = 240.0,
    collective_timeout: float = 120.0,
    init: bool = True,
    allow_exit: bool = False,
):
    """Returns ``[fn(0, world, *args), ..., fn(world - 1, world, *args)]``.

    ``init=False``: the ranks get torchrun's environment but no process group; ``fn`` creates it
    (``collective_timeout`` then is unused). ``allow_exit=True``: a rank that exits without a
    result gives ``RankExited(exitcode)`` instead of failing the call."""
    require_distributed_marker(f"run_distributed({getattr(fn, '__name__', fn)}, world={world})")
    ctx = _rank_context()
    results = ctx.Queue()
    started = ctx.Barrier(world)
    fn_env = (pickle.dumps(fn), dict(os.environ))
    store = start_rendezvous()  # served until the ranks are done
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world, store.port, fn_env, args, results, collective_timeout, started, init, os.getpid()),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out, errors, exited = {}, {}, {}
    deadline = time.monotonic() + timeout
    dead_since = {}
    try:
        while len(out) + len(errors) + len(exited) < world and not errors:
            try:
                rank, status, value = results.get(timeout=0.2)
            except queue.Empty:
                now = time.monotonic()
                for r, p in enumerate(procs):
                    if r in out or r in errors or r in exited or p.exitcode is None:
                        continue
                    # a rank's result is flushed to the queue before its process ends; give the
                    # pipe a moment before calling a finished rank's result lost
                    if now - dead_since.setdefault(r, now) > 3.0:
                        if not allow_exit:
                            raise RuntimeError(
                                f"rank {r} exited with code {p.exitcode} without returning a result "
                                f"(results so far from ranks {sorted(out)})"
                            ) from None
                        exited[r] = RankExited(p.exitcode)
                if now > deadline:
                    missing = world - len(out) - len(errors) - len(exited)
                    raise TimeoutError(f"{missing} of {world} ranks did not finish within {timeout}s") from None
                continue
            if status == "ok":
                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
                p.join()
        del store
    if errors:
        rank = min(errors)
        raise RuntimeError(f"rank {rank} failed:\n{errors[rank]}")
    out.update(exited)
    return [out[r] for r in range(world)]
