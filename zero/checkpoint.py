"""Sharded checkpoints of a ``ZeroEngine``: every rank writes its own shards through
``torch.distributed.checkpoint`` (DCP), and any layout loads any other.

    ckpt = Checkpointer(engine, "runs/x/checkpoints", keep_last=3, async_save=True)
    path = ckpt.latest()                      # newest complete, verified checkpoint (or None)
    if path is not None:
        meta = ckpt.load(path)                # weights, optimizer state, buffers, RNG; meta["extra"]
    ...
    ckpt.save(step, extra={"data_step": step})  # returns once the state is staged (async) or written
    ckpt.close()                              # waits for the last save

What a checkpoint holds (keys of the DCP state dict; ``<name>`` is the model's parameter or buffer
name, e.g. ``blocks.3.moe.experts.w1``):

- ``param/<name>``: the fp32 master weights as the flattened GLOBAL parameter, a 1-D tensor of
  ``prod(global_shape)`` elements (an expert weight: all E experts, expert e at rows
  ``[e * rows, (e + 1) * rows)`` of the flat order). Each rank contributes the 1-D chunk it holds,
  at its global offset: the slice of the parameter inside its ZeRO shard (stages 1-3), or the
  whole parameter it holds (stage 0; experts: its ep slice at ``expert_offset``). Chunks may be any
  length; DCP stores each chunk with its offset and, at load, reads the overlap of the saved chunks
  with each chunk the loading rank asks for, so ZeRO stage, dp, ep and offload may all change.
- ``optim/<key>/<name>``: the optimizer's per-element state (AdamW's ``exp_avg``/``exp_avg_sq``,
  SGD's ``momentum_buffer``) chunked exactly like the weights, and its per-tensor scalars (``step``)
  as plain tensors.
- ``buffer/<name>``: every buffer of the model's ``state_dict`` (routers' expert biases), as is.
- ``shape/<name>``: each parameter's global shape (int64), for consolidation.
- ``rng/<rank>/...``: each rank's torch (CPU, CUDA) and Python RNG states.

Replicas (stage 0, or experts replicated over edp) hand DCP the same chunk at the same offset; DCP's
save planning keeps one copy, written by the least-loaded replica. Plain tensors (scalars, buffers,
shapes) are deduplicated the same way. Everything is keyed by parameter names, not by ranks, so a
pipeline stage that keeps the full model's names reshards across pp as well.

Beside DCP's files (``__<rank>_<n>.distcp`` and ``.metadata``) a checkpoint directory holds
``meta.json`` (step, writer layout, optimizer, the caller's ``extra``), any ``files`` the caller
adds (e.g. the resolved config), one ``__sums_<rank>.json`` per rank (size and SHA-256 of the files
that rank wrote, computed right after writing) and, written last, ``MANIFEST.json``: every file with
its size and SHA-256 (temp file, fsync, rename, fsync of the directory). A directory without a
manifest is incomplete; ``verify`` re-reads every file against it.

Loading never executes code from the checkpoint: DCP reads tensors with ``torch.load(weights_only=
True)``; its ``.metadata`` (a plain pickle, which torch's ``weights_only`` unpickler cannot parse:
it lacks protocol 4's opcodes) goes through ``SafeUnpickler``, which resolves only DCP's metadata
classes, ``torch.Size``, dtypes, layouts and paths; byte items are refused.
"""
from __future__ import annotations

import datetime
import hashlib
import io
import json
import math
import os
import pickle
import random
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_items,
    _create_write_items,
    create_read_items_for_chunk_list,
)

FORMAT = 1
MANIFEST = "MANIFEST.json"
META = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_SUMS = "__sums_{}.json"
PARAM, OPTIM, BUFFER, SHAPE, RNG = "param/", "optim/", "buffer/", "shape/", "rng/"


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


# ----- files: durable writes, digests, the manifest ----------------------------------------------
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a platform without directory descriptors
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """``data`` into ``path`` all or nothing: a temp file, fsync, rename, fsync of the directory."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def file_digest(path: Path) -> dict:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def _write_manifest(path: Path) -> None:
    """Rank 0, once every rank's files and DCP's ``.metadata`` are on disk: the manifest, last."""
    files = {}
    for sums in sorted(path.glob(_SUMS.format("*"))):
        files.update(json.loads(sums.read_text()))
    for p in sorted(path.iterdir()):
        if p.is_file() and p.name != MANIFEST and not p.name.endswith(".tmp") and p.name not in files:
            files[p.name] = file_digest(p)
    write_durably(path / MANIFEST, json.dumps({"format": FORMAT, "files": files}, indent=0).encode())


def verify(path: str | os.PathLike) -> str | None:
    """None if ``path`` is a complete checkpoint whose every file matches the manifest's size and
    SHA-256; otherwise what is wrong, naming the file."""
    path = Path(path)
    if not path.is_dir():
        return f"{path} is not a directory"
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} (the save did not finish)"
    except (ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    for needed in (META, ".metadata"):
        if needed not in files:
            return f"{MANIFEST} does not list {needed}"
    for name, want in files.items():
        p = path / name
        if not p.is_file():
            return f"file {name} is missing"
        size = p.stat().st_size
        if size != want["size"]:
            return f"file {name} has {size} bytes, the manifest says {want['size']} (truncated or overwritten)"
        if file_digest(p)["sha256"] != want["sha256"]:
            return f"file {name} does not match its SHA-256 in the manifest (corrupt)"
    return None


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step_<N>`` directory under ``root``, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def latest_complete(root: str | os.PathLike, check: bool = True) -> Path | None:
    """The newest checkpoint under ``root`` that ``verify`` accepts (only a manifest's presence with
    ``check=False``); each newer one that fails is skipped with a warning naming it and the file at
    fault. One process: see ``Checkpointer.latest`` for the agreed choice of all ranks."""
    for _, path in list_checkpoints(root):
        problem = verify(path) if check else (None if (path / MANIFEST).is_file() else f"no {MANIFEST}")
        if problem is None:
            return path
        warnings.warn(f"skipping checkpoint {path}: {problem}; trying the next older one", stacklevel=2)
    return None


def prune(root: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the ``keep_last`` newest complete checkpoints (a manifest present), and every
    incomplete one older than the newest complete; the newest complete one is never deleted."""
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last!r} must be >= 1")
    complete = [p for _, p in list_checkpoints(root) if (p / MANIFEST).is_file()]
    if not complete:
        return []
    newest = int(_STEP_DIR.match(complete[0].name).group(1))
    doomed = complete[keep_last:]
    doomed += [p for s, p in list_checkpoints(root) if s < newest and not (p / MANIFEST).is_file()]
    for p in doomed:
        (p / MANIFEST).unlink(missing_ok=True)  # incomplete first, so a crash mid-delete leaves no false "complete"
        shutil.rmtree(p, ignore_errors=True)
    return doomed


# ----- safe metadata ---------------------------------------------------------------------------
class SafeUnpickler(pickle.Unpickler):
    """Resolves only the globals a DCP ``.metadata`` needs; anything else (``os.system``,
    ``builtins.eval``, any class with a ``__reduce__`` of its choosing) is an UnpicklingError
    naming it, before anything is called."""

    _ALLOWED = {
        ("torch.distributed.checkpoint.metadata", n)
        for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                  "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
    } | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
         ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
         ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}

    def find_class(self, module, name):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which a DCP metadata file "
                                     f"never holds; refusing to load it (it could run code)")


class SafeReader(FileSystemReader):
    """DCP's file reader with the metadata unpickled by ``SafeUnpickler``."""

    def read_metadata(self, *args, **kwargs) -> dcp_md.Metadata:
        rank = kwargs.get("rank")
        with self.fs.create_stream(self._get_metadata_path(rank), "rb") as f:
            metadata = SafeUnpickler(f).load()
        if not isinstance(metadata, dcp_md.Metadata):
            raise pickle.UnpicklingError(f"{self.path}/.metadata holds a {type(metadata).__name__}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_md.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _Writer(FileSystemWriter):
    """DCP's file writer; after writing, each rank records size and SHA-256 of its own files."""

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        results = fut.wait()
        names = sorted({r.storage_data.relative_path for r in results})
        sums = {n: file_digest(Path(self.path) / n) for n in names}
        rank = self.rank if self.rank is not None else 0  # the rank in the checkpoint's group
        write_durably(Path(self.path) / _SUMS.format(rank), json.dumps(sums).encode())
        return fut


# ----- planners: 1-D chunks of flattened global tensors ----------------------------------------
class _ChunkSavePlanner(DefaultSavePlanner):
    """``chunks[key] = (global offset, global numel)``: the value under ``key`` is that 1-D chunk
    of a flattened global tensor. Every other key is an ordinary (replicated) tensor."""

    def __init__(self, chunks: dict[str, tuple[int, int]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = chunks

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, t in self.state_dict.items():
            if key in self.chunks:
                offset, numel = self.chunks[key]
                offsets = torch.Size([offset])
                items.append(WriteItem(
                    index=dcp_md.MetadataIndex(key, offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=dcp_md.ChunkStorageMetadata(offsets=offsets, sizes=t.size()),
                                                properties=dcp_md.TensorProperties.create_from_tensor(t),
                                                size=torch.Size([numel]))))
            else:
                items += _create_write_items(key, t)
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index):
        if index.fqn in self.chunks:
            return self.state_dict[index.fqn]
        return super().lookup_object(index)


class _ChunkLoadPlanner(DefaultLoadPlanner):
    def __init__(self, chunks: dict[str, tuple[int, int]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = chunks

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, t in self.state_dict.items():
            md = self.metadata.state_dict_metadata[key]  # present: checked before the load
            if key in self.chunks:
                chunk = dcp_md.ChunkStorageMetadata(offsets=torch.Size([self.chunks[key][0]]), sizes=t.size())
                items += create_read_items_for_chunk_list(key, md, [chunk])
            else:
                items += _create_read_items(key, md, t)
        return LoadPlan(items)

    def lookup_tensor(self, index):
        if index.fqn in self.chunks:
            return self.state_dict[index.fqn]
        return super().lookup_tensor(index)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        raise ValueError(f"checkpoint entry {read_item.dest_index.fqn} holds pickled bytes where a tensor was "
                         f"expected; refusing to unpickle it")


# ----- the engine's state as DCP entries -------------------------------------------------------
def _global_offset(s) -> int:
    """Where a ParamSlice's first element sits in the flattened global parameter."""
    if s.expert_offset is None:
        return s.param_range[0]
    return s.expert_offset * math.prod(s.shape[1:]) + s.param_range[0]


def _per_element(value, t: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == t.numel()


def _rng_entries(rank: int) -> dict[str, torch.Tensor]:
    out = {f"{RNG}{rank}/torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"{RNG}{rank}/cuda"] = torch.cuda.get_rng_state()
    version, state, gauss = random.getstate()
    out[f"{RNG}{rank}/python"] = torch.tensor([version, *state], dtype=torch.int64)
    out[f"{RNG}{rank}/python_gauss"] = torch.tensor([math.nan if gauss is None else gauss], dtype=torch.float64)
    return out


def _set_rng(values: dict[str, torch.Tensor], rank: int) -> None:
    p = f"{RNG}{rank}/"
    torch.set_rng_state(values[p + "torch"])
    if p + "cuda" in values and torch.cuda.is_available():
        torch.cuda.set_rng_state(values[p + "cuda"])
    if p + "python" in values:
        v = values[p + "python"].tolist()
        g = values[p + "python_gauss"].item()
        random.setstate((v[0], tuple(v[1:]), None if math.isnan(g) else g))


def _entries(engine, rank: int, rng: bool):
    """``(tensors, chunks, scalars)``: the state as DCP entries of views into the engine (no copy),
    the chunk map, and ``(key, tensor, state key)`` of each optimizer scalar (a fresh tensor, so a
    load can write it back into ``optimizer.state``)."""
    tensors, chunks, scalars = {}, {}, []
    for f in engine.flats:
        for s in f.metadata():  # the parameters inside this rank's master range
            key = PARAM + s.name
            tensors[key] = f.master[s.shard_range[0]:s.shard_range[1]]
            chunks[key] = (_global_offset(s), math.prod(s.global_shape))
            tensors[SHAPE + s.name] = torch.tensor(s.global_shape, dtype=torch.int64)
        for _, a, b, t in f.shards:
            for skey, value in engine.optimizer.state.get(t, {}).items():
                for s in f.metadata(a, b):
                    key = f"{OPTIM}{skey}/{s.name}"
                    if _per_element(value, t):
                        tensors[key] = value[s.shard_range[0]:s.shard_range[1]]
                        chunks[key] = (_global_offset(s), math.prod(s.global_shape))
                    else:
                        scalar = value.detach().clone().cpu() if isinstance(value, torch.Tensor) else torch.tensor(float(value), dtype=torch.float64)
                        tensors[key] = scalar
                        scalars.append((key, t, skey))
    for name, buf in _persistent_buffers(engine.module):
        tensors[BUFFER + name] = buf
    if rng:
        tensors.update(_rng_entries(rank))
    return tensors, chunks, scalars


def _persistent_buffers(module: torch.nn.Module):
    """``(name, buffer)`` of the buffers in the module's ``state_dict``. A non-persistent buffer is
    derived (rotary tables) or must be transient between steps (``MoELayer.load_since_update`` is
    zeroed by the bias update that ends each step), so it is not saved."""
    for mod_name, mod in module.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in mod._non_persistent_buffers_set:
                yield (f"{mod_name}.{name}" if mod_name else name), buf


@torch.no_grad()
def _init_optimizer_state(engine) -> None:
    """Create the optimizer's lazily built state (torch optimizers build it in their first step) by
    one step with zero gradients at lr 0, which leaves every weight as it is (weight decay is
    scaled by lr); the load then overwrites the state."""
    shards = [t for f in engine.flats for _, _, _, t in f.shards]
    if all(engine.optimizer.state.get(t) for t in shards):
        return
    lrs = [g["lr"] for g in engine.optimizer.param_groups]
    for g in engine.optimizer.param_groups:
        g["lr"] = 0.0
    for t in shards:
        t.grad = torch.zeros_like(t)
    try:
        engine.optimizer.step()
    finally:
        for t in shards:
            t.grad = None
        for g, lr in zip(engine.optimizer.param_groups, lrs):
            g["lr"] = lr


def _agree(problem: str | None, group, elsewhere: str = "another rank could not load its part of the checkpoint "
                                                          "(see its error)") -> None:
    """Raise on every rank if any rank has a problem (its own message where it has one), so no rank
    enters a collective the others have left."""
    if _distributed(group):
        flag = torch.tensor([0 if problem is None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item() and problem is None:
            problem = elsewhere
    if problem is not None:
        raise ValueError(problem)


# DCP warns on every single-process save and load (and again from an async save's thread) that it
# assumes one process, even when told so with ``no_dist=True``: noise for us, filtered for DCP only
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        module="torch.distributed.checkpoint")


def _rank(group) -> int:
    """This process's rank in the checkpoint's group (every process of the group takes part)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def _distributed(group) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1


def _meta(engine, step: int, extra: dict | None) -> dict:
    L = engine.layout
    return {
        "format": FORMAT, "step": int(step), "engine_step": engine.step_count,
        "engine_skipped_steps": engine.skipped_steps,  # non-finite steps skipped so far (not in step_count)
        "layout": {"world": L.world, "pp": L.pp, "dp": L.dp, "ep": L.ep, "stage": engine.stage,
                   "offload": engine.offload, "mixed_precision": engine.mixed_precision},
        "optimizer": type(engine.optimizer).__name__,
        "torch": torch.__version__,
        "extra": extra or {},
    }


def new_group(timeout_s: float | None = None):
    """A gloo group over every rank for checkpoint traffic (None on one process): DCP's planning
    collectives then never interleave with the training's, which an async save needs, and work on
    CPU tensors whatever the training backend. A collective: every rank must call it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    from .layout import _collective_timeout_s

    t = timeout_s if timeout_s is not None else _collective_timeout_s
    return dist.new_group(backend="gloo", timeout=None if t is None else datetime.timedelta(seconds=t))


def save(engine, path: str | os.PathLike, *, step: int | None = None, extra: dict | None = None,
         files: dict[str, str | bytes] | None = None, group=None, rng: bool = True, async_save: bool = False):
    """Save ``engine``'s state into the directory ``path`` (see the module docstring). A collective
    over ``group`` (default: every rank). Returns None, or with ``async_save`` a future that
    completes once every rank has written; the state is copied (staged) before this returns, so
    training may go on. Rank 0 writes the manifest when the save completes (``Checkpointer`` does;
    a direct caller calls ``finish(path)`` on rank 0 after the future)."""
    path = Path(path)
    rank = _rank(group)
    step = engine.step_count if step is None else step
    tensors, chunks, _ = _entries(engine, rank, rng)
    problem = next((f"refusing to save {path}: parameter {k[len(PARAM):]} holds non-finite values on rank {rank}"
                    for k in chunks if k.startswith(PARAM) and not torch.isfinite(tensors[k]).all()), None)
    if rank == 0 and problem is None:
        try:
            if path.exists():  # an earlier attempt at this step: incomplete from here on, then gone
                (path / MANIFEST).unlink(missing_ok=True)
                shutil.rmtree(path)
            path.mkdir(parents=True)
            write_durably(path / META, json.dumps(_meta(engine, step, extra), indent=1).encode())
            for name, content in (files or {}).items():
                write_durably(path / name, content.encode() if isinstance(content, str) else content)
        except (OSError, TypeError, ValueError) as e:  # unwritable, or extra not JSON
            problem = f"cannot save {path}: {type(e).__name__}: {e}"
    # every rank raises if any cannot save; otherwise the directory is fresh before anyone writes
    _agree(problem, group, "another rank cannot save (see its error)")
    kw = dict(storage_writer=_Writer(path, sync_files=True), planner=_ChunkSavePlanner(chunks), process_group=group,
              no_dist=not _distributed(group))
    if async_save:
        return dcp.async_save(tensors, **kw)
    dcp.save(tensors, **kw)
    return None


def finish(path: str | os.PathLike) -> None:
    """Rank 0, after a save has completed on every rank: write the manifest (the checkpoint is
    complete from then on)."""
    _write_manifest(Path(path))


def read_meta(path: str | os.PathLike) -> dict:
    meta = json.loads((Path(path) / META).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"checkpoint {path} has format {meta.get('format')!r}; this version reads format {FORMAT}")
    return meta


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
    elif check and rank == 0:
        bad = verify(path)
        problem = None if bad is None else f"checkpoint {path} is incomplete or corrupt: {bad}"
    _agree(problem, group)
    meta = read_meta(path)
    reader = SafeReader(path)
    saved = reader.read_metadata().state_dict_metadata

    has_optim = any(k.startswith(OPTIM) for k in saved)
    if has_optim:
        _init_optimizer_state(engine)
    tensors, chunks, scalars = _entries(engine, rank, rng=False)
    if not has_optim:
        tensors = {k: v for k, v in tensors.items() if not k.startswith(OPTIM)}
        scalars = []
    if rng and f"{RNG}{rank}/torch" in saved:
        # the saver's rank r state for rank r (same world size: an exact continuation)
        rng_now = {k: v.clone() for k, v in _rng_entries(rank).items() if k in saved}
        tensors.update(rng_now)
    problem = _check_against(tensors, chunks, saved, meta, path)
    _agree(problem, group)
    dcp.load(tensors, storage_reader=reader, planner=_ChunkLoadPlanner(chunks), process_group=group,
             no_dist=not _distributed(group))

    problem = None
    for f in engine.flats:  # shapes, not only sizes, must agree
        for s in f.metadata():
            got = tuple(tensors[SHAPE + s.name].tolist())
            if got != tuple(s.global_shape) and problem is None:
                problem = f"checkpoint {path}: parameter {s.name} has shape {list(got)}, the model's is {list(s.global_shape)}"
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
            return (f"checkpoint {path} (optimizer {meta['optimizer']}) has no optimizer state {opt[0]!r}"
                    f"{f' (and {len(opt) - 1} more)' if len(opt) > 1 else ''}: resume with the optimizer it was saved with")
        return (f"checkpoint {path} has no {missing[0]!r}{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}: "
                f"it was saved from another model")
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
    for f in engine.flats:
        if f.separate_master:
            f.own_compute.copy_(f.master)
    handles = [h for h in (f.launch_param_gather() for f in engine.flats) if h is not None]
    for h in handles:
        h.wait()
    if engine.stage == 3:
        for f in engine.flats:
            f.free_params()


# ----- the driver: periodic saves, keep_last, async, resume ------------------------------------
class Checkpointer:
    """Saves ``engine`` under ``root/step_<N>`` and finds the newest complete one.

    ``keep_last`` (>= 2): complete checkpoints to keep (an older one survives while the newest is
    written). ``async_save``: ``save`` returns once the state is staged (copied to CPU memory); the
    files are written in a background thread and the manifest follows when every rank has written.
    A new save first waits for the previous one. Construct on every rank (it creates a gloo group)."""

    def __init__(self, engine, root: str | os.PathLike, *, keep_last: int = 2, async_save: bool = False,
                 rng: bool = True, group="new"):
        if not isinstance(keep_last, int) or keep_last < 2:
            raise ValueError(f"keep_last={keep_last!r} must be an integer >= 2: the newest checkpoint is only "
                             f"complete once written, so one older complete checkpoint must survive meanwhile")
        self.engine = engine
        self.root = Path(root)
        self.keep_last = keep_last
        self.async_save = async_save
        self.rng = rng
        self.group = new_group() if group == "new" else group
        self.rank = _rank(self.group)
        self._pending = None  # (future, path) of an async save
        self.last_saved: Path | None = None

    def save(self, step: int, extra: dict | None = None, files: dict | None = None) -> Path:
        self.wait()
        path = step_dir(self.root, step)
        fut = save(self.engine, path, step=step, extra=extra, files=files, group=self.group, rng=self.rng,
                   async_save=self.async_save)
        if fut is None:
            self._finish(path)
        else:
            self._pending = (fut, path)
        return path

    def _finish(self, path: Path) -> None:
        if self.rank == 0:
            finish(path)
            prune(self.root, self.keep_last)
        self.last_saved = path

    def wait(self) -> None:
        """Block until the pending async save (if any) is written, then complete it."""
        if self._pending is None:
            return
        fut, path = self._pending
        self._pending = None
        fut.result()
        self._finish(path)

    def latest(self, check: bool = True, root: str | os.PathLike | None = None) -> Path | None:
        """The newest complete checkpoint under ``root`` (default: this checkpointer's), verified
        against its manifest on rank 0, skipping and naming broken ones; the same on every rank;
        None if there is none."""
        root = self.root if root is None else Path(root)
        found = latest_complete(root, check) if self.rank == 0 else None
        if _distributed(self.group):
            step = torch.tensor([-1 if found is None else int(_STEP_DIR.match(found.name).group(1))], dtype=torch.int64)
            dist.broadcast(step, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0, group=self.group)
            found = None if step.item() < 0 else step_dir(root, int(step.item()))
        return found

    def load(self, path: str | os.PathLike, check: bool = True) -> dict:
        return load(self.engine, path, group=self.group, rng=self.rng, check=check)

    def close(self) -> None:
        self.wait()
