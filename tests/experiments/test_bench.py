"""The CPU layer benchmark's measuring code runs (on a tiny layer): benchmarks are scripts, not
tests, but a broken one should not wait for the next person who wants a figure."""

from __future__ import annotations

import pytest
import torch

from experiments.bench.layers import make_layer
from experiments.bench.moe_layer import ideal_expert_flops, measure_side_by_side

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("per_core", [False, True])
def test_measure_side_by_side_reports_ratios(per_core):
    T, D, F, E, K = 64, 16, 32, 4, 2
    layer, x, g = make_layer(T, D, F, E, K)
    t, rate, frac, core = measure_side_by_side(
        layer, x, g, ideal_expert_flops(T, D, F, K), reps=3, n=64, rest=0.0, per_core=per_core
    )
    assert t > 0 and rate > 0 and frac > 0
    assert (core is None) != per_core and (core is None or core > 0)
    assert x.grad is not None and layer.experts.w1.grad is not None  # it ran forward and backward


def test_bench_hf_steps_every_model_on_the_same_weights():
    pytest.importorskip("transformers")
    from contextlib import nullcontext

    from experiments.bench.hf import layer_floor, make_step, measure, models_for, moe_blocks, moe_share

    for arch in ("mixtral", "deepseek_v3"):
        models = models_for(arch, layers=1, seq=12, sizes=(16, 8, 8, 2), vocab=50, heads=2)
        assert set(models) == {"stock", "patched", "ours"}  # ours: imported through the family's table
        torch.manual_seed(1)
        r = measure(models, torch.randint(0, 50, (2, 12)), reps=1, device=torch.device("cpu"))
        assert all(t > 0 for t in r["time"].values()) and set(r["ratios"]) == set(models) - {"stock"} == set(
            r["spread"]
        )
        assert all(lo <= r["ratios"][n] <= hi for n, (lo, hi) in r["spread"].items())
        # the same weights and batch: the same first loss (fp32 rounding of a different op order)
        for name, loss in r["loss"].items():
            assert abs(loss - r["loss"]["stock"]) <= 1e-5 * r["loss"]["stock"], (arch, name, r["loss"])
        # the MoE blocks' share of a step: found in both models (the patched ones are MoELayers), a fraction
        ids = torch.randint(0, 50, (2, 12))
        for name in ("stock", "patched"):
            assert len(moe_blocks(models[name])) == 1, (arch, name)
            assert 0 < moe_share(models[name], make_step(models[name], ids, nullcontext)) < 1, (arch, name)
        floor = layer_floor(arch, 2, 12, reps=1, sizes=(16, 8, 8, 2), heads=2)
        assert set(floor) == {"stock", "patched", "expert matmuls"} and all(t > 0 for t in floor.values())


def test_base_step_spec_matches_the_config_tree():
    # the GPU box runs the MFU step without hydra, from plain values that must stay model=base's
    pytest.importorskip("hydra")
    from experiments.bench.mfu import BASE
    from tests.support.training import cfg_of

    cfg = cfg_of("model=base", "data=tokens")
    for key, value in BASE.items():
        if key == "moe":
            assert {k: cfg.moe[k] for k in value} == value
        else:
            assert cfg.model[key] == value, key


def test_training_step_mfu_runs_on_a_tiny_model():
    from experiments.bench.mfu import TINY, train_step_mfu

    r = train_step_mfu(TINY, 2, 16, torch.device("cpu"), torch.float32, compile_blocks=False, reps=1, matmul_n=64)
    assert r["step_s"] > 0 and r["model_flops"] > 6 * r["params"]["active"] * 32 and 0 < r["mfu"]


def test_data_step_bench_measures_the_loader_and_the_mask():
    pytest.importorskip("hydra")
    from experiments.bench.data_step import loader_share, mask_cost

    (r,) = mask_cost([32], batch=1, reps=1)
    assert r["L"] == 32 and r["none_s"] > 0 and r["mask_s"] > 0
    share = loader_share(["model=tiny", "train.batch_size=4", "train.seq_len=16", "data.document_mask=true"], 2)
    assert share["step_s"] > 0 and 0 < share["share"] < 1
