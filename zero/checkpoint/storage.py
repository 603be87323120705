"""What DCP's files hold here: ``_Writer`` stores each item as its raw bytes, ``SafeReader`` reads
them back, and ``SafeUnpickler`` reads DCP's ``.metadata`` without running code from it."""

from __future__ import annotations

import json
import math
import os
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .integrity import META, _hasher


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
                self._write(f, raw)
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

    def _write(self, f, raw: memoryview) -> None:
        """The one place an item's bytes reach the file (the tests plant a full disk here)."""
        f.write(raw)
