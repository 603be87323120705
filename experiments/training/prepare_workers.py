"""The tokenizing side of ``experiments.prepare``: a worker turns one planned task into its
documents' ids, split by content hash (``_Worker``), in this process or in spawned worker processes
(``results``). Moved out of ``experiments.training.preparing``, which writes what they return.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np
import xxhash

from experiments.training.corpus import read_task
from experiments.training.shards import SPLITS
from experiments.training.tokenizer import Tokenizer


class _Worker:
    def __init__(self, tokenizer: Tokenizer, field_name: str, threshold: int, split_seed: int, dtype: str):
        self.tok, self.field, self.threshold, self.seed = tokenizer, field_name, threshold, split_seed
        self.dtype = np.dtype(dtype)

    def run(self, task: dict) -> dict:
        skipped: Counter = Counter()
        docs = {s: [] for s in SPLITS}
        extremes: dict = {"train_min": None, "val_max": None}
        text_bytes = {s: 0 for s in SPLITS}
        for text, nul_at in read_task(task, self.field, skipped):
            if nul_at and self.tok.kind == "bytes":
                raise ValueError(
                    f"{nul_at}: the text holds a NUL character, which the bytes tokenizer reserves as its document "
                    "separator; remove it, or use a tokenizer.json"
                )
            raw = text.encode("utf-8")
            u = xxhash.xxh3_64_intdigest(raw, seed=self.seed)
            split = "val" if u < self.threshold else "train"
            text_bytes[split] += len(raw)
            k = len(docs[split])
            # the document that may cross the split, with its text bytes
            if split == "train" and (extremes["train_min"] is None or u < extremes["train_min"][0]):
                extremes["train_min"] = [u, k, len(raw)]
            if split == "val" and (extremes["val_max"] is None or u > extremes["val_max"][0]):
                extremes["val_max"] = [u, k, len(raw)]
            docs[split].append(text)
        out = {"source": task["source"], "text_bytes": text_bytes, "skipped": dict(skipped), **extremes}
        for split in SPLITS:
            if docs[split]:
                out[split] = self.tok.encode_documents(docs[split], self.dtype)
            else:
                out[split] = (np.zeros(0, dtype=self.dtype), np.zeros(0, dtype=np.int64))
        return out


_WORKER: _Worker | None = None


def _watch_parent(ppid: int) -> None:
    # a prepare killed with SIGKILL cannot stop its workers, which would wait on its queue forever
    while True:
        time.sleep(1.0)
        if os.getppid() != ppid:
            os._exit(1)


def _init_worker(args: tuple) -> None:
    # the workers are the parallelism: one thread each, or N processes x N tokenizer threads thrash
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    # Ctrl-C is the main process's to handle (it stops the workers): no traceback from every worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    global _WORKER
    _WORKER = _Worker(*args)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()


def _run_task(task: dict) -> dict:
    return _WORKER.run(task)


def results(tasks: list[dict], args: tuple, workers: int) -> Iterator[dict]:
    """The tokenized ``tasks`` in order: in this process (``workers=0``) or in that many spawned worker
    processes, each holding a ``_Worker(*args)``, at most ``2 x workers`` tasks ahead."""
    if workers == 0 or not tasks:
        worker = _Worker(*args)
        for t in tasks:
            yield worker.run(t)
        return
    import multiprocessing

    # spawn: a fresh interpreter per worker, never a fork of this process's threads, locks or started
    # tokenizer thread pool. (forkserver would not save the workers' import of the caller's main module:
    # CPython 3.11's forkserver does not preload __main__, measured here, so each worker imports it anyway.)
    ex = ProcessPoolExecutor(
        min(workers, len(tasks)),
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(args,),
    )
    pending: deque = deque()
    it = iter(tasks)
    finished = False
    try:
        for t in it:
            pending.append(ex.submit(_run_task, t))
            if len(pending) >= 2 * workers:
                break
        while pending:
            try:
                res = pending.popleft().result()
            except BrokenProcessPool:
                raise RuntimeError(
                    "a tokenizing worker process died (out of memory? its own error, if any, is printed above); "
                    "rerun to resume, with fewer --workers"
                ) from None
            t = next(it, None)
            if t is not None:
                pending.append(ex.submit(_run_task, t))
            yield res
        finished = True
    finally:
        if not finished:
            # an error or an interrupt: stop the workers now rather than after their current tasks
            for f in pending:
                f.cancel()
            for p in list((getattr(ex, "_processes", None) or {}).values()):
                p.terminate()
        ex.shutdown(wait=True, cancel_futures=True)
