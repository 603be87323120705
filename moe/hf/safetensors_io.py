"""safetensors files in and out, tensor by tensor, for any set of named tensors: ``TensorSource``
(tensors to read one at a time), ``SafetensorsFiles`` (a file or a checkpoint directory, read
lazily), ``write_safetensors`` (one file, written as its tensors come) and ``write_sharded`` (a
directory of shards of at most ``max_shard_bytes`` and their index, as the Hub lays them out).

Reading needs the ``safetensors`` package (imported when a file is opened); writing does not (the
format is an 8-byte header length, a JSON header, the raw little-endian bytes).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

DEFAULT_SHARD_BYTES = 5 * 10**9  # the Hub's usual shard size
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class TensorSource:
    """Named tensors to read from, one at a time: ``keys()``, ``meta(name)`` (a meta tensor of its
    shape and dtype, read from metadata only), ``get(name, lo, hi)`` (the tensor, or the slice
    ``[lo:hi]`` of dimension 0). This one wraps a state dict; ``SafetensorsFiles`` reads safetensors
    files lazily, and ``experiments.checkpoint`` reads a sharded training checkpoint parameter by
    parameter."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self._state = state

    def keys(self):
        return self._state.keys()

    def __contains__(self, name):
        return name in self._state

    def meta(self, name: str) -> torch.Tensor:
        t = self._state[name]
        return torch.empty(t.shape, dtype=t.dtype, device="meta")

    def _tensor(self, name: str, lo: int | None, hi: int | None) -> torch.Tensor:
        t = self._state[name]
        return t if lo is None else t[lo:hi]

    def get(self, name: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        if name not in self:
            raise KeyError(f"the checkpoint has no tensor {name}")
        return self._tensor(name, lo, hi)


_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH_DTYPES = {v: k for k, v in _SAFETENSORS_DTYPES.items()}


class SafetensorsFiles(TensorSource):
    """The tensors of a safetensors file, or of a directory's ``model.safetensors`` or of the shards
    its index lists, read lazily (a slice of dimension 0 reads only that slice)."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        path = Path(path)
        index, single = path / INDEX, path / SINGLE
        if path.is_file():
            path, files = path.parent, [path.name]
        elif index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif single.exists():
            files = [single.name]
        else:
            found = sorted(p.name for p in path.iterdir()) if path.is_dir() else "not a directory"
            raise FileNotFoundError(
                f"{path}: no {SINGLE} or {INDEX} (found: {found}); only safetensors checkpoints are read"
            )
        handles = {f: safe_open(str(path / f), framework="pt") for f in files}
        super().__init__({k: handle for handle in handles.values() for k in handle.keys()})

    def meta(self, name: str) -> torch.Tensor:
        info = self._state[name].get_slice(name)
        return torch.empty(info.get_shape(), dtype=_TORCH_DTYPES[info.get_dtype()], device="meta")

    def _tensor(self, name: str, lo: int | None, hi: int | None) -> torch.Tensor:
        handle = self._state[name]
        return handle.get_tensor(name) if lo is None else handle.get_slice(name)[lo:hi]


def write_safetensors(
    path: str | os.PathLike,
    entries: list[tuple[str, torch.Tensor]],
    tensors: Iterator[tuple[str, torch.Tensor]],
    *,
    dtype: torch.dtype | None = None,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write a safetensors file tensor by tensor: ``entries`` (name, meta tensor) fix the header,
    then each tensor is taken from ``tensors`` (the same names, in the same order), converted to
    ``dtype`` (default: its own), written and dropped before the next is taken. Written to
    ``<path>.tmp`` and renamed, so a file under the final name is whole."""
    path = Path(path)
    header, offset = {}, 0
    for name, m in entries:
        dt = dtype or m.dtype
        nbytes = m.numel() * dt.itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dt],
            "shape": list(m.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, m in entries:
            got, t = next(tensors)
            if got != name or t.shape != m.shape:
                raise RuntimeError(f"write_safetensors: expected {name} {tuple(m.shape)}, got {got} {tuple(t.shape)}")
            t = t.to(dtype or m.dtype).contiguous().reshape(-1)
            f.write(memoryview(t.view(torch.uint8).numpy()))
            del t
    tmp.replace(path)
    return path


def check_no_weights(out_dir: str | os.PathLike) -> Path:
    """``out_dir``, made if missing; refused if it already holds weight files (a second export into
    one directory would leave the first one's shards beside the new index)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in out.glob("model*.safetensors*"))
    if stale:
        raise FileExistsError(f"{out} already holds {stale}; export into an empty directory")
    return out


def plan_shards(
    entries: list[tuple[str, torch.Tensor]], dtype: torch.dtype, max_shard_bytes: int = DEFAULT_SHARD_BYTES
) -> list[tuple[str, list[tuple[str, torch.Tensor]]]]:
    """``entries`` (name, meta tensor), in order, cut into files of at most ``max_shard_bytes`` at
    ``dtype`` (a tensor larger than that gets a file of its own): ``[(file name, its entries)]``,
    ``model.safetensors`` alone or ``model-0000i-of-0000n.safetensors``. Planned from the shapes, so
    every file's name knows the count before any is written."""
    shards, size = [[]], 0
    for n, m in entries:
        nbytes = m.numel() * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((n, m))
        size += nbytes
    if len(shards) == 1:
        return [(SINGLE, shards[0])]
    return [(f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors", shard) for k, shard in enumerate(shards)]


def write_sharded(
    out_dir: str | os.PathLike,
    plan: list[tuple[str, list[tuple[str, torch.Tensor]]]],
    tensors: Iterator[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
) -> None:
    """Write the files of ``plan_shards``' ``plan`` into ``out_dir``, each tensor taken from
    ``tensors`` in plan order (one iterator across the files, so each is read once), then, for more
    than one file, the index ``model.safetensors.index.json``, last: a directory with an index is
    whole."""
    out = Path(out_dir)
    for fname, shard in plan:
        write_safetensors(out / fname, shard, tensors, dtype=dtype)
    if len(plan) > 1:
        index = {
            "metadata": {"total_size": sum(m.numel() * dtype.itemsize for _, shard in plan for _, m in shard)},
            "weight_map": {n: f for f, shard in plan for n, _ in shard},
        }
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
