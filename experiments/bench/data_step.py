"""The data side of a training step: the loader's share of it, and document masking's cost.

    python -m experiments.bench.data loader [--steps 20] [OVERRIDE ...]
    python -m experiments.bench.data mask [--lengths 512 2048] [--batch 2] [--reps 5] [--memory-at 4096]

``loader``: a ``Trainer`` of the config (the default ``python -m experiments.train`` one, plus any Hydra
overrides, e.g. ``data.document_mask=true`` or ``experiment=stdlib_bpe``) runs ``--steps`` optimizer
steps after two warm-up steps; the time inside ``get_batch`` (drawing the rows, reading the windows,
finding their documents) over the time of the whole step is the loader's share (goal < 1%).

``mask``: forward and backward of the default model (``model=small``, byte vocabulary) on ``--batch``
rows of L tokens packed from documents of random lengths (mean L/8), with ``doc_ids`` (SDPA with the
boolean block-diagonal causal mask) against without (SDPA's causal kernel), interleaved rep after rep
(a shared machine's load drifts; each side sees the same drift); the median of ``--reps``. Then, at
``--memory-at``, the peak resident memory of one forward and backward, each side in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def loader_share(overrides: list[str], steps: int) -> dict:
    from hydra import compose, initialize_config_dir

    from experiments.training.loop import Trainer

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["logger=none", "train.progress=false", *overrides])
    trainer = Trainer(cfg, run_dir=None)
    trainer.sums = trainer._new_sums()
    data = trainer.data
    get_batch, spent = data.get_batch, []

    def timed(*a, **kw):
        t = time.perf_counter()
        out = get_batch(*a, **kw)
        spent.append(time.perf_counter() - t)
        return out

    data.get_batch = timed  # this instance only
    for step in range(2):
        trainer.train_step(step)
    spent.clear()
    t = time.perf_counter()
    for step in range(2, 2 + steps):
        trainer.train_step(step)
    total = time.perf_counter() - t
    trainer.ckpts.close()
    return {"step_s": total / steps, "loader_s": sum(spent) / steps, "share": sum(spent) / total}


def _model(L: int):
    from moe import MoEConfig
    from moe.model import Transformer, TransformerConfig

    moe = MoEConfig(d_model=64, d_ff=256, num_experts=8, top_k=2)
    return Transformer(
        TransformerConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, d_ff=256, max_seq_len=L, moe=moe)
    )


def _batch(B: int, L: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 256, (B, L), generator=g)
    # documents of random lengths, mean L/8: a boundary every L/8 tokens on average
    starts = torch.rand(B, L, generator=g) < 8 / L
    starts[:, 0] = True
    return idx, starts.long().cumsum(1)


def _step(model, idx, docs):
    model.zero_grad(set_to_none=True)
    logits = model(idx, doc_ids=docs)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.roll(-1, 1).flatten()).backward()


def mask_cost(lengths: list[int], batch: int, reps: int) -> list[dict]:
    out = []
    for L in lengths:
        torch.manual_seed(0)
        model = _model(L)
        idx, docs = _batch(batch, L)
        times = {"none": [], "mask": []}
        for _ in range(2):  # warm-up
            _step(model, idx, None)
            _step(model, idx, docs)
        for _ in range(reps):
            for name, d in (("none", None), ("mask", docs)):
                t = time.perf_counter()
                _step(model, idx, d)
                times[name].append(time.perf_counter() - t)
        none, mask = statistics.median(times["none"]), statistics.median(times["mask"])
        out.append({"L": L, "none_s": none, "mask_s": mask, "ratio": mask / none})
    return out


def _peak_child(L: int, batch: int, masked: bool) -> None:
    torch.manual_seed(0)
    model = _model(L)
    idx, docs = _batch(batch, L)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _step(model, idx, docs if masked else None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_kib": peak, "step_kib": peak - before}))


def peak_memory(L: int, batch: int) -> dict:
    out = {}
    for name, masked in (("none", False), ("mask", True)):
        code = f"from experiments.bench.data_step import _peak_child; _peak_child({L}, {batch}, {masked})"
        p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
        out[name] = json.loads(p.stdout.strip().splitlines()[-1])["step_kib"] / 1024
    return out


def main(argv: list[str]) -> None:
    what, rest = argv[0], argv[1:]
    torch.set_num_threads(1)  # a shared 2-core machine: one thread is the fair, steady figure
    if what == "loader":
        ap = argparse.ArgumentParser(prog="python -m experiments.bench.data loader")
        ap.add_argument("--steps", type=int, default=20)
        a, overrides = ap.parse_known_args(rest)
        r = loader_share(overrides, a.steps)
        print(f"overrides: {' '.join(overrides) or '(the default run)'}")
        print(
            f"step {r['step_s'] * 1e3:.1f} ms, of which get_batch {r['loader_s'] * 1e3:.3f} ms: "
            f"{100 * r['share']:.2f}% of the step"
        )
        return
    ap = argparse.ArgumentParser(prog="python -m experiments.bench.data mask")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--memory-at", type=int, default=4096)
    a = ap.parse_args(rest)
    print(f"model=small (d_model 64, 4 blocks, 8 experts top-2), B={a.batch}, one thread, median of {a.reps}")
    print(f"{'L':>6s}{'no mask (s)':>14s}{'doc mask (s)':>14s}{'ratio':>8s}")
    for r in mask_cost(a.lengths, a.batch, a.reps):
        print(f"{r['L']:6d}{r['none_s']:14.3f}{r['mask_s']:14.3f}{r['ratio']:8.2f}")
    if a.memory_at:
        m = peak_memory(a.memory_at, a.batch)
        print(
            f"peak resident memory of one step at L={a.memory_at}, B={a.batch}: no mask {m['none']:.0f} MiB, "
            f"doc mask {m['mask']:.0f} MiB (the boolean mask alone: {a.batch * a.memory_at**2 / 2**20:.0f} MiB)"
        )
