"""The files of a checkpoint directory: durable writes, checksums, the manifest written last, and
the checks that find the newest complete checkpoint (``verify``, ``latest_complete``, ``prune``)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch.distributed as dist

from .group import _distributed, _rank

FORMAT = 2  # 2: raw item bytes, XXH3-128 checksums; 1 (still read): torch.save items, SHA-256
_READS = (1, 2)
MANIFEST = "MANIFEST.json"
META = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointDiskFull(OSError):
    """A save met a full disk (ENOSPC, or EDQUOT: a quota). Raised on every rank alike, after the
    partial checkpoint was removed; every complete checkpoint is kept. ``directory``: the
    checkpoint that could not be written; ``needed``: the bytes its data and small files take
    (summed over the ranks before the save started; DCP's ``.metadata`` and the manifest, a few
    KiB, not counted); ``free``: what ``shutil.disk_usage`` reports free there after the removal."""

    def __init__(self, directory: str | os.PathLike, needed: int, free: int, complete: list | None = None):
        self.directory, self.needed, self.free = Path(directory), int(needed), int(free)
        self.complete = [str(p) for p in complete or []]
        kept = (
            f"; the complete checkpoints are kept ({', '.join(Path(p).name for p in self.complete)})"
            if self.complete
            else "; there is no complete checkpoint under it"
        )
        super().__init__(
            errno.ENOSPC,
            f"checkpoint {self.directory}: the disk is full: the save needs {self.needed} bytes and "
            f"{self.free} bytes are free there (after removing the partial checkpoint){kept}. Free space "
            f"on that filesystem, lower keep_last, or checkpoint elsewhere",
        )

    def __reduce__(self):  # raised in a thread or a rank and re-raised elsewhere: keep the fields
        return (type(self), (self.directory, self.needed, self.free, self.complete))


def _is_disk_full(e: BaseException | None) -> bool:
    """``e`` or an exception it was raised from is a full disk or an exceeded quota."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    return False


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


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


def verify_together(path: str | os.PathLike, group=None) -> str | None:
    """``verify`` by every rank of ``group`` at once, each re-reading its share of the files; the
    first problem any rank found (the same answer on every rank). A collective over ``group``."""
    if not _distributed(group):
        return verify(path)
    problems = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, verify(path, (_rank(group), len(problems))), group=group)
    return next((p for p in problems if p is not None), None)


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
