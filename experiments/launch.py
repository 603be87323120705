"""Start benchmark ranks on one machine: a free port, and each rank's device and process group.

torch only (no hydra or wandb), so the benchmarks run on a GPU box that has just torch and triton.
"""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, world: int, port: int, timeout_s: float = 300.0) -> torch.device:
    """Join the process group (NCCL on CUDA, gloo on the CPU) and return this rank's device; the
    CPU threads are split evenly between the ranks so they do not oversubscribe the cores."""
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    return device
