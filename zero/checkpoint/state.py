"""A ``ZeroEngine``'s state as DCP entries, and ``save``/``load`` of it: every rank writes the
chunks it holds and reads the ones it needs, whatever layout saved them."""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.api import CheckpointException

from ..nvme import FileEntries
from .entries import (
    OPTIM,
    PARAM,
    RNG,
    SHAPE,
    _entries,
    _init_optimizer_state,
    _meta,
    _rng_entries,
    _set_rng,
    _share_bytes,
    _warn_once,
)
from .group import _agree, _distributed, _rank
from .integrity import (
    MANIFEST,
    META,
    CheckpointDiskFull,
    _digest_bytes,
    _is_disk_full,
    _write_manifest,
    list_checkpoints,
    read_meta,
    verify_together,
    write_durably,
)
from .planners import _ChunkLoadPlanner, _ChunkSavePlanner
from .storage import SafeReader, _Writer


class Stager:
    """Copies of a state (the DCP entries of ``_entries``) into buffers that are kept from one save
    to the next: after the first save, staging is one copy into warm memory (no allocation, no page
    faults). GPU tensors go to pinned memory. Holds one CPU copy of the rank's checkpoint state."""

    def __init__(self):
        self._bufs: dict[str, torch.Tensor] = {}

    def stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out, cuda = {}, False
        for key, t in tensors.items():
            buf = self._bufs.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = self._bufs[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            buf.copy_(t.detach(), non_blocking=t.is_cuda)
            cuda |= t.is_cuda
            out[key] = buf
        if cuda:
            torch.cuda.synchronize()
        return out


def save(
    engine,
    path: str | os.PathLike,
    *,
    step: int | None = None,
    extra: dict | None = None,
    files: dict[str, str | bytes] | None = None,
    group=None,
    rng: bool = True,
    async_save: bool = False,
    stager: Stager | None = None,
    executor: concurrent.futures.Executor | None = None,
    after=None,
    warn_room_for: int | None = None,
):
    """Save ``engine``'s state into the directory ``path`` (see ``zero.checkpoint``'s docstring),
    complete with its manifest. A collective over ``group`` (default: every rank). Returns None once
    the checkpoint is complete on disk, or with ``async_save`` a future that completes then. An
    async save copies the state (``stager``, reused from save to save when given) and returns; the
    rest runs on ``executor`` (default: a thread of its own) while training goes on:
    the check that every weight is finite, the directory and ``meta.json``, DCP's planning, the
    writes and the manifest. ``after``: called on rank 0 once the checkpoint is complete (e.g. to
    prune older ones). A save that cannot be made (a non-finite weight, an unwritable directory)
    raises on every rank, from ``save`` or, async, from the future; one that meets a full disk
    removes what it wrote and raises ``CheckpointDiskFull`` (the directory, the bytes it needs, the
    bytes free) on every rank. ``warn_room_for=n``: warn (rank 0) when the filesystem cannot hold
    ``n`` checkpoints of this size, counting the ones already under ``path``'s parent."""
    path = Path(path)
    rank = _rank(group)
    step = engine.step_count if step is None else step
    counted: set = set()
    offload = getattr(engine, "_nvme", None)
    in_files = None if offload is None else FileEntries(offload)
    tensors, chunks, _ = _entries(engine, rank, rng, counted, in_files)
    snapshot = None
    if in_files is not None and async_save:
        # staging would copy the whole offloaded state into RAM, which the offload exists to avoid:
        # the files are copied beside themselves instead, and the save reads the copy
        snapshot = offload.snapshot()
        if snapshot is None:
            _warn_once(
                f"async_save with offload='nvme': offload_dir={offload.directory} has no room for a copy of "
                f"the offload files ({offload.need} bytes), so this save runs synchronously, reading the "
                f"state from the offload files one item at a time"
            )
            async_save = False
        else:
            in_files.offload = snapshot
    job = functools.partial(
        _write,
        chunks=chunks,
        path=path,
        meta=_meta(engine, step, extra),
        files=files,
        group=group,
        rank=rank,
        after=after,
        share=_share_bytes(tensors, counted),
        warn_room_for=warn_room_for,
        in_files=in_files,
    )
    if not async_save:
        job(tensors)
        return None
    staged = (stager or Stager()).stage({k: v for k, v in tensors.items() if in_files is None or k not in in_files})
    if in_files is not None:
        staged.update((k, v) for k, v in tensors.items() if k in in_files)  # meta: read from the snapshot
        job = functools.partial(_closing, job, snapshot)
    own = executor is None
    executor = executor or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
    fut = executor.submit(job, staged)
    if own:
        executor.shutdown(wait=False)
    return fut


def _closing(job, snapshot, tensors) -> None:
    """``job(tensors)``, then the snapshot of the offload files it read is closed (its space freed)."""
    try:
        job(tensors)
    finally:
        snapshot.close()


def _finite(t: torch.Tensor) -> bool:
    """Every element finite. One min-max pass (NaN propagates into both, an infinity shows in one):
    about 40x faster here than ``isfinite(t).all()``, which writes a mask as large as ``t``."""
    if t.numel() == 0 or not t.is_floating_point():
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _write(
    tensors,
    *,
    chunks,
    path: Path,
    meta: dict,
    files,
    group,
    rank: int,
    after,
    share: int = 0,
    warn_room_for=None,
    in_files=None,
) -> None:
    def value(k):
        return in_files.read(k) if in_files is not None and k in in_files else tensors[k]

    problem = next(
        (
            f"refusing to save {path}: parameter {k[len(PARAM) :]} holds non-finite values on rank {rank}"
            for k in chunks
            if k.startswith(PARAM) and not _finite(value(k))
        ),
        None,
    )
    known = {}  # size and checksum of each file, for the manifest
    small = {META: json.dumps(meta, indent=1), **(files or {})}
    small = {name: c.encode() if isinstance(c, str) else c for name, c in small.items()}
    if rank == 0:
        share += sum(len(c) for c in small.values() if isinstance(c, bytes))
    full = False  # this rank met a full disk
    if rank == 0 and problem is None:
        try:
            if path.exists():  # an earlier attempt at this step: incomplete from here on, then gone
                (path / MANIFEST).unlink(missing_ok=True)
                shutil.rmtree(path)
            path.mkdir(parents=True)
            for name, data in small.items():
                write_durably(path / name, data)
                known[name] = _digest_bytes(data)
        except (OSError, TypeError, ValueError) as e:  # unwritable, or extra not JSON
            full = _is_disk_full(e)
            problem = None if full else f"cannot save {path}: {type(e).__name__}: {e}"
    # every rank raises if any cannot save; otherwise the directory is fresh before anyone writes.
    # The same all-reduce sums what each rank will write (and counts full disks)
    need, full = _agree(problem, group, "another rank cannot save (see its error)", count=(share, full))
    if full:
        _disk_full(path, need, group, rank)
    if rank == 0 and warn_room_for:
        _warn_room(path, need, warn_room_for)
    writer = _Writer(path, sync_files=True)
    try:
        dcp.save(
            tensors,
            storage_writer=writer,
            planner=_ChunkSavePlanner(chunks, in_files),
            process_group=group,
            no_dist=not _distributed(group),
        )
    except CheckpointException as e:
        # DCP gathers every rank's failure into the exception each rank raises: the same choice everywhere
        if not any(_is_disk_full(exc) for exc, _ in e.failures.values()):
            raise
        _disk_full(path, need, group, rank)
    # DCP's save returns once every rank has written and fsynced its file and rank 0 the metadata
    sums = [writer.sums]
    if _distributed(group):
        sums = [None] * dist.get_world_size(group)
        dist.all_gather_object(sums, writer.sums, group=group)
    problem, full = None, False
    if rank == 0:
        for s in sums:
            known.update(s)
        try:
            _write_manifest(path, known)
        except OSError as e:
            full = _is_disk_full(e)
            problem = None if full else f"cannot complete {path}: writing {MANIFEST} failed: {type(e).__name__}: {e}"
        if problem is None and not full and after is not None:
            after()
    # the save returns on every rank once the checkpoint is complete (or raises on every rank)
    if _agree(problem, group, f"rank 0 could not complete {path} (see its error)", count=full):
        _disk_full(path, need, group, rank)


def _disk_full(path: Path, need: int, group, rank: int) -> None:
    """After a rank met a full disk, on every rank: rank 0 removes the partial checkpoint (every rank
    is past its writes: DCP's collective or the agreement saw them all), measures what is free and
    tells the others; all raise ``CheckpointDiskFull``."""
    free = 0
    if rank == 0:
        (path / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
        free = _free_bytes(path)
    free = _agree(None, group, count=free)
    complete = [p for _, p in list_checkpoints(path.parent) if (p / MANIFEST).is_file()]
    raise CheckpointDiskFull(path, need, free, complete)


def _free_bytes(path: Path) -> int:
    """Free bytes on the filesystem of ``path`` (or of its nearest existing parent)."""
    for p in (path, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return 0


def _warn_room(path: Path, need: int, room_for: int) -> None:
    """Warn when ``room_for`` checkpoints of ``need`` bytes do not fit in what is free plus the
    checkpoints already under ``path``'s parent (which pruning will reclaim)."""
    held = 0
    for _, p in list_checkpoints(path.parent):
        if p != path:
            held += sum(f.stat().st_size for f in p.iterdir() if f.is_file())
    free = _free_bytes(path)
    if free + held < room_for * need:
        warnings.warn(
            f"checkpoint directory {path.parent}: {free} bytes are free (and {held} held by older "
            f"checkpoints), but keep_last + 1 = {room_for} checkpoints of {need} bytes need "
            f"{room_for * need}: a save will meet a full disk",
            stacklevel=3,
        )


@torch.no_grad()
def load(engine, path: str | os.PathLike, *, group=None, rng: bool = True, check: bool = True) -> dict:
    """Restore ``engine`` (weights, optimizer state, step count, buffers, this rank's RNG when the
    checkpoint has it) from ``path``, saved under any layout; returns its ``meta.json`` (``extra``
    holds what the saver passed). ``check``: rank 0 first verifies every file against the manifest.
    A collective over ``group``. A missing or corrupt checkpoint, a parameter, buffer or optimizer
    state the checkpoint lacks, or one of another size is a ValueError naming it, raised on every
    rank before any data is read."""
    path = Path(path)
    rank = _rank(group)
    problem = None
    if not path.is_dir():
        problem = f"checkpoint {path} does not exist"
    elif check:
        bad = verify_together(path, group)
        problem = None if bad is None else f"checkpoint {path} is incomplete or corrupt: {bad}"
    _agree(problem, group)
    meta = read_meta(path)
    reader = SafeReader(path)
    saved = reader.read_metadata().state_dict_metadata

    has_optim = any(k.startswith(OPTIM) for k in saved)
    if has_optim:
        _init_optimizer_state(engine)
    offload = getattr(engine, "_nvme", None)
    in_files = None if offload is None else FileEntries(offload)
    tensors, chunks, scalars = _entries(engine, rank, rng=False, in_files=in_files)
    if not has_optim:
        tensors = {k: v for k, v in tensors.items() if not k.startswith(OPTIM)}
        scalars = []
    if rng and f"{RNG}{rank}/torch" in saved:
        # the saver's rank r state for rank r (same world size: an exact continuation)
        rng_now = {k: v.clone() for k, v in _rng_entries(rank).items() if k in saved}
        tensors.update(rng_now)
    problem = _check_against(tensors, chunks, saved, meta, path)
    _agree(problem, group)
    dcp.load(
        tensors,
        storage_reader=reader,
        planner=_ChunkLoadPlanner(chunks, in_files),
        process_group=group,
        no_dist=not _distributed(group),
    )

    problem = None
    for f in engine.flats:  # shapes, not only sizes, must agree
        for s in f.metadata():
            got = tuple(tensors[SHAPE + s.name].tolist())
            if got != tuple(s.global_shape) and problem is None:
                problem = (
                    f"checkpoint {path}: parameter {s.name} has shape {list(got)}, "
                    f"the model's is {list(s.global_shape)}"
                )
    _agree(problem, group)
    for key, t, skey in scalars:
        current = engine.optimizer.state[t][skey]
        if isinstance(current, torch.Tensor):
            current.copy_(tensors[key])
        else:
            engine.optimizer.state[t][skey] = type(current)(tensors[key].item())
    if rng and f"{RNG}{rank}/torch" in tensors:
        _set_rng(tensors, rank)
    engine.step_count = int(meta["engine_step"])
    engine.skipped_steps = int(meta.get("engine_skipped_steps", 0))
    _refresh_compute_weights(engine)
    return meta


def read_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor]) -> None:
    """One process: fill each tensor of ``tensors`` (the key's whole saved tensor, e.g. a full
    flattened parameter) from the checkpoint, assembling it from every chunk any rank wrote."""
    dcp.load(tensors, storage_reader=SafeReader(path), planner=_ChunkLoadPlanner({}), no_dist=True)


def _check_against(tensors, chunks, saved, meta, path) -> str | None:
    missing = [k for k in tensors if k not in saved]
    if missing:
        opt = [k for k in missing if k.startswith(OPTIM)]
        if opt:
            return (
                f"checkpoint {path} (optimizer {meta['optimizer']}) has no optimizer state {opt[0]!r}"
                f"{f' (and {len(opt) - 1} more)' if len(opt) > 1 else ''}: resume with the optimizer it was saved with"
            )
        return (
            f"checkpoint {path} has no {missing[0]!r}{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}: "
            f"it was saved from another model"
        )
    for k, t in tensors.items():
        md = saved[k]
        if not isinstance(md, dcp_md.TensorStorageMetadata):
            return f"checkpoint {path}: {k!r} is not a tensor there; refusing to unpickle it"
        want = torch.Size([chunks[k][1]]) if k in chunks else t.size()
        if md.size != want:
            return f"checkpoint {path}: {k!r} has size {list(md.size)}, the model needs {list(want)}"
    return None


@torch.no_grad()
def _refresh_compute_weights(engine) -> None:
    """After new master weights: the compute weights from them, every replica's full weights
    (stages 1-2, as after a step), and stage 3's gathered blocks are stale."""
    if getattr(engine, "_nvme", None) is not None:
        engine._nvme.refresh_compute()  # streamed from the files
    for f in engine.flats:
        if f.separate_master and f.master is not None:
            f.own_compute.copy_(f.master)
    handles = [h for h in (f.launch_param_gather() for f in engine.flats) if h is not None]
    for h in handles:
        h.wait()
    if engine.stage == 3:
        for f in engine.flats:
            f.free_params()
