"""Benchmark: a BPE tokenizer against bytes at the same training compute (``experiment=stdlib_bpe``).

    python -m experiments.bench.bpe_compute [--out DIR] [--dry-run] [--corpus stdlib] [OVERRIDE ...]
    python -m experiments.bench.bpe_compute --quick [--out DIR]   # seconds: a check that it runs

The reference is the byte-level default's budget (``python -m experiments.train``: ``model=small``,
400 steps of 16 x 128 tokens), trained on the prepared corpus (``experiment=stdlib_bpe
data.tokenizer=bytes 'data.sources=[{path:stdlib}]'``: the files, split and document masking of the
BPE run, so that the bits per byte compare). The BPE run (``experiment=stdlib_bpe``: the same model
body, the tokenizer's vocabulary of 4096) takes the same batch for the number of steps whose
training FLOPs come nearest the reference's (``matched_steps``). Training FLOPs are
``flops_per_token`` x tokens: ``moe.costs``'s ``model_flops_per_token``, 3 x the forward's matrix
products (the projections, the router, top-k routed experts, attention's scores and weighted values
over the full L x L, causal masking not discounted, and the head over the whole vocabulary; the
embedding lookup is free). Each run's vocabulary is the one the trainer fits (``fit_model_vocab``:
the tokenizer's, padded to a multiple of 64), from the run's data, built once (the tokenizer and the
prepared shards are cached under ``data.cache_dir``: minutes on a cold cache, seconds after).

Both runs: ``logger=none``, no checkpoints (``train.checkpoint.every=0``), a fresh start. The
overrides apply to both, before the BPE run's steps are set (a learning rate or warmup stays the
same in both). Writes ``<out>/bytes`` and ``<out>/bpe`` (each run's ``metrics.jsonl`` and
``summary.json``) and ``<out>/bpe_compute.json``, and prints each run's command as
``python -m experiments.train`` takes it, then a table. ``--dry-run``: the commands only (the data is
still built: the vocabulary comes from it). ``--quick``: ``model=tiny``, a few steps of 4 x 32
tokens, a BPE of up to 1024 ids, on a generated corpus of 24 short documents in a temporary folder (its own
cache there too): it checks the code, its figures mean nothing.

Wall time is the training loop's (``summary.json``'s ``time_s``: validation included), on whatever
else the machine runs; the compute measure is the FLOPs.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import string
import tempfile
from pathlib import Path

BOTH = ["logger=none", "train.progress=false", "train.checkpoint.every=0", "train.resume=none"]
QUICK = [
    "model=tiny",
    "train.steps=6",
    "train.batch_size=4",
    "train.seq_len=32",
    "train.eval_every=6",
    "train.eval_batches=1",
    "train.log_every=1",
    "train.memory_steps=0",
    "optim.warmup_steps=1",
    "data.prepare_workers=0",
    "data.val_fraction=0.3",
]


def flops_per_token(cfg) -> float:
    """Training FLOPs per token of the model of a composed config (its ``model.vocab_size`` as the
    trainer fits it), at its ``train.seq_len``: forward and backward of every matrix product."""
    from experiments.training.schema import model_config
    from moe.costs import model_costs

    return model_costs(model_config(cfg), int(cfg.train.seq_len)).model_flops_per_token()


def matched_steps(ref_flops: float, tokens_per_step: int, flops_per_tok: float) -> int:
    """The steps of ``tokens_per_step`` tokens at ``flops_per_tok`` whose FLOPs come nearest ``ref_flops``."""
    return max(1, round(ref_flops / (tokens_per_step * flops_per_tok)))


def runs(corpus: str, tokenizer: str | None, overrides: list[str]) -> dict[str, list[str]]:
    """Each run's overrides: the byte-level reference on the prepared corpus, then the BPE run."""
    src = f"data.sources=[{{path:{corpus}}}]"
    bpe = ["experiment=stdlib_bpe"] + ([src] if corpus != "stdlib" else [])
    bpe += [f"data.tokenizer={tokenizer}"] if tokenizer else []
    return {
        "bytes": ["experiment=stdlib_bpe", "data.tokenizer=bytes", src, *BOTH, *overrides],
        "bpe": [*bpe, *BOTH, *overrides],
    }


def _fitted(overrides: list[str]):
    """The composed config with the vocabulary the trainer fits, and the run's data."""
    from experiments.plan import compose
    from experiments.training.data import build_data
    from experiments.training.tokenized import fit_model_vocab

    cfg = compose(overrides)
    data = build_data(cfg.data, seed=cfg.seed)
    fit_model_vocab(cfg, data)
    return cfg, data


def command(overrides: list[str]) -> str:
    return "python -m experiments.train " + " ".join(shlex.quote(o) for o in overrides)


def compare(corpus: str, tokenizer: str | None, overrides: list[str], out: Path | None, dry_run: bool = False) -> dict:
    """Both runs at matched FLOPs: their commands, FLOPs and (unless ``dry_run``) results."""
    from experiments.training.loop import train

    plan = runs(corpus, tokenizer, overrides)
    built = {name: _fitted(o) for name, o in plan.items()}
    ref_cfg = built["bytes"][0]
    ref_flops = flops_per_token(ref_cfg) * ref_cfg.train.steps * ref_cfg.train.batch_size * ref_cfg.train.seq_len
    result = {"compute": "moe.costs model_flops_per_token x tokens", "runs": {}}
    for name, (cfg, data) in built.items():
        tokens_per_step = int(cfg.train.batch_size * cfg.train.seq_len)
        fpt = flops_per_token(cfg)
        if name == "bpe":
            cfg.train.steps = matched_steps(ref_flops, tokens_per_step, fpt)
            plan[name] = [o for o in plan[name] if not o.startswith("train.steps=")] + [
                f"train.steps={cfg.train.steps}"
            ]
        steps = int(cfg.train.steps)
        r = {
            "command": command(plan[name]),
            "tokenizer": str(cfg.data.tokenizer),
            "vocab_size": int(cfg.model.vocab_size),
            "steps": steps,
            "tokens": steps * tokens_per_step,
            "flops_per_token": fpt,
            "flops": fpt * steps * tokens_per_step,
        }
        print(r["command"], flush=True)
        if not dry_run:
            s = train(cfg, run_dir=None if out is None else out / name, data=data)
            r |= {
                "params_active": s["params_active"],
                "params_total": s["params_total"],
                "val_loss": s["final_val"]["val_loss"],
                "val_bpb": s["final_val"].get("val_bpb"),
                "time_s": s["time_s"],
            }
        result["runs"][name] = r
    result["flops_ratio"] = result["runs"]["bpe"]["flops"] / result["runs"]["bytes"]["flops"]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "bpe_compute.json").write_text(json.dumps(result, indent=1))
    return result


def quick_corpus(folder: Path, docs: int = 24, words: int = 300) -> Path:
    """``docs`` documents of ``words`` words each, drawn (seeded) from 400 made-up words: enough
    distinct pairs for a BPE of 1024 ids."""
    rng = random.Random(0)
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8))) for _ in range(400)]
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(docs):
        lines = [" ".join(rng.choices(vocab, k=12)) for _ in range(words // 12)]
        (folder / f"doc{i:02d}.txt").write_text(f"# document {i}\n" + "\n".join(lines) + "\n")
    return folder


def table(result: dict) -> str:
    cols = {"run": 6, "vocab": 6, "steps": 6, "tokens": 10, "active": 9, "FLOPs": 10}
    cols |= {"nats/tok": 9, "bpb": 7, "wall s": 7}
    lines = [" ".join(f"{c:>{w}}" for c, w in cols.items())]
    for name, r in result["runs"].items():
        trained = "val_loss" in r  # not after --dry-run

        def fmt(key, spec):
            return format(r[key], spec) if trained and r.get(key) is not None else "-"

        row = (name, r["vocab_size"], r["steps"], f"{r['tokens']:,}", fmt("params_active", ","), f"{r['flops']:.3e}")
        row += (fmt("val_loss", ".4f"), fmt("val_bpb", ".4f"), fmt("time_s", ".0f"))
        lines.append(" ".join(f"{v:>{w}}" for v, w in zip(row, cols.values())))
    lines.append(f"FLOPs bpe / bytes: {result['flops_ratio']:.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m experiments.bench.bpe_compute", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="the runs' folder (default: none written)")
    ap.add_argument("--corpus", default=None, help="a data source both runs prepare (default: stdlib)")
    ap.add_argument("--tokenizer", default=None, help="the BPE run's data.tokenizer (default: the experiment's)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands only")
    ap.add_argument("--quick", action="store_true", help="tiny settings on a generated corpus: a check, seconds")
    a, overrides = ap.parse_known_args(argv)
    with tempfile.TemporaryDirectory(prefix="bpe_compute_") as tmp:
        corpus, tokenizer = a.corpus or "stdlib", a.tokenizer
        if a.quick:
            corpus = a.corpus or str(quick_corpus(Path(tmp) / "corpus"))
            tokenizer = tokenizer or "bpe:1024"
            overrides = [*QUICK, f"data.cache_dir={Path(tmp) / 'cache'}", *overrides]
        result = compare(corpus, tokenizer, overrides, a.out, dry_run=a.dry_run)
    print(table(result))
    return result


if __name__ == "__main__":
    main()
