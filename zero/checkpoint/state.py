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

DCP plans the save and the load (who writes which chunk, which saved chunks overlap a requested
one) and writes its ``.metadata`` as always; the bytes differ from DCP's default writer: each rank
writes one file ``__<rank>_0.distcp`` holding its items' raw bytes back to back (``_Writer``; DCP's
own writer runs every item through ``torch.save``, at about 0.2x of a plain write here), and reads
them back with ``SafeReader`` (a 1-D chunk's requested part straight into its destination).

Beside DCP's files a checkpoint directory holds ``meta.json`` (step, writer layout, optimizer, the
caller's ``extra``), any ``files`` the caller adds (e.g. the resolved config) and, written last by
rank 0 once every rank has written and fsynced, ``MANIFEST.json``: every file with its size and
XXH3-128 checksum (computed by each rank as it writes, gathered to rank 0; temp file, fsync,
rename, fsync of the directory). A directory without a manifest is incomplete; ``verify`` re-reads
every file against it (``verify_together``: every rank a share). Format 1 (``torch.save`` items,
SHA-256) is still read.

Loading never executes code from the checkpoint: items are raw bytes (format 1: DCP's
``torch.load(weights_only=True)``); the ``.metadata`` (a plain pickle, which torch's
``weights_only`` unpickler cannot parse: it lacks protocol 4's opcodes) goes through
``SafeUnpickler``, which resolves only DCP's metadata classes, ``torch.Size``, dtypes, layouts and
paths; byte items are refused.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import functools
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
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_items,
    _create_write_items,
    create_read_items_for_chunk_list,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

FORMAT = 2  # 2: raw item bytes, XXH3-128 checksums; 1 (still read): torch.save items, SHA-256
_READS = (1, 2)
MANIFEST = "MANIFEST.json"
META = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
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


def _hasher(algorithm: str = "xxh3_128"):
    if algorithm == "xxh3_128":
        import xxhash  # a dependency of the project (and of wandb); imported here so zero imports fast

        return xxhash.xxh3_128()
    if algorithm == "sha256":  # format-1 checkpoints
        return hashlib.sha256()
    raise ValueError(f"unknown checksum {algorithm!r}; this version checks xxh3_128 and sha256")


def file_digest(path: Path, algorithm: str = "xxh3_128") -> dict:
    """``{"size": bytes, algorithm: hex digest}`` of a file, read in 4 MiB pieces."""
    h = _hasher(algorithm)
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, algorithm: h.hexdigest()}


def _write_manifest(path: Path, known: dict | None = None) -> None:
    """Rank 0, once every rank's files and DCP's ``.metadata`` are on disk: the manifest, last.
    ``known``: size and checksum of files already digested (the ranks' data files, checksummed as
    they were written; the small files rank 0 wrote); every other file is read and digested here."""
    files = dict(known or {})
    for p in sorted(path.iterdir()):
        if p.is_file() and p.name != MANIFEST and not p.name.endswith(".tmp") and p.name not in files:
            files[p.name] = file_digest(p)
    write_durably(path / MANIFEST, json.dumps({"format": FORMAT, "files": files}, indent=0).encode())


def _digest_bytes(data: bytes) -> dict:
    h = _hasher()
    h.update(data)
    return {"size": len(data), "xxh3_128": h.hexdigest()}


def _checksum_of(want: dict) -> str:
    return "xxh3_128" if "xxh3_128" in want else "sha256"


def verify(path: str | os.PathLike, share: tuple[int, int] = (0, 1)) -> str | None:
    """None if ``path`` is a complete checkpoint whose every file matches the manifest's size and
    checksum; otherwise what is wrong, naming the file. ``share=(i, n)``: re-read only every n-th
    file from the i-th (the manifest itself and every file's size are checked whatever the share),
    so n ranks verify a checkpoint together, each reading 1/n of its bytes."""
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
    i, n = share
    # the shares by size, largest first, dealt round-robin: n ranks read about equal bytes
    for k, (name, want) in enumerate(sorted(files.items(), key=lambda kv: (-kv[1]["size"], kv[0]))):
        p = path / name
        if not p.is_file():
            return f"file {name} is missing"
        size = p.stat().st_size
        if size != want["size"]:
            return f"file {name} has {size} bytes, the manifest says {want['size']} (truncated or overwritten)"
        if k % n == i:
            algorithm = _checksum_of(want)
            if file_digest(p, algorithm)[algorithm] != want[algorithm]:
                return f"file {name} does not match its {algorithm} checksum in the manifest (corrupt)"
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
        for n in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    } | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module, name):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which a DCP metadata file "
            f"never holds; refusing to load it (it could run code)"
        )


class SafeReader(FileSystemReader):
    """DCP's file reader with the metadata unpickled by ``SafeUnpickler`` and, for format-2
    checkpoints, items read as the raw bytes ``_Writer`` wrote: a 1-D chunk's requested part is read
    straight into its destination (``readinto``, no temporary), anything else whole, then narrowed.
    Format 1 (``torch.save`` items) is read by DCP's own path (``torch.load(weights_only=True)``)."""

    def __init__(self, path, raw: bool | None = None):
        super().__init__(path)
        if raw is None:
            try:
                raw = json.loads((Path(path) / META).read_text()).get("format", 1) >= 2
            except (OSError, ValueError):
                raw = True
        self.raw = raw
        self._chunks: dict = {}

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

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._chunks = {}  # (key, chunk offsets) -> (chunk sizes, dtype)
        for key, md in metadata.state_dict_metadata.items():
            for c in getattr(md, "chunks", ()):
                self._chunks[(key, tuple(c.offsets))] = (tuple(c.sizes), md.properties.dtype)

    def read_data(self, plan: LoadPlan, planner) -> Future:
        if not self.raw:
            return super().read_data(plan, planner)
        per_file: dict[str, list] = {}
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                raise ValueError(f"checkpoint entry {req.storage_index.fqn} is not a tensor; refusing to read it")
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for name, reqs in per_file.items():
            if Path(name).name != name:  # the metadata names files beside it, nothing elsewhere
                raise ValueError(
                    f"checkpoint {self.path}: its metadata names the data file {name!r} outside "
                    f"the checkpoint directory; refusing to read it"
                )
            with open(Path(self.path) / name, "rb") as f:
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    self._read_item(f, name, req, planner)
        fut = Future()
        fut.set_result(None)
        return fut

    def _read_item(self, f, name: str, req, planner) -> None:
        info = self.storage_data[req.storage_index]
        sizes, dtype = self._chunks[(req.storage_index.fqn, tuple(req.storage_index.offset))]
        itemsize = dtype.itemsize
        if math.prod(sizes) * itemsize != info.length:
            raise ValueError(
                f"checkpoint {self.path}: {req.storage_index.fqn} has {info.length} bytes in {name}, "
                f"its metadata says {math.prod(sizes) * itemsize}"
            )
        target = planner.resolve_tensor(req).detach()
        if len(sizes) == 1 and target.is_contiguous() and target.device.type == "cpu":
            start, want = info.offset + req.storage_offsets[0] * itemsize, req.lengths[0] * itemsize
            f.seek(start)
            got = f.readinto(memoryview(target.reshape(-1).view(torch.uint8).numpy())) if want else 0
        else:
            f.seek(info.offset)
            buf = bytearray(info.length)
            want, got = info.length, f.readinto(buf)
            t = torch.frombuffer(buf, dtype=dtype).reshape(sizes) if info.length else torch.empty(sizes, dtype=dtype)
            for d, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                t = t.narrow(d, o, n)
            target.copy_(t)
        if got != want:
            raise ValueError(f"checkpoint {self.path}: {name} ends inside {req.storage_index.fqn} (truncated)")
        planner.commit_tensor(req, target)


class _Writer(FileSystemWriter):
    """DCP's file writer, storing each item as its raw bytes. DCP plans the save (which rank writes
    which chunk, replicas once) and writes the metadata as always; only the bytes of an item
    differ: DCP's own writer pickles every item through ``torch.save`` (a zip container per item,
    and a clone of every view so as not to save its whole storage), which ran at about 0.2x of a
    plain file write here. The file holds the items back to back, each at the offset and length
    its metadata entry gives (``_StorageInfo``), in the chunk's row-major order; ``SafeReader``
    reads them back. The rank checksums what it writes as it writes (XXH3-128): ``self.sums`` holds
    size and checksum of its file for the manifest."""

    def write_data(self, plan, planner):
        name = f"{plan.storage_data.prefix}0.distcp"
        h, results, offset = _hasher(), [], 0
        with open(Path(self.path) / name, "wb") as f:
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    raise ValueError(f"checkpoint entry {item.index.fqn} is not a tensor; only tensors are saved")
                t = planner.resolve_data(item).detach()
                t = t.cpu() if t.device.type != "cpu" else t
                raw = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
                f.write(raw)
                h.update(raw)
                results.append(
                    WriteResult(
                        index=item.index, size_in_bytes=len(raw), storage_data=_StorageInfo(name, offset, len(raw))
                    )
                )
                offset += len(raw)
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())
        self.sums = {name: {"size": offset, "xxh3_128": h.hexdigest()}}
        fut = Future()
        fut.set_result(results)
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
                items.append(
                    WriteItem(
                        index=dcp_md.MetadataIndex(key, offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=dcp_md.ChunkStorageMetadata(offsets=offsets, sizes=t.size()),
                            properties=dcp_md.TensorProperties.create_from_tensor(t),
                            size=torch.Size([numel]),
                        ),
                    )
                )
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
        raise ValueError(
            f"checkpoint entry {read_item.dest_index.fqn} holds pickled bytes where a tensor was "
            f"expected; refusing to unpickle it"
        )


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
            tensors[key] = f.master[s.shard_range[0] : s.shard_range[1]]
            chunks[key] = (_global_offset(s), math.prod(s.global_shape))
            tensors[SHAPE + s.name] = torch.tensor(s.global_shape, dtype=torch.int64)
        for _, a, b, t in f.shards:
            for skey, value in engine.optimizer.state.get(t, {}).items():
                for s in f.metadata(a, b):
                    key = f"{OPTIM}{skey}/{s.name}"
                    if _per_element(value, t):
                        tensors[key] = value[s.shard_range[0] : s.shard_range[1]]
                        chunks[key] = (_global_offset(s), math.prod(s.global_shape))
                    else:
                        scalar = (
                            value.detach().clone().cpu()
                            if isinstance(value, torch.Tensor)
                            else torch.tensor(float(value), dtype=torch.float64)
                        )
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


def verify_together(path: str | os.PathLike, group=None) -> str | None:
    """``verify`` by every rank of ``group`` at once, each re-reading its share of the files; the
    first problem any rank found (the same answer on every rank). A collective over ``group``."""
    if not _distributed(group):
        return verify(path)
    problems = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, verify(path, (_rank(group), len(problems))), group=group)
    return next((p for p in problems if p is not None), None)


def _agree(
    problem: str | None,
    group,
    elsewhere: str = "another rank could not load its part of the checkpoint (see its error)",
) -> None:
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
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    module="torch.distributed.checkpoint",
)


def _rank(group) -> int:
    """This process's rank in the checkpoint's group (every process of the group takes part)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def _distributed(group) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1


def _meta(engine, step: int, extra: dict | None) -> dict:
    L = engine.layout
    return {
        "format": FORMAT,
        "step": int(step),
        "engine_step": engine.step_count,
        "engine_skipped_steps": engine.skipped_steps,  # non-finite steps skipped so far (not in step_count)
        "layout": {
            "world": L.world,
            "pp": L.pp,
            "dp": L.dp,
            "ep": L.ep,
            "stage": engine.stage,
            "offload": engine.offload,
            "mixed_precision": engine.mixed_precision,
        },
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
    from ..layout import _collective_timeout_s

    t = timeout_s if timeout_s is not None else _collective_timeout_s
    return dist.new_group(backend="gloo", timeout=None if t is None else datetime.timedelta(seconds=t))


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
):
    """Save ``engine``'s state into the directory ``path`` (see the module docstring), complete
    with its manifest. A collective over ``group`` (default: every rank). Returns None once the
    checkpoint is complete on disk, or with ``async_save`` a future that completes then. An async save copies the state (``stager``, reused from save to save when given) and
    returns; the rest runs on ``executor`` (default: a thread of its own) while training goes on:
    the check that every weight is finite, the directory and ``meta.json``, DCP's planning, the
    writes and the manifest. ``after``: called on rank 0 once the checkpoint is complete (e.g. to
    prune older ones). A save that cannot be made (a non-finite weight, an unwritable directory)
    raises on every rank, from ``save`` or, async, from the future."""
    path = Path(path)
    rank = _rank(group)
    step = engine.step_count if step is None else step
    tensors, chunks, _ = _entries(engine, rank, rng)
    job = functools.partial(
        _write,
        chunks=chunks,
        path=path,
        meta=_meta(engine, step, extra),
        files=files,
        group=group,
        rank=rank,
        after=after,
    )
    if not async_save:
        job(tensors)
        return None
    staged = (stager or Stager()).stage(tensors)
    own = executor is None
    executor = executor or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
    fut = executor.submit(job, staged)
    if own:
        executor.shutdown(wait=False)
    return fut


def _finite(t: torch.Tensor) -> bool:
    """Every element finite. One min-max pass (NaN propagates into both, an infinity shows in one):
    about 40x faster here than ``isfinite(t).all()``, which writes a mask as large as ``t``."""
    if t.numel() == 0 or not t.is_floating_point():
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _write(tensors, *, chunks, path: Path, meta: dict, files, group, rank: int, after) -> None:
    problem = next(
        (
            f"refusing to save {path}: parameter {k[len(PARAM) :]} holds non-finite values on rank {rank}"
            for k in chunks
            if k.startswith(PARAM) and not _finite(tensors[k])
        ),
        None,
    )
    known = {}  # size and checksum of each file, for the manifest
    if rank == 0 and problem is None:
        try:
            if path.exists():  # an earlier attempt at this step: incomplete from here on, then gone
                (path / MANIFEST).unlink(missing_ok=True)
                shutil.rmtree(path)
            path.mkdir(parents=True)
            for name, content in {META: json.dumps(meta, indent=1), **(files or {})}.items():
                data = content.encode() if isinstance(content, str) else content
                write_durably(path / name, data)
                known[name] = _digest_bytes(data)
        except (OSError, TypeError, ValueError) as e:  # unwritable, or extra not JSON
            problem = f"cannot save {path}: {type(e).__name__}: {e}"
    # every rank raises if any cannot save; otherwise the directory is fresh before anyone writes
    _agree(problem, group, "another rank cannot save (see its error)")
    writer = _Writer(path, sync_files=True)
    dcp.save(
        tensors,
        storage_writer=writer,
        planner=_ChunkSavePlanner(chunks),
        process_group=group,
        no_dist=not _distributed(group),
    )
    # DCP's save returns once every rank has written and fsynced its file and rank 0 the metadata
    sums = [writer.sums]
    if _distributed(group):
        sums = [None] * dist.get_world_size(group)
        dist.all_gather_object(sums, writer.sums, group=group)
    problem = None
    if rank == 0:
        for s in sums:
            known.update(s)
        try:
            _write_manifest(path, known)
        except OSError as e:
            problem = f"cannot complete {path}: writing {MANIFEST} failed: {type(e).__name__}: {e}"
        if problem is None and after is not None:
            after()
    # the save returns on every rank once the checkpoint is complete (or raises on every rank)
    _agree(problem, group, f"rank 0 could not complete {path} (see its error)")


def finish(path: str | os.PathLike) -> None:
    """(Re)write the manifest of a checkpoint whose files are all on disk, digesting every file
    (``save`` writes it itself; this is for tools that change a checkpoint's files)."""
    _write_manifest(Path(path))


def read_meta(path: str | os.PathLike) -> dict:
    meta = json.loads((Path(path) / META).read_text())
    if meta.get("format") not in _READS:
        raise ValueError(
            f"checkpoint {path} has format {meta.get('format')!r}; this version reads formats {list(_READS)}"
        )
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
    dcp.load(
        tensors,
        storage_reader=reader,
        planner=_ChunkLoadPlanner(chunks),
        process_group=group,
        no_dist=not _distributed(group),
    )

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
    written). ``async_save``: ``save`` returns once the state is staged (copied into CPU buffers
    kept for the next save); the finiteness check, DCP's planning and the writes run in a background
    thread, and the manifest follows when every rank has written. A new save, ``latest`` and
    ``load`` first wait for the previous save. Construct on every rank (it creates a gloo group)."""

    def __init__(
        self,
        engine,
        root: str | os.PathLike,
        *,
        keep_last: int = 2,
        async_save: bool = False,
        rng: bool = True,
        group="new",
    ):
        if not isinstance(keep_last, int) or keep_last < 2:
            raise ValueError(
                f"keep_last={keep_last!r} must be an integer >= 2: the newest checkpoint is only "
                f"complete once written, so one older complete checkpoint must survive meanwhile"
            )
        self.engine = engine
        self.root = Path(root)
        self.keep_last = keep_last
        self.async_save = async_save
        self.rng = rng
        self.group = new_group() if group == "new" else group
        self.rank = _rank(self.group)
        self._pending = None  # (future, path) of an async save
        self._stager = Stager() if async_save else None
        self._executor = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint") if async_save else None
        )
        self.last_saved: Path | None = None

    def save(self, step: int, extra: dict | None = None, files: dict | None = None) -> Path:
        self.wait()
        path = step_dir(self.root, step)
        fut = save(
            self.engine,
            path,
            step=step,
            extra=extra,
            files=files,
            group=self.group,
            rng=self.rng,
            async_save=self.async_save,
            stager=self._stager,
            executor=self._executor,
            after=functools.partial(prune, self.root, self.keep_last),
        )
        if fut is None:
            self.last_saved = path
        else:
            self._pending = (fut, path)
        return path

    def wait(self) -> None:
        """Block until the pending async save (if any) is written, then complete it."""
        if self._pending is None:
            return
        fut, path = self._pending
        self._pending = None
        fut.result()
        self.last_saved = path

    def latest(self, check: bool = True, root: str | os.PathLike | None = None) -> Path | None:
        """The newest complete checkpoint under ``root`` (default: this checkpointer's), verified
        against its manifest by all ranks together (``verify_together``), skipping and naming broken
        ones (a warning on rank 0); the same on every rank; None if there is none."""
        self.wait()
        root = self.root if root is None else Path(root)
        found = [str(p) for _, p in list_checkpoints(root)] if self.rank == 0 else None
        if _distributed(self.group):  # rank 0's listing, so every rank walks the same candidates
            box = [found]
            dist.broadcast_object_list(
                box, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0, group=self.group
            )
            found = box[0]
        for path in map(Path, found):
            if check:
                problem = verify_together(path, self.group)
            else:
                problem = None if (path / MANIFEST).is_file() else f"no {MANIFEST}"
            if problem is None:
                return path
            if self.rank == 0:
                warnings.warn(f"skipping checkpoint {path}: {problem}; trying the next older one", stacklevel=2)
        return None

    def load(self, path: str | os.PathLike, check: bool = True) -> dict:
        self.wait()
        return load(self.engine, path, group=self.group, rng=self.rng, check=check)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
