"""Prepare throughput against the tokenizer library's own batch encoding, over the same files; the
data loader's share of a training step; document masking's cost per step.

    python -m experiments.bench.data [--workers N] [--vocab 8192] [--tokenizer PATH] [--reps 3]
    python -m experiments.bench.data loader [--steps 20] [OVERRIDE ...]
    python -m experiments.bench.data mask [--lengths 512 2048] [--reps 5] [--memory-at 4096]

``loader`` and ``mask``: see ``loader_share`` and ``mask_cost`` (experiments/bench/data_step.py).

The corpus is the one ``experiments/data.py``'s ``load_stdlib`` reads: the running Python's
standard library ``.py`` files (``sysconfig``'s stdlib folder, without ``site-packages``,
``dist-packages`` and ``__pycache__``), the UTF-8 ones (a handful of encoding tests are not), copied
into a temporary folder so that ``prepare`` walks exactly those files. The tokenizer is a byte-level
BPE trained on that corpus by ``train_bpe`` (cached), or ``--tokenizer``.

In one run, with the same parallelism N (``--workers``, default: the cores available):

- ``encode_batch``: ``tokenizers.Tokenizer.encode_batch`` of every document at once, in memory
  (already read and decoded), its Rust thread pool at N threads (``RAYON_NUM_THREADS``), no
  special tokens; also ``encode_batch_fast`` (no offsets), which prepare's workers call;
- ``prepare``: ``experiments.prepare.prepare`` of the folder into a fresh directory with N worker
  processes: starting them, reading the files, hashing for the split, tokenizing, writing and
  checksumming the shards, the manifest. Imports are outside the timing on both sides (prepare's
  manifest write imports ``zero.checkpoint``, hence torch, once; it is imported before).

Throughput is MB (10^6 bytes) of UTF-8 text per second, the best of ``--reps``; the ratio is
prepare's over ``encode_batch``'s (goal >= 0.9).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path

EXCLUDE = ("site-packages", "dist-packages", "__pycache__")  # load_stdlib's


def stdlib_corpus(dest: Path) -> tuple[list[str], int]:
    """Copy the stdlib's UTF-8 ``.py`` files under ``dest``; their texts in prepare's order (sorted
    walk) and their total UTF-8 bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    n = 0
    for p in sorted(root.glob("**/*.py")):
        rel = p.relative_to(root)
        if any(part in EXCLUDE or part.startswith(".") for part in rel.parts[:-1]) or not p.is_file():
            continue
        data = p.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not data or b"\x00" in data:
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_bytes(data)
        n += len(data)
    from experiments.prepare import iter_documents

    texts = list(iter_documents([dest], exclude=EXCLUDE))
    return texts, n


def main(argv=None) -> None:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("loader", "mask"):
        from experiments.bench import data_step

        return data_step.main(argv)
    ap = argparse.ArgumentParser(prog="python -m experiments.bench.data", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--workers",
        type=int,
        default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    )
    ap.add_argument("--vocab", type=int, default=8192, help="train_bpe's vocabulary (without --tokenizer)")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer.json to use instead of training one")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    # before the Rust thread pool starts (train_bpe starts it): the baseline's parallelism is N threads
    os.environ["RAYON_NUM_THREADS"] = str(a.workers)

    import tokenizers

    from experiments.prepare import prepare
    from experiments.training.shards import PreparedDataset
    from experiments.training.tokenizer import train_bpe
    from zero.checkpoint import write_durably  # noqa: F401  (imported once, outside the timing)

    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        tmp = Path(tmp)
        corpus = tmp / "stdlib"
        corpus.mkdir()
        texts, nbytes = stdlib_corpus(corpus)
        mb = nbytes / 1e6
        t0 = time.perf_counter()
        tok_path = Path(a.tokenizer) if a.tokenizer else train_bpe(texts, a.vocab)
        trained = time.perf_counter() - t0
        raw = tokenizers.Tokenizer.from_file(str(tok_path))
        print(
            f"corpus: {len(texts)} stdlib .py files, {mb:.1f} MB; tokenizer {tok_path} ({raw.get_vocab_size()} ids",
            end="",
        )
        print(f", trained or loaded from the cache in {trained:.1f} s)" if not a.tokenizer else ")")
        print(f"parallelism: {a.workers} (tokenizers' threads / prepare's worker processes), best of {a.reps}\n")

        dirs = []

        def run_prepare():
            dirs.append(tmp / f"out{len(dirs)}")
            prepare([corpus], tok_path, dirs[-1], workers=a.workers, exclude=EXCLUDE, progress=False)

        # the three interleaved, rep after rep: a shared machine's load drifts, and each side sees the same drift
        runs = {
            "encode_batch": lambda: raw.encode_batch(texts, add_special_tokens=False),
            "encode_batch_fast": lambda: raw.encode_batch_fast(texts, add_special_tokens=False),
            "prepare": run_prepare,
        }
        times = {name: [] for name in runs}
        for _ in range(a.reps):
            for name, fn in runs.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        t_batch, t_fast, t_prep = (min(times[n]) for n in runs)
        ds = PreparedDataset(dirs[-1], verify=True)
        c = ds.manifest["counts"]
        assert c["docs"] == len(texts) and c["text_bytes"] == nbytes, (c, len(texts), nbytes)
        n_tokens = c["train"]["tokens"] + c["val"]["tokens"] - c["docs"]  # less each document's EOS
        shutil.rmtree(corpus)

    rows = [
        ("tokenizers encode_batch (in memory)", t_batch),
        ("tokenizers encode_batch_fast (in memory)", t_fast),
        ("experiments.prepare (files -> shards)", t_prep),
    ]
    print(f"{'':44s}{'seconds':>10s}{'MB/s':>10s}{'Mtok/s':>10s}")
    for name, t in rows:
        print(f"{name:44s}{t:10.2f}{mb / t:10.2f}{n_tokens / t / 1e6:10.2f}")
    print(f"\nprepare / encode_batch: {t_batch / t_prep:.2f}x   prepare / encode_batch_fast: {t_fast / t_prep:.2f}x")
    print(
        f"{n_tokens} tokens ({n_tokens / nbytes:.3f} per byte), {len(ds.manifest['shards'])} shard(s), {ds.dtype.name}"
    )
    # all of them: on a shared machine the spread says how far to trust the best
    print("every run (s): " + "; ".join(f"{name} " + " ".join(f"{t:.2f}" for t in ts) for name, ts in times.items()))


if __name__ == "__main__":
    main()
