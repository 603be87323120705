"""Several torchrun agents on this host as several "nodes" (``--nnodes``, c10d rendezvous), each
starting ``--nproc_per_node`` ranks of ``python -m experiments.train``: torchrun's own environment
(``LOCAL_WORLD_SIZE``, node-contiguous global ranks) as a multi-node job has it.

The rendezvous store is served here on a port the OS picks; every agent finds it taken and joins it
as a client (c10d's fallback), so no port is chosen and raced for. A test that calls this must be
marked ``@pytest.mark.distributed`` (tests/test_markers.py knows this helper's name).
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.dist import require_distributed_marker
from tests.support.paths import ROOT


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
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(nnodes)
    ]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:  # a hung agent (and its ranks) must not outlive the test
            if p.poll() is None:
                p.kill()
                p.wait()
        del store
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]
