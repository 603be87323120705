"""Several torchrun agents on this host as several "nodes" (``--nnodes``, c10d rendezvous), each
starting ``--nproc_per_node`` ranks of ``python -m experiments.train``: torchrun's own environment
(``LOCAL_WORLD_SIZE``, node-contiguous global ranks) as a multi-node job has it.

The rendezvous store is served here on a port the OS picks; every agent finds it taken and joins it
as a client (c10d's fallback), so no port is chosen and raced for. A test that calls this must be
marked ``@pytest.mark.distributed`` (tests/test_markers.py knows this helper's name).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time

from tests.support.dist import require_distributed_marker
from tests.support.paths import ROOT


def _kill_group(p: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone, with its ranks
        os.killpg(p.pid, signal.SIGKILL)


def run_torchrun_nodes(
    args: list[str], *, nnodes: int, nproc_per_node: int, rdzv_id: str, timeout: float = 300
) -> list[tuple[int, str, str]]:
    """``(returncode, stdout, stderr)`` of each agent after ``experiments.train args`` ran to its end."""
    require_distributed_marker("run_torchrun_nodes")
    from experiments.launch import start_rendezvous

    store = start_rendezvous()
    env = dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc_per_node={nproc_per_node}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{store.port}",
        f"--rdzv_id={rdzv_id}",
        "-m",
        "experiments.train",
        *args,
    ]
    # each agent writes to files, not pipes: a pipe read one agent after the other fills up for
    # the agent not being read (64 KiB: a few screens of its ranks' warnings) and blocks its ranks
    # in a write, the other agent's ranks in the next collective, and the test on the first agent.
    # Each agent leads a process group of its own, so a hung one is killed with its ranks
    files = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(nnodes)]
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
        for out, err in files
    ]
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                for q in procs:
                    _kill_group(q)
                    q.wait()
                tails = [
                    f"--- agent {i} (exit {q.returncode}) stdout:\n{out[-2000:]}\n--- stderr:\n{err[-6000:]}"
                    for i, (q, (out, err)) in enumerate(zip(procs, _read(files)))
                ]
                raise TimeoutError(
                    f"{nnodes} torchrun agents did not finish within {timeout:g} s: {' '.join(cmd)}\n"
                    + "\n".join(tails)
                ) from None
        outs = _read(files)
    finally:
        for p in procs:  # a hung agent (and its ranks) must not outlive the test
            if p.poll() is None:
                _kill_group(p)
                p.wait()
        for out, err in files:
            out.close()
            err.close()
        del store
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def _read(files) -> list[tuple[str, str]]:
    got = []
    for out, err in files:
        out.seek(0)
        err.seek(0)
        got.append((out.read(), err.read()))
    return got
