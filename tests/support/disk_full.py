"""A full disk for the checkpoint tests (tests/zero/test_checkpoint_disk.py): a planted ENOSPC in
the raw writer after a number of bytes, a real small tmpfs, and the rank function of the 2-rank test.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn as nn

from zero import Layout, ZeroEngine
from zero import checkpoint as zc
from zero.checkpoint import storage


@contextlib.contextmanager
def enospc_after(limit: int, when=lambda writer: True):
    """Every ``_Writer`` for which ``when(writer)`` holds writes at most ``limit`` bytes (counted
    over all of them), then meets ``OSError(ENOSPC)``, as a full filesystem answers ``write``."""
    original = storage._Writer._write
    written = [0]

    def write(self, f, raw):
        if not when(self):
            return original(self, f, raw)
        room = limit - written[0]
        if len(raw) > room:
            if room > 0:  # a full disk takes what fits, then refuses the rest
                original(self, f, raw[:room])
                written[0] += room
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written[0] += len(raw)
        return original(self, f, raw)

    storage._Writer._write = write
    try:
        yield written
    finally:
        storage._Writer._write = original


def engine(layout: Layout | None = None, stage: int = 0, width: int = 64) -> ZeroEngine:
    """A two-layer MLP under AdamW, trained one step (so its optimizer state exists)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
    eng = ZeroEngine(net, layout, stage=stage, optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-2))
    train(eng, 1)
    return eng


def train(eng: ZeroEngine, steps: int) -> None:
    width = eng.module[0].in_features
    for _ in range(steps):
        g = torch.Generator().manual_seed(100 + eng.step_count)
        x = torch.randn(8, width, generator=g)
        eng.backward((eng(x) ** 2).mean())
        eng.step()


def data_bytes(path: Path) -> int:
    """What ``CheckpointDiskFull.needed`` counts: every file but DCP's ``.metadata`` and the manifest."""
    return sum(p.stat().st_size for p in path.iterdir() if p.name not in (".metadata", zc.MANIFEST))


@contextlib.contextmanager
def small_tmpfs(size: str):
    """A tmpfs of ``size`` mounted on a fresh directory, or None where mounting is not permitted."""
    where = Path(tempfile.mkdtemp(prefix="ckpt-tmpfs-"))
    mounted = False
    try:
        if shutil.which("mount") and os.geteuid() == 0:
            r = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, timeout=30
            )
            mounted = r.returncode == 0
        yield where if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)
        shutil.rmtree(where, ignore_errors=True)


def two_rank_disk_full(rank, world, root, victim, async_save):
    """Two gloo ranks under stage 1: saves 1 and 2 complete, then rank ``victim``'s disk is full
    during save 3. Returns what each rank raised and saw."""
    torch.set_num_threads(1)
    layout = Layout.build(ep=1)
    eng = engine(layout, stage=1)
    ck = zc.Checkpointer(eng, root, keep_last=3, async_save=async_save)
    ck.save(1)
    train(eng, 1)
    ck.save(2)
    ck.wait()
    train(eng, 1)
    error = None
    with enospc_after(100 if rank == victim else 1 << 60):
        try:
            ck.save(3)
            train(eng, 1)
            ck.save(4)  # an async save's failure surfaces here
        except zc.CheckpointDiskFull as e:
            error = e
    latest = ck.latest()
    ck.close()
    return {
        "type": type(error).__name__,
        "message": str(error),
        "fields": None if error is None else (str(error.directory), error.needed, error.free),
        "latest": None if latest is None else latest.name,
        "dirs": sorted(p.name for p in Path(root).iterdir()),
    }
