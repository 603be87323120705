"""The work of ``python -m experiments.prepare``: tokenizing tasks in worker processes, and writing shards.

``prepare`` and ``prepare_cached`` (see ``experiments.prepare`` for the format, the split and the
resume); the sources are planned and read by ``experiments.training.corpus``, tokenized by
``experiments.training.prepare_workers``; the split's balance and the manifest are
``experiments.training.prepare_split``'s mixins of ``_Prepare``.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import xxhash

from experiments.training.corpus import (
    DEFAULT_EXCLUDE,
    TASK_BYTES,
    _Planner,
    sources_hash,
)
from experiments.training.prepare_split import ManifestWriter, SplitBalance
from experiments.training.prepare_workers import results
from experiments.training.shards import (
    FORMAT,
    MANIFEST,
    SPLITS,
    TMP,
    NoSpaceError,
    ShardWriter,
    digest_file,
    is_shard_file,
    read_manifest,
    record_name,
    token_dtype,
    write_json_durably,
)
from experiments.training.tokenizer import Tokenizer, load_tokenizer, padded_vocab

SHARD_MB = 128
PAUSE_ENV = "SWITCHYARD_PREPARE_TEST_PAUSE_S"  # tests: seconds to sleep after each recorded shard, to kill mid-way


# ----------------------------------------------------------------------------- the prepare


def _digest(obj) -> str:
    return xxhash.xxh3_128(json.dumps(obj, sort_keys=True).encode()).hexdigest()


class _Prepare(SplitBalance, ManifestWriter):
    def __init__(
        self,
        sources,
        tok: Tokenizer,
        out: Path,
        *,
        field_name,
        workers,
        val_fraction,
        split_seed,
        shard_mb,
        exclude,
        progress,
    ):
        if not 0 <= val_fraction < 1:
            raise ValueError(f"val_fraction={val_fraction} must be in [0, 1) (0: no validation split)")
        if workers is not None and workers < 0:
            raise ValueError(f"workers={workers} must be >= 0 (0: tokenize in this process)")
        if not shard_mb > 0:
            raise ValueError(f"shard_mb={shard_mb} must be positive")
        self.tok, self.out, self.progress = tok, Path(out).expanduser(), progress
        self.field, self.val_fraction, self.split_seed = field_name, float(val_fraction), int(split_seed)
        self.workers = (
            (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
            if workers is None
            else workers
        )
        self.shard_bytes = max(1, int(shard_mb * (1 << 20)))
        self.task_bytes = min(TASK_BYTES, self.shard_bytes)  # shards are whole tasks: none may exceed one
        planner = _Planner(field_name, exclude, self.task_bytes, skip=[self.out])
        self.sources = planner.plan(sources)
        self.tasks = planner.tasks
        self.shards: list[list[dict]] = []  # consecutive tasks, about shard_bytes of text each
        size = self.shard_bytes
        for t in self.tasks:
            if size >= self.shard_bytes:
                self.shards.append([])
                size = 0
            self.shards[-1].append(t)
            size += t["bytes"]
        self.vocab_size = padded_vocab(tok.vocab_size)
        self.dtype = token_dtype(self.vocab_size)
        self.params = {
            "field": field_name,
            "val_fraction": self.val_fraction,
            "split_seed": self.split_seed,
            "shard_bytes": self.shard_bytes,
            "task_bytes": self.task_bytes,
        }
        self.sources_hash = sources_hash(self.sources, field_name)
        self.threshold = int(self.val_fraction * 2**64)

    def cache_key(self) -> str:
        return _digest([FORMAT, self.sources_hash, self.tok.fingerprint(), self.params])

    def shard_key(self, i: int) -> str:
        tasks = [{k: v for k, v in t.items() if k != "bytes"} for t in self.shards[i]]
        return _digest([FORMAT, self.tok.fingerprint(), self.dtype.name, self.params, tasks])

    # -------------------------------------------------------------------- the run

    def run(self) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        with _Lock(self.out):
            if self._complete():
                return self.out
            for p in self.out.iterdir():  # temporaries of an interrupted run
                if p.name.endswith(TMP) and is_shard_file(p.name):
                    p.unlink()
            records = {i: r for i in range(len(self.shards)) if (r := self._valid_record(i)) is not None}
            self._bar = _bar(
                self.progress,
                sum(t["bytes"] for t in self.tasks),
                sum(t["bytes"] for i in records for t in self.shards[i]),
            )
            try:
                records.update(self._tokenize([i for i in range(len(self.shards)) if i not in records], records))
                records = self._balance_split(records)
            finally:
                self._bar.close()
            self._check_documents(records)
            for p in self.out.iterdir():  # shards of an earlier, larger plan
                if (
                    is_shard_file(p.name)
                    and p.name != MANIFEST
                    and int(p.name.split("-")[1].split(".")[0]) >= len(self.shards)
                ):
                    p.unlink()
            try:
                write_json_durably(self.out / MANIFEST, self._manifest(records))
            except OSError as e:
                (self.out / (MANIFEST + TMP)).unlink(missing_ok=True)
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise NoSpaceError(self.out, 1 << 20, _free(self.out), "the manifest did not fit") from None
                raise
        return self.out

    def _complete(self) -> bool:
        """A manifest of these inputs with every file's size intact: nothing to do. One of other
        inputs: refused. One whose files were damaged: removed, and the shards are checked."""
        if not (self.out / MANIFEST).exists():
            return False
        m = read_manifest(self.out)
        differs = [
            what
            for what, a, b in (
                ("the tokenizer", m["tokenizer"]["fingerprint"], self.tok.fingerprint()),
                ("the sources", m["sources_hash"], self.sources_hash),
                ("the parameters", m["params"], self.params),
            )
            if a != b
        ]
        if differs:
            raise ValueError(
                f"{str(self.out)!r} already holds data prepared from other inputs (different: {', '.join(differs)}); "
                f"pass another --out, or delete {str(self.out)!r} to prepare it again"
            )
        for name, want in m["files"].items():
            p = self.out / name
            if not p.is_file() or p.stat().st_size != want["size"]:
                (self.out / MANIFEST).unlink()
                return False
        return True

    def _valid_record(self, i: int) -> dict | None:
        path = self.out / record_name(i)
        try:
            record = json.loads(path.read_text())
            if record.get("key") != self.shard_key(i) or "text_bytes" not in record["val"]:  # or an older format's
                return None
            for name, want in record["files"].items():
                p = self.out / name
                if (
                    not p.is_file()
                    or p.stat().st_size != want["size"]
                    or digest_file(p)["xxh3_128"] != want["xxh3_128"]
                ):
                    return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):  # absent, torn or foreign: redo the shard
            return None
        return record

    def _results(self, todo: list[int]) -> Iterator[dict]:
        tasks = [t for i in todo for t in self.shards[i]]
        return results(tasks, (self.tok, self.field, self.threshold, self.split_seed, self.dtype.name), self.workers)

    def _tokenize(self, todo: list[int], done: dict) -> dict:
        records = {}
        results = self._results(todo)
        try:
            for i in todo:
                records[i] = self._write_shard(i, results, done | records)
                if os.environ.get(PAUSE_ENV):
                    time.sleep(float(os.environ[PAUSE_ENV]))
        finally:
            results.close()
        return records

    def _write_shard(self, i: int, results: Iterator[dict], done: dict) -> dict:
        base = {"train": 0, "val": 0, "train_min": None, "val_max": None}
        sources: dict[str, dict] = {}
        text_bytes = {s: 0 for s in SPLITS}
        writer = None
        try:
            writer = ShardWriter(self.out, i, self.dtype)
            for task in self.shards[i]:
                res = next(results)
                for split, ext, better in (("train", "train_min", min), ("val", "val_max", max)):
                    if res[ext] is not None:
                        cand = [res[ext][0], base[split] + res[ext][1], res[ext][2]]
                        base[ext] = cand if base[ext] is None else better(base[ext], cand)
                    tokens, lengths = res[split]
                    writer.add(split, tokens, lengths)
                    base[split] += len(lengths)
                s = sources.setdefault(str(res["source"]), {"docs": 0, "skipped": {}})
                s["docs"] += sum(len(res[split][1]) for split in SPLITS)
                for why, n in res["skipped"].items():
                    s["skipped"][why] = s["skipped"].get(why, 0) + n
                for split in SPLITS:
                    text_bytes[split] += res["text_bytes"][split]
                self._bar.update(task["bytes"])
            files = writer.commit()
        except NoSpaceError as e:
            raise self._no_space(e, i, done) from None
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        record = {
            "index": i,
            "key": self.shard_key(i),
            "files": files,
            **{s: {"docs": writer.docs[s], "tokens": writer.tokens[s], "text_bytes": text_bytes[s]} for s in SPLITS},
            "text_bytes": sum(text_bytes.values()),
            "sources": sources,
            "base": base,
            "moved": None,
        }
        self._write_record(i, record, done)
        return record

    def _write_record(self, i: int, record: dict, done: dict) -> None:
        try:
            write_json_durably(self.out / record_name(i), record)
        except OSError as e:
            (self.out / (record_name(i) + TMP)).unlink(missing_ok=True)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._no_space(NoSpaceError(self.out, 0, _free(self.out)), i, done) from None
            raise

    def _no_space(self, e: NoSpaceError, i: int, done: dict) -> NoSpaceError:
        """The full-disk error with the room the rest of the prepare needs, estimated from the
        shards written so far (their bytes per byte of text)."""
        written = sum(sum(f["size"] for f in r["files"].values()) for r in done.values())
        text = sum(r["text_bytes"] for r in done.values())
        left = sum(t["bytes"] for j in range(len(self.shards)) if j not in done for t in self.shards[j])
        ratio = written / text if text else self.dtype.itemsize / 2  # about 2 bytes of text per token before any shard
        return NoSpaceError(
            self.out,
            int(left * ratio),
            e.free,
            f"shard {i} did not fit; the {len(self.shards) - len(done)} shards left need about "
            f"{int(left * ratio)} bytes",
        )


def _free(path: Path) -> int:
    import shutil

    return shutil.disk_usage(path).free


class _Lock:
    """One prepare per directory at a time (ranks of a job may all ask for the same cache)."""

    def __init__(self, out: Path):
        self.path = out / ".lock"

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock
            return self
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"prepare: waiting for another prepare of {str(self.path.parent)!r}", file=sys.stderr)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)  # releases the lock


def _bar(enabled: bool, total: int, initial: int):
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="prepare",
        disable=not enabled,
        smoothing=0.1,
    )


def _check_not_bootstrapping() -> None:
    # a worker re-imports the caller's main script; unguarded, that script would prepare again in
    # every worker, each waiting forever on the directory's lock, which the caller holds
    import multiprocessing.process

    if getattr(multiprocessing.process.current_process(), "_inheriting", False):
        raise RuntimeError(
            "prepare() was called while a worker process imported the main script: put the script's code under "
            "`if __name__ == '__main__':`"
        )


def prepare(
    sources: Sequence[str | os.PathLike],
    tokenizer: str | os.PathLike | Tokenizer,
    out: str | os.PathLike,
    *,
    field: str = "text",
    workers: int | None = None,
    val_fraction: float = 0.01,
    split_seed: int = 0,
    shard_mb: float = SHARD_MB,
    exclude: Sequence[str] = DEFAULT_EXCLUDE,
    progress: bool = True,
) -> Path:
    """Tokenize ``sources`` with ``tokenizer`` into ``out`` (see the module docstring); returns
    ``out``. ``workers``: processes (default: one per available core; 0: this process)."""
    _check_not_bootstrapping()
    tok = load_tokenizer(tokenizer)
    kw = dict(
        field_name=field,
        workers=workers,
        val_fraction=val_fraction,
        split_seed=split_seed,
        shard_mb=shard_mb,
        exclude=exclude,
        progress=progress,
    )
    return _Prepare(sources, tok, Path(out), **kw).run()


def default_cache_root() -> Path:
    # experiments/data.py's cache location
    return Path(os.environ.get("SWITCHYARD_CACHE") or "~/.cache/switchyard").expanduser()


def prepare_cached(
    sources: Sequence[str | os.PathLike],
    tokenizer: str | os.PathLike | Tokenizer,
    cache_root: str | os.PathLike | None = None,
    *,
    field: str = "text",
    workers: int | None = None,
    val_fraction: float = 0.01,
    split_seed: int = 0,
    shard_mb: float = SHARD_MB,
    exclude: Sequence[str] = DEFAULT_EXCLUDE,
    progress: bool = False,
) -> Path:
    """``prepare`` into ``<cache_root>/prepared/<key>`` (default root: $SWITCHYARD_CACHE or
    ~/.cache/switchyard), the key a hash of the sources (every input file's path, size and mtime),
    the tokenizer's fingerprint and the parameters: a warm cache returns at once, an interrupted
    one resumes. Returns the directory."""
    _check_not_bootstrapping()
    tok = load_tokenizer(tokenizer)
    root = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()
    kw = dict(
        field_name=field,
        workers=workers,
        val_fraction=val_fraction,
        split_seed=split_seed,
        shard_mb=shard_mb,
        exclude=exclude,
        progress=progress,
    )
    job = _Prepare(sources, tok, root, **kw)
    job.out = root / "prepared" / job.cache_key()[:20]
    return job.run()
