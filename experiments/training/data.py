"""Language-modelling data: byte-level text (vocab 256), a flat uint16 token file, or (through
``experiments.training.tokenized``) prepared token shards, as train/val arrays.

Sources (``data=`` in the Hydra tree):
- ``stdlib``: the Python standard library's own ``.py`` files on the running machine, found through
  ``sysconfig`` — a corpus every machine already has, so no download.
- ``text``: any text file or folder (files with a NUL byte are skipped as binary).
- ``tokens``: a flat binary file of uint16 token ids (nanoGPT's ``train.bin``/``val.bin``), memory-mapped.

Text sources are split into train and validation BY FILE, from a hash of each file's relative path,
so the split is deterministic and a file never straddles it. Each document ends with a NUL byte
(never present in text), a document separator the model can learn. The concatenated bytes are
cached as ``uint8`` files keyed by the file list, so later runs start instantly.

A tokenizer (``data.tokenizer``), prepared shards and mixtures (``data.sources``) are
``experiments.training.tokenized``'s; ``build_data`` hands such configs to it, and they come back as
``LMData`` too (or a ``Mixture`` of them).

Documents: ``get_batch(..., documents=True)`` also returns each token's document (its index in the
split: from the data's document index, or counted from the NUL separators of byte-level text), the
``doc_ids`` that ``data.document_mask`` feeds the model.

Batches: ``get_batch(split, step, ...)`` draws the GLOBAL batch of an optimizer step from a
generator seeded by (seed, split, step) — identical on every rank — and returns this data-parallel
rank's contiguous slice of it. The union over ranks is therefore exactly the one-process batch, the
slices are disjoint, and a run can resume at any step. Shapes follow the project's legend
(docs/design.md): B sequences, L sequence length.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

SEPARATOR = 0  # NUL ends every document
SPLITS = ("train", "val")


@dataclass
class LMData:
    train: np.ndarray  # 1-D uint8 / uint16 (possibly a memmap)
    val: np.ndarray
    vocab_size: int
    name: str
    seed: int = 0
    info: dict | None = None  # e.g. file counts, for the run summary
    # split -> the document index: int64 start offsets, one more than the documents (prepared data)
    offsets: dict | None = None
    # the id that ends every document, from which the index is found where ``offsets`` lacks it (bytes: NUL)
    separator: int | None = None
    # split -> UTF-8 bytes of its documents' text, separators excluded: what bits per byte divides by
    text_bytes: dict | None = None
    _found: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        for split in SPLITS:
            n = len(getattr(self, split))
            if n < 2:
                raise ValueError(f"data {self.name!r}: the {split} split has {n} tokens; it needs at least 2")

    def doc_offsets(self, split: str) -> np.ndarray:
        """The split's document index (start offsets, then the end): the data's own, or found from
        its separator once (a NUL ends every document of byte-level text)."""
        if self.offsets is not None and split in self.offsets:
            return self.offsets[split]
        if split not in self._found:
            if self.separator is None:
                raise ValueError(
                    f"data {self.name!r} has no document boundaries (a flat token file), so data.document_mask=true "
                    "cannot apply: use data.source=stdlib or text, or data prepared by experiments.prepare"
                )
            tokens = np.asarray(self.train if split == "train" else self.val)
            ends = np.flatnonzero(tokens == self.separator) + 1
            off = np.concatenate([[0], ends, [len(tokens)] if not len(ends) or ends[-1] != len(tokens) else []])
            self._found[split] = off.astype(np.int64)
        return self._found[split]

    def bytes_per_token(self, split: str = "val") -> float | None:
        """Text bytes per token of the split (None where unknown): nats per token times this over
        ln 2 is bits per byte, which compares across tokenizers."""
        if not self.text_bytes or self.text_bytes.get(split) is None:
            return None
        return self.text_bytes[split] / len(self.train if split == "train" else self.val)

    def _generator(self, split: str, step: int) -> torch.Generator:
        # seeded from (seed, split, step) alone, so every rank and every resumed run draws the same
        # global batch for a given step
        key = hashlib.sha256(f"{self.seed}/{split}/{step}".encode()).digest()
        return torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & (2**63 - 1))

    def get_batch(
        self,
        split: str,
        step: int,
        global_batch: int,
        seq_len: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        microbatches: int = 1,
        documents: bool = False,
    ):
        """``(x_BL, y_BL)`` int64 (``documents``: and ``doc_ids_BL``, each token's document in the
        split, for ``model(x, doc_ids=...)``): this dp rank's B = global/dp rows of the global batch; ``y`` is
        ``x`` shifted by one token. The global batch is ``microbatches`` consecutive global
        micro-batches; the rank's rows are its consecutive share of each, in order, so that when it
        cuts its rows into ``microbatches`` equal micro-batches, its j-th is its share of the j-th
        global one, whatever dp (with one micro-batch: rows ``[dp_rank*B, (dp_rank+1)*B)``). Batch
        statistics of a micro-batch (the balancing loss, capacity) then see the same tokens on dp
        ranks together as in one process."""
        if microbatches < 1 or global_batch % (dp_size * microbatches):
            raise ValueError(
                f"global batch size {global_batch} is not divisible by the data-parallel size {dp_size} "
                f"x {microbatches} micro-batches"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        tokens = self.train if split == "train" else self.val
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"data {self.name!r}: the {split} split has {len(tokens)} tokens, fewer than seq_len+1={seq_len + 1}"
            )
        starts_G = torch.randint(0, len(tokens) - seq_len, (global_batch,), generator=self._generator(split, step))
        starts_B = rank_rows(starts_G, dp_rank, dp_size, microbatches).tolist()
        return self.windows(split, starts_B, seq_len, documents)

    def windows(self, split: str, starts_B: list[int], seq_len: int, documents: bool = False):
        """The rows starting at ``starts_B``: ``(x_BL, y_BL[, doc_ids_BL])`` (see ``get_batch``)."""
        tokens = self.train if split == "train" else self.val
        rows = np.stack([np.asarray(tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts_B])
        xy_BL1 = torch.from_numpy(rows)
        if not documents:
            return xy_BL1[:, :-1], xy_BL1[:, 1:]
        pos_BL = np.asarray(starts_B, dtype=np.int64)[:, None] + np.arange(seq_len)
        doc_BL = np.searchsorted(self.doc_offsets(split), pos_BL, side="right") - 1
        return xy_BL1[:, :-1], xy_BL1[:, 1:], torch.from_numpy(doc_BL)

    def unigram_entropy(self, split: str = "val") -> float:
        """Entropy in nats of the split's token frequencies: the loss of the best model that ignores
        context, the baseline a trained model must beat."""
        tokens = self.train if split == "train" else self.val
        counts = np.bincount(np.asarray(tokens), minlength=self.vocab_size).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())


def rank_rows(rows_G: torch.Tensor, dp_rank: int, dp_size: int, microbatches: int) -> torch.Tensor:
    """This dp rank's rows of a global batch (``LMData.get_batch``'s order): its consecutive share
    of each of the ``microbatches`` global micro-batches, in order."""
    share = len(rows_G) // dp_size // microbatches  # rows of each global micro-batch on each rank
    return rows_G.view(microbatches, dp_size, share, *rows_G.shape[1:])[:, dp_rank].flatten(0, 1)


# ----------------------------------------------------------------------------- text sources


def check_val_fraction(val_fraction: float) -> None:
    """``data.val_fraction``, which every loader takes: a share of a split, strictly between 0 and 1."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"data.val_fraction={val_fraction} must be in (0, 1)")


def _unit_hash(rel_path: str, split_seed: int) -> float:
    # a file's place in [0, 1) depends on its relative path only, not on the machine or the order
    h = hashlib.sha256(f"{split_seed}:{rel_path}".encode()).digest()
    return int.from_bytes(h[:8], "little") / 2**64


def split_files(rel_paths: list[str], val_fraction: float, split_seed: int = 0) -> tuple[list[str], list[str]]:
    """Deterministic by-file split; both sides non-empty when there are at least two files."""
    check_val_fraction(val_fraction)
    u = {p: _unit_hash(p, split_seed) for p in rel_paths}
    val = sorted(p for p in rel_paths if u[p] < val_fraction)
    train = sorted(p for p in rel_paths if u[p] >= val_fraction)
    # a handful of files can all land on one side: move the one nearest the threshold across
    if len(rel_paths) >= 2 and not val:
        first = min(train, key=u.get)
        train.remove(first)
        val = [first]
    elif len(rel_paths) >= 2 and not train:
        last = max(val, key=u.get)
        val.remove(last)
        train = [last]
    return train, val


def _list_files(root: Path, pattern: str, exclude_dirs: tuple[str, ...]) -> list[str]:
    head, _, name = pattern.rpartition("/")
    if head == "**" and "**" not in name:
        # "**/<name>": walk the tree once, pruning the excluded folders instead of globbing through
        # them (the standard library's folder may hold all of site-packages). The same files as
        # Path.glob: symlinked folders are not entered, symlinks to files are kept.
        out = []
        for dirpath, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d not in exclude_dirs]
            rel_dir = Path(dirpath).relative_to(root)
            for f in files:
                if fnmatch.fnmatchcase(f, name) and os.path.isfile(os.path.join(dirpath, f)):
                    out.append((rel_dir / f).as_posix())
        return sorted(out)
    out = []
    for p in root.glob(pattern):
        rel = p.relative_to(root)
        if p.is_file() and not any(part in exclude_dirs for part in rel.parts[:-1]):
            out.append(rel.as_posix())
    return sorted(out)


def _read_docs(root: Path, rel_paths: list[str]) -> tuple[np.ndarray, int]:
    chunks, skipped = [], 0
    for rel in rel_paths:
        data = (root / rel).read_bytes()
        if not data or b"\x00" in data:  # empty, or binary
            skipped += 1
            continue
        chunks.append(np.frombuffer(data, dtype=np.uint8))
        chunks.append(np.array([SEPARATOR], dtype=np.uint8))
    return (np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint8)), skipped


def _byte_data(train: np.ndarray, val: np.ndarray, name: str, seed: int, info: dict) -> LMData:
    # every byte is text but the NUL after each document
    text = {"val": len(val) - int(np.count_nonzero(np.asarray(val) == SEPARATOR))}
    return LMData(train, val, 256, name, seed, info, separator=SEPARATOR, text_bytes=text)


def _cache_dir(cache_dir: str | None) -> Path:
    base = cache_dir or os.environ.get("SWITCHYARD_CACHE") or "~/.cache/switchyard"
    return Path(base).expanduser()


def load_text(
    path: str | os.PathLike,
    *,
    pattern: str = "**/*",
    val_fraction: float = 0.05,
    split_seed: int = 0,
    exclude_dirs: tuple[str, ...] = (),
    cache_dir: str | None = None,
    seed: int = 0,
    name: str | None = None,
) -> LMData:
    """Byte-level data from a text file or a folder of them (see the module docstring)."""
    root = Path(path).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"data path {str(root)!r} does not exist")
    name = name or str(root)
    if root.is_file():
        # one file cannot be split by file: its last val_fraction of bytes is the validation split
        data = root.read_bytes()
        if not data:
            raise ValueError(f"data path {str(root)!r} is empty")
        check_val_fraction(val_fraction)
        arr = np.frombuffer(data, dtype=np.uint8)
        cut = int(len(arr) * (1 - val_fraction))
        return _byte_data(arr[:cut], arr[cut:], name, seed, {"files": 1, "split": "by byte (single file)"})

    rel_paths = _list_files(root, pattern, tuple(exclude_dirs))
    if not rel_paths:
        raise ValueError(f"data path {str(root)!r} holds no files matching {pattern!r}")
    stats = [(rel, (root / rel).stat()) for rel in rel_paths]
    key = hashlib.sha256(
        json.dumps(
            [str(root.resolve()), val_fraction, split_seed, [(r, s.st_size, s.st_mtime_ns) for r, s in stats]]
        ).encode()
    ).hexdigest()[:16]
    cache = _cache_dir(cache_dir) / f"text-{key}"
    if (cache / "info.json").exists():
        info = json.loads((cache / "info.json").read_text())
        train = np.memmap(cache / "train.bin", dtype=np.uint8, mode="r")
        val = np.memmap(cache / "val.bin", dtype=np.uint8, mode="r")
        return _byte_data(train, val, name, seed, info)

    train_files, val_files = split_files(rel_paths, val_fraction, split_seed)
    train, skipped_t = _read_docs(root, train_files)
    val, skipped_v = _read_docs(root, val_files)
    if len(train) == 0 and len(val) == 0:
        raise ValueError(f"data path {str(root)!r}: every file matching {pattern!r} is empty or binary")
    info = {
        "files": len(rel_paths) - skipped_t - skipped_v,
        "train_files": len(train_files) - skipped_t,
        "val_files": len(val_files) - skipped_v,
        "train_bytes": int(len(train)),
        "val_bytes": int(len(val)),
    }
    try:
        # write under a temporary name, then rename: a concurrent run never reads a half-written cache
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        train.tofile(tmp / "train.bin")
        val.tofile(tmp / "val.bin")
        (tmp / "info.json").write_text(json.dumps(info))
        try:
            os.rename(tmp, cache)
        except OSError:  # another run finished the same cache first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass  # a read-only cache location only costs re-reading the files next time
    return _byte_data(train, val, name, seed, info)


def stdlib_path() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def load_stdlib(**kw) -> LMData:
    # third-party packages may live inside the stdlib folder; they are not the standard library
    return load_text(
        stdlib_path(),
        pattern="**/*.py",
        exclude_dirs=("site-packages", "dist-packages", "__pycache__"),
        name="python-stdlib",
        **kw,
    )


# ----------------------------------------------------------------------------- token files


def _check_vocab(arr: np.ndarray, vocab_size: int, path: Path) -> None:
    if len(arr) == 0:
        raise ValueError(f"token file {str(path)!r} is empty")
    top = int(arr.max())
    if top >= vocab_size:
        where = int(np.argmax(np.asarray(arr) >= vocab_size))
        raise ValueError(
            f"token file {str(path)!r} holds token id {top} (first out-of-range id {int(arr[where])} "
            f"at index {where}), beyond the vocabulary (data.vocab_size={vocab_size}); set data.vocab_size > {top}"
        )


def load_tokens(path: str | os.PathLike, *, vocab_size: int, val_fraction: float = 0.05, seed: int = 0) -> LMData:
    """A folder with nanoGPT's ``train.bin`` and ``val.bin`` (uint16), or one ``.bin`` file whose last
    ``val_fraction`` is the validation split. Memory-mapped: nothing is read until sampled."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"token path {str(p)!r} does not exist")
    if p.is_dir():
        files = {s: p / f"{s}.bin" for s in ("train", "val")}
        for s, f in files.items():
            if not f.exists():
                raise FileNotFoundError(
                    f"token folder {str(p)!r} has no {s}.bin (expected nanoGPT's train.bin and val.bin)"
                )
        arrays = {}
        for s, f in files.items():
            if f.stat().st_size == 0 or f.stat().st_size % 2:
                raise ValueError(
                    f"token file {str(f)!r} is empty or not a whole number of uint16 ids ({f.stat().st_size} bytes)"
                )
            arrays[s] = np.memmap(f, dtype=np.uint16, mode="r")
            _check_vocab(arrays[s], vocab_size, f)
        return LMData(
            arrays["train"],
            arrays["val"],
            vocab_size,
            str(p),
            seed,
            {"train_tokens": len(arrays["train"]), "val_tokens": len(arrays["val"])},
        )
    if p.stat().st_size == 0 or p.stat().st_size % 2:
        raise ValueError(
            f"token file {str(p)!r} is empty or not a whole number of uint16 ids ({p.stat().st_size} bytes)"
        )
    check_val_fraction(val_fraction)
    arr = np.memmap(p, dtype=np.uint16, mode="r")
    _check_vocab(arr, vocab_size, p)
    cut = int(len(arr) * (1 - val_fraction))
    return LMData(arr[:cut], arr[cut:], vocab_size, str(p), seed, {"train_tokens": cut, "val_tokens": len(arr) - cut})


def build_data(cfg, seed: int = 0) -> LMData:
    """From the ``data`` config group (a mapping with ``source`` and that source's keys); a
    tokenizer, prepared data or a mixture: ``experiments.training.tokenized.build_tokenized``."""
    from experiments.training.tokenized import build_tokenized, is_tokenized

    if is_tokenized(cfg):
        return build_tokenized(cfg, seed)
    source = cfg["source"]
    if source == "stdlib":
        return load_stdlib(
            val_fraction=cfg["val_fraction"], split_seed=cfg["split_seed"], cache_dir=cfg.get("cache_dir"), seed=seed
        )
    if source == "text":
        return load_text(
            cfg["path"],
            pattern=cfg["pattern"],
            val_fraction=cfg["val_fraction"],
            split_seed=cfg["split_seed"],
            cache_dir=cfg.get("cache_dir"),
            seed=seed,
        )
    if source == "tokens":
        return load_tokens(cfg["path"], vocab_size=cfg["vocab_size"], val_fraction=cfg["val_fraction"], seed=seed)
    raise ValueError(f"data.source={source!r} is invalid: expected one of ('stdlib', 'text', 'tokens', 'prepared')")
