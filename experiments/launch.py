"""Start benchmark and test ranks on one machine: a rendezvous port, and each rank's device and process group.

torch only (no hydra or wandb), so the benchmarks run on a GPU box that has just torch and triton.

The launching process serves the rendezvous (a ``TCPStore`` on a port the OS picks, as torchrun's
agent does) and the ranks join it as clients. The port is bound from the moment its number exists,
so no other process can take it in between: handing out the number of a port that was bound and
closed again (the old ``free_port``) left a window in which another process could bind it first,
and the launch then failed with "address already in use" or joined a stranger's store.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

import zero

# how long a rank waits for the others to reach the rendezvous (process start and imports of every
# rank, seconds each on a loaded machine); separate from the collective timeout, which is short
RENDEZVOUS_TIMEOUT_S = 600.0
_SERVED: list = []  # the stores rendezvous_port() serves, alive as long as this process


def start_rendezvous(timeout_s: float = RENDEZVOUS_TIMEOUT_S) -> dist.TCPStore:
    """A rendezvous store served by this process on 127.0.0.1 and a port the OS picks
    (``store.port``). Keep the object alive until every rank has joined; one store per launch (a
    second launch on the same store would find the first one's keys)."""
    return dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def rendezvous_port() -> int:
    """The port of a fresh rendezvous store served by this process until it exits; ranks join it
    with ``init_rank(rank, world, port)``."""
    store = start_rendezvous()
    _SERVED.append(store)
    return store.port


def init_process_group_on(
    port: int, rank: int, world: int, backend: str, timeout_s: float, rendezvous_timeout_s: float = RENDEZVOUS_TIMEOUT_S
) -> None:
    """Join the rendezvous store on ``port`` as a client and create the default process group
    (``zero.join_process_group``): a rank that starts late may take ``rendezvous_timeout_s``, the
    collectives then time out after ``timeout_s``."""
    long = datetime.timedelta(seconds=max(timeout_s, rendezvous_timeout_s))
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=long)
    zero.join_process_group(backend, timeout_s, rendezvous_timeout_s, store=store, rank=rank, world_size=world)


def init_rank(rank: int, world: int, port: int, timeout_s: float = 300.0) -> torch.device:
    """Join the process group (NCCL on CUDA, gloo on the CPU) through the rendezvous on ``port``
    (from ``rendezvous_port``) and return this rank's device; the CPU threads are split evenly
    between the ranks so they do not oversubscribe the cores."""
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    init_process_group_on(port, rank, world, backend, timeout_s)
    return device
