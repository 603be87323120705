"""Sharded checkpoints (``zero.checkpoint``): resume at the same layout bit for bit, at any other
layout like the uninterrupted single-process run, integrity, safe loading.

The reshard matrix saves after 3 of 6 steps under each of single, dp2 ZeRO-1 + offload (2 ranks),
ep2 ZeRO-3 and ep4 ZeRO-2 (4 ranks), and resumes each checkpoint under every layout, in one spawn of
4 ranks (the 2-rank layout on ranks 0-1 over a subgroup) and one process.
"""
from __future__ import annotations

import json
import os
import pickle
import warnings

import pytest
import torch

from tests import ckpt_cases as cc
from tests.dist_utils import run_distributed
from zero import checkpoint as zc

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# Tolerance of a resumed run under another layout against the uninterrupted single-process run:
# the layouts sum gradients in another order (~1e-7 relative per step; tests/test_zero.py), and
# Adam at eps 1e-4 passes that on over 6 steps. Measured: <= 2.4e-7 relative on losses, <= 1.9e-7
# absolute on weights of size ~0.1-1. A chunk loaded at a wrong offset, a lost optimizer moment or
# a stale replica moves a loss by > 1e-3.
LOSS_RTOL = 1e-6
WEIGHT_ATOL = 2e-6


def whole(state: dict) -> dict:
    """{name: tensor}: a rank's weights with its experts placed at their global rows."""
    return {n: w for n, (off, w) in state["weights"].items()}


def assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """The whole model from the ranks' final states: experts are the ep slices side by side."""
    out = {}
    for s in per_rank:
        for n, (off, w) in s["weights"].items():
            if off is None:
                out.setdefault(n, w)
                continue
            full = out.setdefault(n, torch.full((cc.E,) + tuple(w.shape[1:]), float("nan")))
            full[off : off + w.shape[0]] = w
    return out


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("matrix")
    ck = {name: str(root / name) for name in cc.LAYOUTS_ALL}
    results = {}  # (layout, loaded from or None) -> list of per-rank results
    # the single-process reference, saving its checkpoint
    results[("single", None)] = [cc.run("single", save=ck["single"])]
    # one spawn of 4 ranks (the 2-rank layouts on ranks 0-1): every layout saves, then loads every checkpoint
    multi = [n for n in cc.LAYOUTS_ALL if n != "single"]
    jobs = [(name, None, ck[name]) for name in multi]
    jobs += [(name, ck[src], None) for name in cc.LAYOUTS if name != "single" for src in cc.LAYOUTS]
    per_rank = run_distributed(cc.matrix_rank, 4, jobs, timeout=400)
    for i, (name, load, _) in enumerate(jobs):
        results[(name, None if load is None else os.path.basename(load))] = [r[i] for r in per_rank if r[i] is not None]
    for src in cc.LAYOUTS_ALL:
        results[("single", src)] = [cc.run("single", load=ck[src])]
    return results, ck


def test_same_layout_resumes_bit_for_bit(matrix):
    results, _ = matrix
    for name in cc.LAYOUTS:
        full, resumed = results[(name, None)], results[(name, name)]
        assert resumed[0]["losses"] == full[0]["losses"][cc.SAVE_AT:], name
        for a, b in zip(full, resumed):
            for n, (_, w) in a["weights"].items():
                assert torch.equal(b["weights"][n][1], w), f"{name}: {n}"
            for n, buf in a["buffers"].items():
                assert torch.equal(b["buffers"][n], buf), f"{name}: buffer {n}"
            assert b["step_count"] == a["step_count"] == cc.STEPS


def test_every_layout_resumes_every_other(matrix):
    results, _ = matrix
    ref = results[("single", None)][0]
    ref_w = whole(ref)
    # every layout trains like one process (tests/test_zero.py), uninterrupted (src None) or resumed
    pairs = [(name, src) for name in cc.LAYOUTS for src in cc.LAYOUTS]
    pairs += [(name, None) for name in cc.LAYOUTS_ALL] + [("single", "dp2_z0")]
    for name, src in pairs:
        got = results[(name, src)]
        what = f"{name} resumed from {src}" if src else f"{name} uninterrupted"
        want = ref["losses"][cc.SAVE_AT:] if src else ref["losses"]
        torch.testing.assert_close(torch.tensor(got[0]["losses"]), torch.tensor(want), rtol=LOSS_RTOL, atol=0,
                                   msg=lambda m: f"{what}: losses: {m}")
        w = assemble(got)
        assert set(w) == set(ref_w), what
        for n, want_w in ref_w.items():
            torch.testing.assert_close(w[n], want_w, rtol=0, atol=WEIGHT_ATOL, msg=lambda m: f"{what}: {n}: {m}")
        # the expert biases moved during the run (aux-loss-free balancing) and came back
        bias = {n: b for n, b in got[0]["buffers"].items() if n.endswith("expert_bias")}
        assert bias and all(torch.equal(b, ref["buffers"][n]) for n, b in bias.items()), what
        assert all(b.abs().sum() > 0 for b in bias.values()), what
    # and the run trained: a resumed run that ignored the checkpoint would start from the initial loss
    assert ref["losses"][-1] < ref["losses"][0]


def test_replicas_are_written_once(matrix):
    """Replicas (stage 0 on 2 ranks: everything) hand DCP the same chunks; each is stored once:
    every byte of the data files belongs to exactly one stored item, and each parameter's and
    moment's chunks add up to its global size."""
    _, ck = matrix
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for name, path in ck.items():
        md = zc.SafeReader(path).read_metadata()
        entries = md.state_dict_metadata
        params = {k[len(zc.PARAM):]: v.size.numel() for k, v in entries.items() if k.startswith(zc.PARAM)}
        assert params and all(isinstance(v, TensorStorageMetadata) for v in entries.values()), name
        for key in ("", "exp_avg/", "exp_avg_sq/"):
            prefix = zc.PARAM if not key else f"{zc.OPTIM}{key}"
            for p, numel in params.items():
                chunks = entries[prefix + p].chunks
                assert sum(c.sizes.numel() for c in chunks) == numel, (name, prefix + p)
        stored = sum(info.length for info in md.storage_data.values())
        written = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".distcp"))
        assert written == stored, (name, written, stored)
