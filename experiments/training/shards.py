"""Prepared token shards: the on-disk format, its writer and ``PreparedDataset``, its reader.

A prepared directory (written by ``python -m experiments.prepare``) holds, per shard ``i``:

- ``train-<i>.bin`` / ``val-<i>.bin``: the documents' token ids back to back, raw ``uint16`` when the
  padded vocabulary fits (<= 65536 ids) else ``uint32``; every document carries the tokenizer's
  separator (EOS after it, or BOS before it: ``MANIFEST.json``'s ``separator``);
- ``train-<i>.idx`` / ``val-<i>.idx``: the document index, raw ``int64`` offsets into the ``.bin``,
  one more than its documents (document ``j`` is ``tokens[idx[j]:idx[j+1]]``, separator included);
- ``shard-<i>.json``: the shard's record (the key of its inputs, its files' sizes and checksums),
  written once its four files are durable: what a resumed prepare keeps;

and, written last (temp file, fsync, rename), ``MANIFEST.json``. A directory without it is not
prepared data, whatever else it holds: ``PreparedDataset`` refuses it, and a prepare resumes in it.

``MANIFEST.json`` (``format`` 1)::

    {"kind": "switchyard.prepared-tokens", "format": 1,
     "tokenizer": {"kind", "spec", "vocab_size", "bos_id", "eos_id", "fingerprint"},
     "separator": {"bos": id | null, "eos": id | null},
     "vocab_size": padded vocabulary, "dtype": "uint16" | "uint32",
     "params": {"field", "val_fraction", "split_seed", "shard_bytes", "task_bytes"},
     "split": how documents are assigned (see experiments.prepare),
     "sources": [{"path", "kind", "files", "docs", "skipped": {reason: count}}], "sources_hash": hex,
     "counts": {"docs", "text_bytes", "train": {"docs", "tokens", "text_bytes"}, "val": {...}},
     "shards": [{"index", "train": {"docs", "tokens", "text_bytes"}, "val": {...}, "text_bytes", "moved"}],
     "files": {name: {"size", "xxh3_128", "max_id" (.bin files)}}}

Nothing in it depends on the machine, the worker count or the time: the same inputs give the same
bytes, manifest included. A split's ``text_bytes`` are its documents' UTF-8 bytes, separators
excluded: tokens over them is what turns a loss in nats per token into bits per byte.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import xxhash

MANIFEST = "MANIFEST.json"
KIND = "switchyard.prepared-tokens"
FORMAT = 1
SPLITS = ("train", "val")
TMP = ".tmp"
UINT16_VOCAB = 1 << 16


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when ids ``[0, vocab_size)`` fit in it, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= UINT16_VOCAB else np.uint32)


def shard_names(index: int) -> dict[str, tuple[str, str]]:
    """``{split: (tokens file, index file)}`` of shard ``index``."""
    return {s: (f"{s}-{index:05d}.bin", f"{s}-{index:05d}.idx") for s in SPLITS}


def record_name(index: int) -> str:
    return f"shard-{index:05d}.json"


def is_shard_file(name: str) -> bool:
    """Whether ``name`` is one a prepare writes, or its temporary (so a prepare may remove it as stale)."""
    base = name[: -len(TMP)] if name.endswith(TMP) else name
    if base == MANIFEST:
        return True
    stem, _, ext = base.rpartition(".")
    prefix, _, num = stem.partition("-")
    return (
        len(num) >= 5
        and num.isdigit()
        and ((prefix in SPLITS and ext in ("bin", "idx")) or (prefix, ext) == ("shard", "json"))
    )


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durably(path: Path, obj) -> None:
    from zero.checkpoint import write_durably  # imports torch: the main process only, never a worker

    write_durably(path, (json.dumps(obj, indent=1) + "\n").encode())


def digest_file(path: Path) -> dict:
    h, size = xxhash.xxh3_128(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "xxh3_128": h.hexdigest()}


class NoSpaceError(OSError):
    """The disk filled while writing prepared data. ``str()`` is a sentence for the user."""

    def __init__(self, directory: Path, needed: int, free: int, detail: str = ""):
        self.directory, self.needed, self.free = Path(directory), needed, free
        msg = (
            f"no space left on the device of {str(self.directory)!r}: {detail or f'{needed} bytes to write'}, "
            f"{free} bytes free; free space there or prepare into another directory "
            "(the partial shard was removed; a rerun resumes from the completed shards)"
        )
        super().__init__(errno.ENOSPC, msg)

    def __str__(self) -> str:
        return self.strerror


def _write_bytes(f, data) -> None:
    # the one place shard bytes reach the disk (a test makes it fail as a full disk would)
    f.write(data)


class ShardWriter:
    """Writes one shard's four files under temporary names, checksumming as it goes; ``commit``
    fsyncs and renames them into place and returns their digests; ``abort`` removes them."""

    def __init__(self, out: Path, index: int, dtype):
        self.out, self.index, self.dtype = Path(out), index, np.dtype(dtype)
        self.names = shard_names(index)
        self._files, self._hash, self._size = {}, {}, {}
        self.max_id = dict.fromkeys(SPLITS, -1)
        self.tokens = dict.fromkeys(SPLITS, 0)
        self.docs = dict.fromkeys(SPLITS, 0)
        try:
            for bin_name, idx_name in self.names.values():
                for name in (bin_name, idx_name):
                    self._files[name] = open(self.out / (name + TMP), "wb")
                    self._hash[name] = xxhash.xxh3_128()
                    self._size[name] = 0
                self._put(idx_name, np.zeros(1, dtype=np.int64))
        except BaseException:
            self.abort()
            raise

    def _put(self, name: str, arr: np.ndarray) -> None:
        data = memoryview(np.ascontiguousarray(arr)).cast("B")
        try:
            _write_bytes(self._files[name], data)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self.abort()
            need = sum(self._size.values()) + len(data)
            raise NoSpaceError(
                self.out, need, shutil.disk_usage(self.out).free, f"shard {self.index} needs {need} bytes"
            ) from None
        self._hash[name].update(data)
        self._size[name] += len(data)

    def add(self, split: str, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Documents of ``split``: ``tokens`` back to back (separators included), ``lengths`` each."""
        if len(lengths) == 0:
            return
        bin_name, idx_name = self.names[split]
        self._put(bin_name, tokens.astype(self.dtype, copy=False))
        self._put(idx_name, self.tokens[split] + np.cumsum(lengths, dtype=np.int64))
        self.tokens[split] += int(len(tokens))
        self.docs[split] += int(len(lengths))
        if len(tokens):
            self.max_id[split] = max(self.max_id[split], int(tokens.max()))

    @property
    def bytes_written(self) -> int:
        return sum(self._size.values())

    def commit(self) -> dict:
        """``{name: {"size", "xxh3_128", "max_id"?}}`` of the four files, now durable under their names."""
        try:
            for f in self._files.values():
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self.abort()
            raise NoSpaceError(
                self.out,
                self.bytes_written,
                shutil.disk_usage(self.out).free,
                f"shard {self.index} needs {self.bytes_written} bytes",
            ) from None
        for f in self._files.values():
            f.close()
        files = {}
        for split, (bin_name, idx_name) in self.names.items():
            for name in (bin_name, idx_name):
                os.replace(self.out / (name + TMP), self.out / name)
                files[name] = {"size": self._size[name], "xxh3_128": self._hash[name].hexdigest()}
            files[bin_name]["max_id"] = self.max_id[split]
        fsync_dir(self.out)
        self._files = {}
        return files

    def abort(self) -> None:
        for name, f in self._files.items():
            f.close()
            (self.out / (name + TMP)).unlink(missing_ok=True)
        self._files = {}


# ----------------------------------------------------------------------------- reading


class ConcatTokens:
    """Shards' token arrays read as one 1-D array without copying them: ``len``, an int or a
    step-1 slice (a view where it lies in one shard, a copy where it spans two), ``np.asarray``
    (the whole, copied). ``parts`` are the shards' memory maps, in order."""

    ndim = 1

    def __init__(self, parts: list[np.ndarray], dtype):
        self.parts = list(parts)
        self.dtype = np.dtype(dtype)
        self.starts = np.concatenate([[0], np.cumsum([len(p) for p in self.parts], dtype=np.int64)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def _part(self, i: int) -> int:
        # side="right" skips empty shards, whose start equals the next one's
        return int(np.searchsorted(self.starts, i, side="right")) - 1

    def __getitem__(self, key):
        n = len(self)
        if isinstance(key, (int, np.integer)):
            i = int(key) + (n if key < 0 else 0)
            if not 0 <= i < n:
                raise IndexError(f"index {int(key)} is out of range for {n} tokens")
            p = self._part(i)
            return self.parts[p][i - self.starts[p]]
        if not isinstance(key, slice):
            raise TypeError(f"ConcatTokens takes an int or a slice, not {type(key).__name__}")
        start, stop, step = key.indices(n)
        if step != 1:
            raise ValueError(f"ConcatTokens slices with step 1 only, not {step}")
        if stop <= start:
            return np.zeros(0, dtype=self.dtype)
        p0, p1 = self._part(start), self._part(stop - 1)
        pieces = [
            self.parts[p][max(start - self.starts[p], 0) : min(stop, self.starts[p + 1]) - self.starts[p]]
            for p in range(p0, p1 + 1)
        ]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def __array__(self, dtype=None, copy=None):
        whole = np.concatenate(self.parts) if self.parts else np.zeros(0, dtype=self.dtype)
        return whole.astype(dtype, copy=False) if dtype is not None else whole

    def max(self) -> int:
        return max((int(p.max()) for p in self.parts if len(p)), default=-1)


def _map(path: Path, dtype, size: int) -> np.ndarray:
    # np.memmap refuses an empty file; an empty split of a shard is an empty array
    return np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype=dtype)


def read_manifest(path: str | os.PathLike) -> dict:
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(
            f"prepared data {str(d)!r} is not a directory (expected one written by experiments.prepare)"
        )
    m = d / MANIFEST
    if not m.is_file():
        raise FileNotFoundError(
            f"{str(d)!r} has no {MANIFEST}: it is not prepared data, or its prepare did not finish "
            "(rerun `python -m experiments.prepare ... --out DIR` to resume it)"
        )
    try:
        manifest = json.loads(m.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{str(m)!r} is not readable JSON ({e}); prepare {str(d)!r} again") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != KIND:
        raise ValueError(
            f"{str(m)!r} is not a prepared-data manifest "
            f"(kind {manifest.get('kind') if isinstance(manifest, dict) else None!r}, "
            f"expected {KIND!r}): {str(d)!r} holds something else (a checkpoint?)"
        )
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{str(m)!r} has format {manifest.get('format')!r}; this version reads format {FORMAT}")
    return manifest


class PreparedDataset:
    """A prepared directory, memory-mapped. Opening it checks the manifest and every file's size
    (``verify=True``: every checksum and every file's largest id too, reading all the bytes).

    ``vocab_size``: refuse data holding an id outside ``[0, vocab_size)`` (the model's vocabulary).
    ``tokenizer``: refuse data prepared with another tokenizer (a different fingerprint).

    ``train`` / ``val``: the split's tokens (``ConcatTokens`` over the shards; ``.parts`` are the
    per-shard memory maps); ``offsets(split)``: the document index over them; ``vocab_size``: the
    padded vocabulary; ``tokenizer_fingerprint``, ``separator``, ``dtype``, ``manifest``."""

    def __init__(self, path: str | os.PathLike, *, verify: bool = False, vocab_size: int | None = None, tokenizer=None):
        self.path = Path(path)
        self.manifest = m = read_manifest(self.path)
        self.dtype = np.dtype(m["dtype"])
        self.vocab_size = int(m["vocab_size"])
        self.tokenizer_vocab_size = int(m["tokenizer"]["vocab_size"])
        self.tokenizer_fingerprint = m["tokenizer"]["fingerprint"]
        self.separator = m["separator"]
        files = m["files"]
        for name, want in files.items():
            f = self.path / name
            if not f.is_file():
                raise ValueError(
                    f"prepared data {str(self.path)!r} lacks {name}, which its manifest lists; prepare it again"
                )
            size = f.stat().st_size
            if size != want["size"]:
                raise ValueError(
                    f"{str(f)!r} has {size} bytes, its manifest says {want['size']}: the file changed after the "
                    "prepare; prepare the directory again"
                )
            if verify:
                got = digest_file(f)["xxh3_128"]
                if got != want["xxh3_128"]:
                    raise ValueError(
                        f"{str(f)!r} fails its checksum ({got} != the manifest's {want['xxh3_128']}); prepare it again"
                    )
        if tokenizer is not None:
            from experiments.training.tokenizer import load_tokenizer

            tok = load_tokenizer(tokenizer)
            if tok.fingerprint() != self.tokenizer_fingerprint:
                raise ValueError(
                    f"prepared data {str(self.path)!r} was tokenized by {m['tokenizer']['spec']!r} (fingerprint "
                    f"{self.tokenizer_fingerprint}), not by {tok.spec!r} (fingerprint {tok.fingerprint()}): prepare it "
                    "again with this tokenizer, or train with the one it was prepared with"
                )
        self._tokens = {s: [] for s in SPLITS}
        self._offsets: dict[str, np.ndarray] = {}
        self._index = {s: [] for s in SPLITS}
        for shard in m["shards"]:
            for split, (bin_name, idx_name) in shard_names(shard["index"]).items():
                self._tokens[split].append(_map(self.path / bin_name, self.dtype, files[bin_name]["size"]))
                self._index[split].append(np.memmap(self.path / idx_name, dtype=np.int64, mode="r"))
        if verify:
            for split in SPLITS:
                for shard, arr in zip(m["shards"], self._tokens[split]):
                    name = shard_names(shard["index"])[split][0]
                    top = int(arr.max()) if len(arr) else -1
                    if top != files[name]["max_id"]:
                        raise ValueError(
                            f"{str(self.path / name)!r}: largest id {top}, its manifest says {files[name]['max_id']}"
                        )
        if vocab_size is not None:
            self.check_vocab(vocab_size)
        self.train = ConcatTokens(self._tokens["train"], self.dtype)
        self.val = ConcatTokens(self._tokens["val"], self.dtype)

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse an id ``>= vocab_size``, naming the file, position and document (the manifest's
        largest id per file decides; the offending file alone is scanned to find the first)."""
        m = self.manifest
        for split in SPLITS:
            for shard, arr, idx in zip(m["shards"], self._tokens[split], self._index[split]):
                name = shard_names(shard["index"])[split][0]
                top = m["files"][name]["max_id"]
                if top < vocab_size:
                    continue
                pos = _first_at_least(arr, vocab_size)
                doc = int(np.searchsorted(idx, pos, side="right")) - 1
                raise ValueError(
                    f"{str(self.path / name)!r} holds token id {int(arr[pos])} at position {pos} (document {doc}), "
                    "outside "
                    f"the vocabulary [0, {vocab_size}): the data was tokenized by {m['tokenizer']['spec']!r} "
                    f"({self.tokenizer_vocab_size} ids, padded to {self.vocab_size}); give the model vocab_size >= "
                    f"{self.vocab_size}, or prepare the data with a tokenizer whose ids fit"
                )

    def offsets(self, split: str) -> np.ndarray:
        """The split's document index over ``train``/``val`` (int64, one more than the documents;
        built once, in memory: 8 bytes a document)."""
        split = self._split(split)
        if split not in self._offsets:
            parts, base, out = self._index[split], 0, [np.zeros(1, dtype=np.int64)]
            for idx in parts:
                out.append(np.asarray(idx[1:]) + base)
                base += int(idx[-1])
            self._offsets[split] = np.concatenate(out)
            self._offsets[split].flags.writeable = False  # shared by every caller
        return self._offsets[split]

    def num_docs(self, split: str) -> int:
        return sum(len(idx) - 1 for idx in self._index[self._split(split)])

    def document(self, split: str, j: int) -> np.ndarray:
        """Document ``j`` of ``split``, its separator included."""
        off = self.offsets(split)
        if not 0 <= j < len(off) - 1:
            raise IndexError(f"document {j} is out of range: the {split} split holds {len(off) - 1}")
        return (self.train if split == "train" else self.val)[int(off[j]) : int(off[j + 1])]

    @staticmethod
    def _split(split: str) -> str:
        if split not in SPLITS:
            raise ValueError(f"split {split!r} is invalid: expected one of {SPLITS}")
        return split

    def __repr__(self) -> str:
        c = self.manifest["counts"]
        return (
            f"PreparedDataset({str(self.path)!r}, {c['train']['tokens']} train / {c['val']['tokens']} val tokens, "
            f"{self.dtype.name}, vocab_size={self.vocab_size})"
        )


def _first_at_least(arr: np.ndarray, bound: int, chunk: int = 1 << 24) -> int:
    # in pieces: a whole-shard comparison would allocate a bool per token
    for start in range(0, len(arr), chunk):
        hits = np.flatnonzero(np.asarray(arr[start : start + chunk]) >= bound)
        if len(hits):
            return start + int(hits[0])
    raise AssertionError("the manifest's max_id promised an id at or above the bound")
