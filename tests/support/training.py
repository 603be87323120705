"""What the trainer's tests share: tiny overrides, composing a config, running it, reading its
metrics, and comparing two trainings of the same global batch (tests/experiments, tests/zero,
tests/hf)."""

import copy
import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments.train import train
from tests.support.paths import CONF

# shrink whatever a config chooses to seconds of CPU, keeping its structure (groups, flags, ratios)
TINY = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.d_ff=64",
    "train.steps=2",
    "train.batch_size=4",
    "train.seq_len=16",
    "train.eval_batches=1",
    "train.eval_every=1",
    "train.log_every=1",
    "train.progress=false",
    "optim.warmup_steps=1",
]


def cfg_of(*overrides):
    """``conf/train.yaml`` composed with ``overrides``, a fresh copy each call (the composed tree is
    kept per override list: Hydra takes ~0.3 s a compose, a copy ~0.02 s, and the suite composes
    the same few lists hundreds of times)."""
    return copy.deepcopy(_composed(tuple(overrides)))


@functools.cache
def _composed(overrides: tuple[str, ...]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def run(cfg, tmp_path, stdlib, name="run", **kw):
    data = stdlib if cfg.data.source == "stdlib" else None
    return train(cfg, run_dir=tmp_path / name, data=data, **kw)


def metrics_rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


SHORT = [
    "model=tiny",
    "logger=none",
    "train.progress=false",
    "train.batch_size=8",
    "train.seq_len=32",
    "train.eval_batches=2",
    "optim.warmup_steps=2",
]


# Comparing two trainings of the same model on the same global batch (fp32): every step's loss and
# gradient norm, and the final weights. The losses alone hide a wrong gradient scale: AdamW divides
# it out and clipping rescales it, so a run whose reduced gradients are all 4x too large logs the
# same losses; its gradient norm is 4x, and its weights move differently wherever eps matters.
# The runs differ only in summation order (micro-batches, all-reduce, per-rank matmul blocks):
# ~1e-7 relative per operation, compounded over a forward, a backward and 3 AdamW steps. Measured
# over the accumulation run and the 8 layouts below: losses <= 1.8e-7 relative, gradient norms
# <= 1.9e-7 relative, weights <= 1.7e-6 absolute. Tolerances are ~10x that:
LOSS_RTOL = GNORM_RTOL = 2e-6  # a wrongly scaled gradient moves the norm by O(1)
# Weights: AdamW's update g / (|g| + eps) turns a rounding difference dg of a gradient entry near
# eps = 1e-8 into lr * dg / eps (lr 3e-3, dg ~ 1e-11: a few 1e-6), whatever the weight's size, so
# the tolerance is absolute. 1e-5 is still 300x below one step's lr: an update that goes another
# way (a wrong gradient, a different eps regime) shows as ~1e-3.
WEIGHT_ATOL = 1e-5


def check_same_training(got, got_rows, ref, ref_rows, what):
    np.testing.assert_allclose(got["train_losses"], ref["train_losses"], rtol=LOSS_RTOL, err_msg=f"{what}: losses")
    assert [r["step"] for r in got_rows] == [r["step"] for r in ref_rows] == list(range(1, len(ref_rows) + 1)), what
    np.testing.assert_allclose(
        [r["grad_norm"] for r in got_rows],
        [r["grad_norm"] for r in ref_rows],
        rtol=GNORM_RTOL,
        err_msg=f"{what}: gradient norms",
    )
    assert set(got["weights"]) == set(ref["weights"]), what
    for name, w in ref["weights"].items():
        torch.testing.assert_close(
            got["weights"][name], w, rtol=0, atol=WEIGHT_ATOL, msg=lambda m: f"{what}: final {name}: {m}"
        )
    # and the runs trained: equal weights after 3 steps would also hold for two frozen models
    assert ref["train_losses"][-1] < ref["train_losses"][0], what


def assemble_weights(per_rank: list[dict], ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole model from the ranks' weights: an expert weight is the concatenation of the slices
    of one ep group (ep_rank order); every other rank holds a replica, which must be identical."""
    ep = per_rank[0]["layout"]["ep"]
    full = {}
    for name, want in ref.items():
        by_ep_rank = {}
        for s in per_rank:
            w = s["weights"][name]
            ep_rank = s["layout"]["rank"] % ep
            first = by_ep_rank.setdefault(ep_rank, w)
            # replicas updated from the same reduced gradients by the same arithmetic: bit for bit
            assert torch.equal(w, first), f"{name}: rank {s['layout']['rank']} differs from its replica"
        if by_ep_rank[0].shape == want.shape:
            assert all(torch.equal(w, by_ep_rank[0]) for w in by_ep_rank.values()), f"{name} differs between ep ranks"
            full[name] = by_ep_rank[0]
        else:  # an expert weight: this ep rank's slice of dimension 0
            assert ep > 1 and by_ep_rank[0].shape[0] * ep == want.shape[0], (name, by_ep_rank[0].shape, want.shape)
            full[name] = torch.cat([by_ep_rank[r] for r in range(ep)])
    return full


def assemble_stages(per_rank: list[dict], ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole model from the ranks of a pipeline (pp=1: one stage): each stage's ranks (``rank //
    dp``) assembled as ``assemble_weights`` does; every parameter of ``ref`` on exactly one stage."""
    weights = {}
    for pp_rank in sorted({s["layout"]["rank"] // s["layout"]["dp"] for s in per_rank}):
        stage = [s for s in per_rank if s["layout"]["rank"] // s["layout"]["dp"] == pp_rank]
        names = set(stage[0]["weights"])
        assert not names & set(weights), f"stage {pp_rank} holds another stage's {sorted(names & set(weights))[:3]}"
        weights.update(assemble_weights(stage, {n: w for n, w in ref.items() if n in names}))
    assert set(weights) == set(ref), f"not on any stage: {sorted(set(ref) - set(weights))[:3]}"
    return weights


def check_like_one_process(got: list[dict], rows, single: dict, ref_rows, what: str, rtol: float, atol: float) -> None:
    """A distributed run (``got``: each rank's summary with its weights, ``rows``: its metrics.jsonl)
    trained like one process (``single``, ``ref_rows``) on the same global batch: every rank logs the
    same losses; losses, gradient norms, aux losses and the validation loss within ``rtol``
    relative; the expert load (token counts) identical; the whole model (``assemble_stages``) within
    ``atol``; and the reference trained (equal weights would also hold for two frozen models)."""
    assert all(s["train_losses"] == got[0]["train_losses"] for s in got), f"{what}: every rank logs the same loss"
    np.testing.assert_allclose(got[0]["train_losses"], single["train_losses"], rtol=rtol, err_msg=f"{what}: losses")
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows], what
    for key in ("grad_norm", "aux_loss"):
        np.testing.assert_allclose(
            [r[key] for r in rows], [r[key] for r in ref_rows], rtol=rtol, err_msg=f"{what}: {key}"
        )
    # per-layer expert load of every layer, whichever stage holds it: identical counts
    assert [r["expert_load"] for r in rows] == [r["expert_load"] for r in ref_rows], f"{what}: expert load"
    assert got[0]["final_val_loss"] == pytest.approx(single["final_val_loss"], rel=rtol), what
    weights = assemble_stages(got, single["weights"])
    for name, w in single["weights"].items():
        torch.testing.assert_close(weights[name], w, rtol=0, atol=atol, msg=lambda m: f"{what}: {name}: {m}")
    assert single["train_losses"][-1] < single["train_losses"][0], f"{what}: {single['train_losses']}"
