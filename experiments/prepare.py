"""Prepare a corpus for training: tokenize it in parallel into memory-mappable token shards.

    python -m experiments.prepare SOURCES... --tokenizer T --out DIR [--field text] [--workers N]
        [--val-fraction 0.01] [--split-seed 0] [--shard-mb 128] [--exclude NAME]... [--quiet]

Sources, each one or more documents:

- a text file (one document), or a folder, walked recursively in sorted order: its text files (by
  suffix, ``TEXT_SUFFIXES``; hidden names and the ``--exclude`` folders skipped) are documents, its
  ``.jsonl`` / ``.parquet`` files and ``datasets`` folders are read as below. As in
  ``experiments/data.py``'s ``load_text``, a file holding a NUL byte is binary and skipped, and so is
  an empty one or (in a folder) one that is not UTF-8; a file named on the command line is refused
  for those instead;
- ``.jsonl``: one JSON object per line, its ``--field`` (default ``text``) a document;
- ``.parquet``: the ``--field`` column, a document per row (pyarrow);
- a Hugging Face ``datasets`` folder (``save_to_disk``): the ``--field`` column (the ``data`` extra).

``T`` is a tokenizer spec (``experiments.training.tokenizer.load_tokenizer``): ``bytes``, a
``tokenizer.json`` or a model folder. Every document is wrapped in the tokenizer's separator (EOS
after it, or BOS before it where the tokenizer's convention says so), recorded in the manifest.

The split: a document is validation when the XXH3-64 hash of its content (UTF-8, seeded by
``--split-seed``) falls below ``--val-fraction`` of the hash range. By content, not by source path
and ordinal: exact duplicates, common in real corpora (licence headers, mirrored pages, forks),
land on the same side, so the validation loss never scores a document the model trained on; and a
document keeps its side when the corpus is moved, re-sharded into other files or reordered. A
document never straddles the split. Where one side would be empty (a small corpus), the document
nearest the threshold crosses over, so both are non-empty when there are two documents or more.

Work: the sources are planned into tasks of about 256 KiB of text (groups of files, byte ranges of
a .jsonl cut at line ends, row ranges) and consecutive tasks into shards of about ``--shard-mb``
of text; both from the inputs alone, so the bytes never depend on ``--workers``. Worker processes
(spawned; each loads the tokenizer once) tokenize tasks; the main process writes the shards in
order. Each finished shard is recorded (``shard-<i>.json``: a key of its inputs, its files'
checksums) and ``MANIFEST.json`` is written last (``experiments.training.shards`` describes the
format). An interrupted prepare leaves no manifest, so it is never read as complete; a rerun keeps
every recorded shard whose key and checksums still hold and redoes the rest, so it ends with the
same bytes as an uninterrupted run.

``prepare_cached`` keys a directory under the cache by the sources and the tokenizer: the sources
by every input file's path, size and modification time (nanoseconds), not its contents, so a warm
cache is found with one ``stat`` per file instead of a read of the whole corpus (as
``experiments/data.py`` does); the tokenizer by its fingerprint.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from experiments.training.corpus import (  # noqa: F401  (re-exported)
    DEFAULT_EXCLUDE,
    TASK_BYTES,
    TEXT_SUFFIXES,
    VALID_SOURCES,
    Source,
    iter_documents,
    read_task,
    sources_hash,
)
from experiments.training.preparing import (  # noqa: F401  (re-exported)
    PAUSE_ENV,
    SHARD_MB,
    default_cache_root,
    prepare,
    prepare_cached,
)
from experiments.training.shards import read_manifest

# ----------------------------------------------------------------------------- the command line


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.prepare", description="Tokenize a corpus into memory-mappable token shards."
    )
    p.add_argument("sources", nargs="+", help=VALID_SOURCES)
    p.add_argument("--tokenizer", required=True, help="'bytes', a tokenizer.json, or a Hugging Face model folder")
    p.add_argument("--out", required=True, help="the directory to write (a rerun resumes in it)")
    p.add_argument("--field", default="text", help="the text field of .jsonl records / the text column (default: text)")
    p.add_argument("--workers", type=int, default=None, help="tokenizing processes (default: one per core; 0: none)")
    p.add_argument(
        "--val-fraction", type=float, default=0.01, help="share of documents for validation, by content hash"
    )
    p.add_argument("--split-seed", type=int, default=0)
    p.add_argument("--shard-mb", type=float, default=SHARD_MB, help="MiB of text per shard (default: 128)")
    p.add_argument(
        "--exclude",
        action="append",
        default=None,
        help=f"a folder name to skip, repeatable; replaces the default ({', '.join(DEFAULT_EXCLUDE)})",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    try:
        out = prepare(
            a.sources,
            a.tokenizer,
            a.out,
            field=a.field,
            workers=a.workers,
            val_fraction=a.val_fraction,
            split_seed=a.split_seed,
            shard_mb=a.shard_mb,
            exclude=tuple(a.exclude) if a.exclude is not None else DEFAULT_EXCLUDE,
            progress=not a.quiet,
        )
    except (ValueError, OSError, ImportError, RuntimeError) as e:  # FileNotFoundError and NoSpaceError are OSErrors
        print(f"prepare: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"prepare: interrupted; rerun the same command to resume in {a.out!r}", file=sys.stderr)
        return 130
    m = read_manifest(out)
    c = m["counts"]
    print(
        f"prepared {c['docs']} documents ({c['text_bytes']} bytes of text) into {str(out)!r}: "
        f"{c['train']['tokens']} train tokens ({c['train']['docs']} documents), {c['val']['tokens']} val tokens "
        f"({c['val']['docs']} documents), {m['dtype']}, {len(m['shards'])} shards, vocab_size {m['vocab_size']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
