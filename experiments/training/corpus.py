"""The sources of ``python -m experiments.prepare``: planned into tasks, and read into documents.

Planning walks the sources (text files, folders, .jsonl, .parquet, ``datasets`` folders; see
``experiments.prepare``) into tasks of about ``TASK_BYTES`` of text and records every input file's
path, size and modification time for ``sources_hash``; reading turns one task into its documents
(``read_task``), or all the sources into theirs in one process (``iter_documents``).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

TEXT_SUFFIXES = frozenset(
    ".txt .text .md .markdown .rst .tex .org .html .htm .xml .css .py .pyi .pyx .c .h .cc .cpp .cxx .hh .hpp .cu .cuh "
    ".rs .go .java .kt .scala .swift .m .mm .js .jsx .ts .tsx .sh .bash .zsh .fish .ps1 .toml .yaml .yml .ini .cfg "
    ".sql .r .jl .lua .rb .php .pl .hs .ml .ex .exs .erl .clj .el .vim .cmake .mk .proto".split()
)
DEFAULT_EXCLUDE = ("__pycache__", "node_modules", "site-packages", "dist-packages")
TASK_BYTES = 1 << 18  # small enough that the last tasks leave no worker idle for long
VALID_SOURCES = (
    "text files and folders (" + ", ".join(sorted(TEXT_SUFFIXES)[:6]) + ", ...), .jsonl with one JSON object per line, "
    ".parquet, or a datasets save_to_disk folder"
)


# ----------------------------------------------------------------------------- planning


@dataclass
class Source:
    given: str
    path: Path
    kind: str  # text | folder | jsonl | parquet | datasets
    entries: list = field(default_factory=list)  # [kind, path, size, mtime_ns] of every input file, for the hash
    skipped: Counter = field(default_factory=Counter)

    def describe(self) -> dict:
        return {"path": str(self.path), "kind": self.kind, "files": len(self.entries)}


def _stat(p: Path) -> tuple[int, int]:
    try:
        s = p.stat()
    except OSError as e:
        raise FileNotFoundError(f"source file {str(p)!r} cannot be read ({e.strerror})") from None
    return s.st_size, s.st_mtime_ns


def _is_dataset_dir(d: Path) -> bool:
    return (d / "dataset_dict.json").is_file() or ((d / "state.json").is_file() and (d / "dataset_info.json").is_file())


def _import_optional(name: str, what: str):
    try:
        return __import__(name)
    except ImportError:
        raise ImportError(f"reading {what} needs {name}: pip install -e '.[data]'") from None


class _Planner:
    def __init__(self, field_name: str, exclude: Sequence[str], task_bytes: int, skip: Sequence[Path] = ()):
        self.field, self.exclude, self.task_bytes = field_name, set(exclude), task_bytes
        self.skip = {Path(p).expanduser().resolve() for p in skip}  # the output, should it lie inside a source
        self.tasks: list[dict] = []

    def plan(self, sources: Sequence[str | os.PathLike]) -> list[Source]:
        if isinstance(sources, (str, os.PathLike)):  # one source, not its characters
            sources = [sources]
        if not sources:
            raise ValueError(f"no sources given: expected {VALID_SOURCES}")
        out = []
        for i, given in enumerate(sources):
            p = Path(given).expanduser()
            if not p.exists():
                raise FileNotFoundError(f"source {str(given)!r} not found: expected {VALID_SOURCES}")
            p = p.resolve()
            if p.is_dir():
                src = Source(str(given), p, "datasets" if _is_dataset_dir(p) else "folder")
                if src.kind == "datasets":
                    self._datasets(i, src, p)
                else:
                    self._folder(i, src, p)
            else:
                kind = {".jsonl": "jsonl", ".parquet": "parquet"}.get(p.suffix.lower(), "text")
                src = Source(str(given), p, kind)
                self._file(i, src, p, kind, strict=True)
            if not src.entries:
                raise ValueError(
                    f"source {str(given)!r} holds no documents ({_skipped_text(src.skipped)}); expected {VALID_SOURCES}"
                )
            out.append(src)
        return out

    def _folder(self, i: int, src: Source, root: Path) -> None:
        pending: list[Path] = []  # consecutive text files, grouped into tasks
        for dirpath, dirnames, filenames in os.walk(root):
            d = Path(dirpath)
            for name in sorted(filenames):
                p = d / name
                if name.startswith(".") or not p.is_file():
                    continue
                suffix = p.suffix.lower()
                if suffix in (".jsonl", ".parquet"):
                    self._flush_text(i, src, pending)
                    self._file(i, src, p, suffix[1:], strict=False)
                elif suffix in TEXT_SUFFIXES:
                    pending.append(p)
                else:
                    src.skipped["other suffix"] += 1
            keep = []
            for name in sorted(dirnames):
                if name.startswith(".") or name in self.exclude or (d / name).resolve() in self.skip:
                    continue
                if _is_dataset_dir(d / name):
                    self._flush_text(i, src, pending)
                    self._datasets(i, src, d / name)
                else:
                    keep.append(name)
            dirnames[:] = keep  # os.walk descends into these next, in this (sorted) order
        self._flush_text(i, src, pending)

    def _flush_text(self, i: int, src: Source, paths: list[Path]) -> None:
        group, size = [], 0
        for p in paths:
            n, mtime = _stat(p)
            if n == 0:
                src.skipped["empty"] += 1
                continue
            src.entries.append(["text", str(p), n, mtime])
            group.append([str(p), n, mtime, False])
            size += n
            if size >= self.task_bytes:
                self.tasks.append({"kind": "text", "source": i, "files": group, "bytes": size})
                group, size = [], 0
        if group:
            self.tasks.append({"kind": "text", "source": i, "files": group, "bytes": size})
        paths.clear()

    def _file(self, i: int, src: Source, p: Path, kind: str, strict: bool) -> None:
        n, mtime = _stat(p)
        if n == 0:
            if strict:
                raise ValueError(f"source {str(p)!r} is empty: no documents; expected {VALID_SOURCES}")
            src.skipped["empty"] += 1
            return
        ident = [str(p), n, mtime]
        src.entries.append([kind, *ident])
        if kind == "text":
            self.tasks.append({"kind": "text", "source": i, "files": [[*ident, strict]], "bytes": n})
        elif kind == "jsonl":
            cuts = _line_cuts(p, n, self.task_bytes)
            for a, b in zip(cuts, cuts[1:]):
                self.tasks.append({"kind": "jsonl", "source": i, "file": ident, "start": a, "stop": b, "bytes": b - a})
        else:
            self._parquet(i, p, ident)

    def _parquet(self, i: int, p: Path, ident: list) -> None:
        _import_optional("pyarrow", ".parquet files")
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(p)
        except Exception as e:  # pyarrow raises ArrowInvalid and friends
            raise ValueError(f"source {str(p)!r} is not a readable parquet file ({e})") from None
        schema = pf.schema_arrow
        if self.field not in schema.names:
            raise ValueError(
                f"source {str(p)!r} has no column {self.field!r} (its columns: {schema.names[:20]}); "
                "pass --field with the name of the text column"
            )
        ftype = schema.field(self.field).type
        if not (pa.types.is_string(ftype) or pa.types.is_large_string(ftype) or str(ftype) == "string_view"):
            raise ValueError(f"source {str(p)!r}: column {self.field!r} holds {ftype}, expected strings")
        md = pf.metadata
        leaf = next((j for j in range(md.num_columns) if md.schema.column(j).path == self.field), None)
        first = 0
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            rows = rg.num_rows
            nbytes = rg.column(leaf).total_uncompressed_size if leaf is not None else rg.total_byte_size
            step = max(1, math.ceil(rows * self.task_bytes / max(nbytes, 1)))
            for a in range(0, rows, step):
                b = min(rows, a + step)
                est = nbytes * (b - a) // max(rows, 1)
                self.tasks.append(
                    {
                        "kind": "parquet",
                        "source": i,
                        "file": ident,
                        "row_group": g,
                        "first_row": first,
                        "start": a,
                        "stop": b,
                        "bytes": est,
                    }
                )
            first += rows

    def _datasets(self, i: int, src: Source, d: Path) -> None:
        datasets = _import_optional("datasets", "a datasets folder")
        if (d / "dataset_dict.json").is_file():
            splits = json.loads((d / "dataset_dict.json").read_text()).get("splits", [])
            raise ValueError(
                f"source {str(d)!r} is a DatasetDict (splits {splits}): pass one split's folder, "
                f"e.g. {str(d / (splits[0] if splits else 'train'))!r}"
            )
        try:
            ds = datasets.load_from_disk(str(d))
        except Exception as e:
            raise ValueError(f"source {str(d)!r} is not a readable datasets folder ({e})") from None
        if self.field not in ds.column_names:
            raise ValueError(
                f"source {str(d)!r} has no column {self.field!r} (its columns: {ds.column_names[:20]}); "
                "pass --field with the name of the text column"
            )
        dtype = getattr(ds.features[self.field], "dtype", None)
        if dtype not in ("string", "large_string"):
            raise ValueError(
                f"source {str(d)!r}: column {self.field!r} holds {ds.features[self.field]}, expected strings"
            )
        files = []
        for p in sorted(d.iterdir()):
            if p.is_file():
                n, mtime = _stat(p)
                files.append([p.name, n, mtime])
                src.entries.append(["datasets", str(p), n, mtime])
        ident = [str(d), xxhash.xxh3_128(json.dumps(files).encode()).hexdigest()]
        rows = ds.num_rows
        nbytes = ds.data.nbytes
        step = max(1, math.ceil(rows * self.task_bytes / max(nbytes, 1)))
        for a in range(0, rows, step):
            b = min(rows, a + step)
            self.tasks.append(
                {
                    "kind": "datasets",
                    "source": i,
                    "dir": ident,
                    "start": a,
                    "stop": b,
                    "bytes": nbytes * (b - a) // max(rows, 1),
                }
            )


def _line_cuts(p: Path, size: int, task_bytes: int) -> list[int]:
    """Offsets cutting ``p`` into ranges of about ``task_bytes``, each just after a newline."""
    cuts = [0]
    with open(p, "rb") as f:
        pos = task_bytes
        while pos < size:
            f.seek(pos)
            while True:
                chunk = f.read(1 << 16)
                if not chunk:
                    pos = size
                    break
                k = chunk.find(b"\n")
                if k >= 0:
                    pos += k + 1
                    break
                pos += len(chunk)
            if pos >= size:
                break
            cuts.append(pos)
            pos += task_bytes
    cuts.append(size)
    return cuts


def _skipped_text(skipped: Counter) -> str:
    if not skipped:
        return "no usable files"
    return "skipped: " + ", ".join(f"{n} {why}" for why, n in sorted(skipped.items()))


def sources_hash(sources: list[Source], field_name: str) -> str:
    """Of every input file's kind, path, size and mtime (ns), in order, and the field read."""
    return xxhash.xxh3_128(json.dumps([field_name, [s.entries for s in sources]]).encode()).hexdigest()


# ----------------------------------------------------------------------------- reading documents


def _read_text_files(task: dict, skipped: Counter) -> Iterator[str]:
    for path, _, _, strict in task["files"]:
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise FileNotFoundError(f"source file {path!r} cannot be read ({e.strerror})") from None
        if not data:  # emptied since planning
            if strict:
                raise ValueError(f"source {path!r} is empty: no documents; expected {VALID_SOURCES}")
            skipped["empty"] += 1
            continue
        if b"\x00" in data:
            if strict:
                raise ValueError(
                    f"source {path!r} holds a NUL byte at offset {data.index(0)}: it is binary, not text; "
                    f"expected {VALID_SOURCES}"
                )
            skipped["binary"] += 1
            continue
        try:
            yield data.decode("utf-8")
        except UnicodeDecodeError as e:
            if strict:
                raise ValueError(
                    f"source {path!r} is not UTF-8 text (byte offset {e.start}: {e.reason}); re-encode it as UTF-8"
                ) from None
            skipped["not UTF-8"] += 1


def _jsonl_line(path: str, start: int, local: int) -> int:
    # line numbers are counted only for an error: the task starts at a byte offset
    with open(path, "rb") as f:
        before = f.read(start).count(b"\n")
    return before + local + 1


def _read_jsonl(task: dict, field_name: str, skipped: Counter) -> Iterator[tuple[str, str]]:
    path = task["file"][0]
    with open(path, "rb") as f:
        f.seek(task["start"])
        data = f.read(task["stop"] - task["start"])
    for j, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            where = f"{path}:{_jsonl_line(path, task['start'], j)}"
            why = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else f"not UTF-8: {e.reason}"
            raise ValueError(
                f"{where}: not valid JSON ({why}); a .jsonl file holds one JSON object per line, "
                f'e.g. {{"{field_name}": "..."}}'
            ) from None
        if not isinstance(rec, dict) or field_name not in rec:
            where = f"{path}:{_jsonl_line(path, task['start'], j)}"
            has = f"it has {list(rec)[:10]}" if isinstance(rec, dict) else f"it is a JSON {type(rec).__name__}"
            raise ValueError(
                f"{where}: the record has no field {field_name!r} ({has}); pass --field with the name of the text field"
            )
        text = rec[field_name]
        if not isinstance(text, str):
            where = f"{path}:{_jsonl_line(path, task['start'], j)}"
            raise ValueError(f"{where}: field {field_name!r} is a JSON {type(text).__name__}, expected a string")
        if not text:
            skipped["empty"] += 1
            continue
        yield text, f"{path}:{_jsonl_line(path, task['start'], j)}" if "\x00" in text else ""


_COLUMN_CACHE: dict = {}


def _read_column(task: dict, field_name: str) -> tuple[list, str, int]:
    """The task's values, a name for messages and the row number of its first value."""
    if task["kind"] == "parquet":
        import pyarrow.parquet as pq

        path, g = task["file"][0], task["row_group"]
        key = ("parquet", path, g)
        if key not in _COLUMN_CACHE:
            _COLUMN_CACHE.clear()  # one row group at a time: consecutive tasks share it
            _COLUMN_CACHE[key] = pq.ParquetFile(path).read_row_group(g, columns=[field_name]).column(0)
        col = _COLUMN_CACHE[key]
        return (
            col.slice(task["start"], task["stop"] - task["start"]).to_pylist(),
            path,
            task["first_row"] + task["start"],
        )
    import datasets

    path = task["dir"][0]
    key = ("datasets", path)
    if key not in _COLUMN_CACHE:
        _COLUMN_CACHE.clear()
        _COLUMN_CACHE[key] = datasets.load_from_disk(path).with_format("arrow", columns=[field_name])
    table = _COLUMN_CACHE[key][task["start"] : task["stop"]]
    return table.column(field_name).to_pylist(), path, task["start"]


def _read_records(task: dict, field_name: str, skipped: Counter) -> Iterator[tuple[str, str]]:
    values, name, first = _read_column(task, field_name)
    for j, text in enumerate(values):
        if text is None:
            raise ValueError(f"{name}: row {first + j} has no {field_name!r} (null); every row needs a string")
        if not text:
            skipped["empty"] += 1
            continue
        yield text, f"{name}: row {first + j}" if "\x00" in text else ""


def read_task(task: dict, field_name: str, skipped: Counter) -> Iterator[tuple[str, str]]:
    """``(document, where)`` per document of a task; ``where`` names a document holding a NUL
    character (else ""), which the bytes tokenizer cannot take (NUL is its separator)."""
    if task["kind"] == "text":
        for text in _read_text_files(task, skipped):
            yield text, ""  # a file with a NUL byte is binary, never a document
    elif task["kind"] == "jsonl":
        yield from _read_jsonl(task, field_name, skipped)
    else:
        yield from _read_records(task, field_name, skipped)


def iter_documents(
    sources: Sequence[str | os.PathLike], field_name: str = "text", exclude=DEFAULT_EXCLUDE
) -> Iterator[str]:
    """The sources' documents, in prepare's order (one process; for ``train_bpe``)."""
    planner = _Planner(field_name, exclude, TASK_BYTES)
    planner.plan(sources)
    for task in planner.tasks:
        for text, _ in read_task(task, field_name, Counter()):
            yield text
