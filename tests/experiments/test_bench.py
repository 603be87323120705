"""The CPU layer benchmark's measuring code runs (on a tiny layer): benchmarks are scripts, not
tests, but a broken one should not wait for the next person who wants a figure."""

from __future__ import annotations

import dataclasses

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


def _flops_by_hand(cfg) -> int:
    # one token's forward, multiply-adds x 2: per block the q/k/v and output projections (d x 3d,
    # d x d), the scores and weighted values over the whole L (2 x L x d each), the router (d x E) and
    # top-k SwiGLU experts (3 matrices d x F each); then the head (d x V); backward twice the forward
    m, L = cfg.model, cfg.train.seq_len
    D, F, E, K, V = m.d_model, cfg.moe.d_ff, cfg.moe.num_experts, cfg.moe.top_k, m.vocab_size
    block = 2 * D * 3 * D + 2 * D * D + 2 * (2 * L * D) + 2 * D * E + K * 3 * 2 * D * F
    return 3 * (m.n_layers * block + 2 * D * V)


def test_bpe_compute_counts_flops_and_matches_steps_as_by_hand():
    pytest.importorskip("hydra")
    from experiments.bench.bpe_compute import flops_per_token, matched_steps, runs
    from tests.support.training import cfg_of

    plan = runs("stdlib", None, [])
    byte, bpe = cfg_of(*plan["bytes"]), cfg_of(*plan["bpe"])
    bpe.model.vocab_size = 4096  # what the trainer fits to bpe:4096 (4096 ids, a multiple of 64)
    assert byte.model.vocab_size == 256 and byte.train.steps == 400 and byte.model.d_model == 64  # the default
    for cfg in (byte, bpe):
        assert flops_per_token(cfg) == _flops_by_hand(cfg)
    assert _flops_by_hand(byte) == 3_256_320 and _flops_by_hand(bpe) == 4_730_880  # the head: 1.45x
    ref = 3_256_320 * 400 * 16 * 128
    steps = matched_steps(ref, 16 * 128, 4_730_880)
    assert steps == 275  # 275.33
    assert abs(steps * 16 * 128 * 4_730_880 / ref - 1) < 0.002


def test_bpe_compute_quick_trains_both_at_matched_flops(tmp_path):
    pytest.importorskip("hydra")
    pytest.importorskip("tokenizers")
    import json
    import math

    from experiments.bench.bpe_compute import main

    r = main(["--quick", "--out", str(tmp_path)])
    byte, bpe = r["runs"]["bytes"], r["runs"]["bpe"]
    # the BPE model's vocabulary is the fitted tokenizer's, its larger head buys fewer steps
    assert byte["vocab_size"] == 256 and 256 < bpe["vocab_size"] <= 1024 and bpe["vocab_size"] % 64 == 0
    assert bpe["steps"] < byte["steps"] and bpe["tokens"] == bpe["steps"] * 4 * 32
    assert abs(r["flops_ratio"] - 1) <= 0.5 * bpe["flops_per_token"] / (byte["flops"] / (4 * 32))  # half a step
    for name, run in r["runs"].items():
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["steps"] == summary["last_step"] == run["steps"], name
        assert math.isfinite(run["val_loss"]) and math.isfinite(run["val_bpb"]), name
    assert json.loads((tmp_path / "bpe_compute.json").read_text())["runs"]["bpe"]["steps"] == bpe["steps"]


def _small_moe_costs():
    from moe import MoEConfig
    from moe.costs import model_costs
    from moe.model import TransformerConfig

    # wide enough that an H800's products are bound by their FLOPs, not their operands' bytes
    m = MoEConfig(d_model=2048, d_ff=4096, num_experts=8, top_k=2)
    cfg = TransformerConfig(vocab_size=1024, d_model=2048, n_layers=4, n_heads=16, d_ff=4096, max_seq_len=2048, moe=m)
    return model_costs(cfg, 2048, act_dtype="bf16")


def test_fp8_products_doubles_the_products_and_leaves_attention_at_bf16():
    import zero.plan as zplan
    from experiments.bench.plan import fp8_products

    h800 = zplan.load_profile("h800_node")
    fp8 = fp8_products(h800)
    for shape in ((8192, 7168, 2048), (512, 256, 256)):
        assert fp8.matmul_rate("bf16", *shape) == pytest.approx(2 * h800.matmul_rate("bf16", *shape))
    assert fp8.matmul_rate("fp32", 8192, 8192, 8192) == h800.matmul_rate("fp32", 8192, 8192, 8192)
    # h800_node measures no attention: its products took the matmul rate, and keep bf16's
    assert h800.attention_rate("bf16", 4096, 192) is None
    assert fp8.attention_rate("bf16", 4096, 192) == pytest.approx((h800.matmul_rate("bf16", 1, 1, 1), 2.5))
    no_bf16 = zplan.Profile.from_dict({**h800.to_dict(), "matmul_flops": {"fp32": [[8192, 6.7e13]]}})
    with pytest.raises(ValueError, match="no bf16 product rates"):
        fp8_products(no_bf16)


def test_missing_features_adds_each_of_the_published_runs_features_once():
    """The published layout as the trainer runs it has DualPipe's overlap (pp_overlap): a what-if
    no more; the rows add no recomputation, then FP8 products, each the planner's own prediction."""
    import dataclasses

    import zero.plan as zplan
    from experiments.bench.plan import CASES, fp8_products, missing_features

    deepseek = CASES["DeepSeek-V3 on 2048 H800"]
    assert deepseek["published"]["pp_overlap"] is True and "overlap" not in deepseek["lacks"]
    costs = _small_moe_costs()
    h800 = zplan.load_profile("h800_node")
    rec = zplan.LayoutRecord(
        world=4,
        batch_size=16,
        pp=2,
        ep=2,
        pp_schedule="dualpipev",
        pp_virtual_stages=2,
        pp_microbatches=4,
        pp_overlap=True,
        mixed_precision="bf16",
        checkpoint_activations=True,
    )
    assert zplan.layout_problem(rec, costs.num_layers, costs.num_experts, costs.tied, h800.node_size) is None
    rows = missing_features(rec, costs, h800, skew=1.5)
    assert [r["what"] for r in rows] == ["as this trainer runs it", "without recomputation", "and FP8 products"]
    as_run = zplan.predict(rec, costs, h800, skew=1.5)
    whole_rec = dataclasses.replace(rec, checkpoint_activations=False)
    whole = zplan.predict(whole_rec, costs, h800, skew=1.5)
    fp8 = zplan.predict(whole_rec, costs, fp8_products(h800), skew=1.5)
    assert [r["step_s"] for r in rows] == [as_run.step_s, whole.step_s, fp8.step_s]
    assert rows[1]["memory_gb"] > rows[0]["memory_gb"] and rows[2]["step_s"] < rows[1]["step_s"]
    # the overlap is in the first row already: faster than the pairs one pass after the other
    assert whole.time_parts["moe_comm"] > 0
    assert rows[0]["step_s"] < zplan.predict(dataclasses.replace(rec, pp_overlap=False), costs, h800, skew=1.5).step_s
    tokens = 16 * costs.seq_len
    assert all(r["tokens_per_s"] == pytest.approx(tokens / r["step_s"]) for r in rows)


def test_the_published_layout_is_also_ranked_among_its_own_toolkits_schedules():
    """(b)'s second rank keeps the layouts whose schedule the published run's toolkit had (none
    pipelined, 1F1B, interleaved 1F1B for Megatron-Core) and none with overlapped pairs, in the
    planner's order."""
    import zero.plan as zplan
    from experiments.bench.plan import CASES, _position, with_schedules

    mixtral = CASES["Mixtral-8x7B on 64 H100"]
    assert mixtral["published"]["pp_schedule"] in mixtral["run_schedules"]
    costs = _small_moe_costs()
    h100 = zplan.load_profile("h100_node")
    recs = [r for r in zplan.enumerate(costs, world=4, batch_size=16, mixed_precision="bf16") if r.pp_microbatches <= 4]
    ranked = zplan.rank(costs, h100, recs, skew=1.5)
    kept = with_schedules(ranked, mixtral["run_schedules"])
    schedules = {r.pp_schedule for r, _ in ranked}
    assert {None, "1f1b", "interleaved_1f1b", "zbv", "dualpipev"} <= schedules  # the search has others
    assert {r.pp_schedule for r, _ in kept} == {None, "1f1b", "interleaved_1f1b"}
    assert kept == [(r, q) for r, q in ranked if r.pp_schedule in (None, "1f1b", "interleaved_1f1b")]
    # DualPipeV's layouts without their overlapped pairs, which that toolkit would not have run
    dualpipe = with_schedules(ranked, ("dualpipev",))
    assert dualpipe and any(r.pp_overlap for r, _ in ranked) and not any(r.pp_overlap for r, _ in dualpipe)
    # a 1F1B layout ranks at least as high among its own kind as among all
    rec, p = next((r, q) for r, q in ranked if r.pp_schedule == "1f1b")
    assert _position(rec, p, kept) <= _position(rec, p, ranked)


def test_the_machines_variation_is_read_in_windows_and_in_runs_of_steps():
    """(v): a trace of (start, seconds) steps read as each window's median step (a window no step
    starts in left out) and as the median step of each run of n consecutive steps (a shorter last
    run left out); the spread of those as a run's distance from their median."""
    from experiments.bench.plan import _spread, block_medians, window_medians

    trace = [(0.0, 0.1), (0.3, 0.3), (0.6, 0.2), (1.2, 0.5), (1.7, 0.4), (3.1, 0.9)]  # none starts in [2, 3)
    assert window_medians(trace, 1.0) == pytest.approx([0.2, 0.45, 0.9])
    assert window_medians(trace, 5.0) == pytest.approx([0.35])
    assert block_medians(trace, 2) == pytest.approx([0.2, 0.35, 0.65])
    assert block_medians(trace, 4) == pytest.approx([0.25])  # steps 5 and 6 make no run of 4
    assert block_medians(trace, 7) == []
    s = _spread([1.0, 2.0, 4.0])
    assert (s["n"], s["min"], s["median"], s["max"]) == (3, 1.0, 2.0, 4.0)
    assert s["mean_abs_dev_from_median"] == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert s["std_over_mean"] == pytest.approx(torch.tensor([1.0, 2.0, 4.0]).std(unbiased=False).item() / (7 / 3))


@pytest.mark.distributed  # a process a core
def test_the_machines_variation_traces_every_core():
    from experiments.bench.plan import part_v

    out = part_v(seconds=0.5, busy=False, run_steps=(2,), batch=2, seq=16)
    (w,) = out["workers"]  # alone: one process
    starts = [start for start, _ in w["trace"]]
    assert len(starts) >= 2 and starts == sorted(starts) and starts[0] >= 0 and all(s < 0.5 for s in starts)
    assert all(seconds > 0 for _, seconds in w["trace"]) and w["steps"]["n"] == len(starts)
    assert w["runs"][2]["n"] == len(starts) // 2


def test_the_memory_benchmarks_draw_is_of_the_planners_layouts():
    """(m) --sample: distinct layouts of 2 and 4 ranks, each one the planner lists (and so one the
    trainer accepts: tests/zero/test_plan.py), the same draw for the same seed and another for
    another seed; a count outside what there is to draw is named."""
    import zero.plan as zplan
    from experiments.bench.plan import BASE, sampled_layouts
    from experiments.plan import _model_config, compose
    from moe.costs import model_costs

    costs = model_costs(_model_config(compose(BASE)), 128)
    listed = {w: set(zplan.enumerate(costs, world=w, batch_size=16)) for w in (2, 4)}
    drawn = [zplan.LayoutRecord(world=w, batch_size=16, **f) for w, f in sampled_layouts(40, seed=3)]
    assert len(set(drawn)) == 40 and all(rec in listed[rec.world] for rec in drawn)
    assert {rec.world for rec in drawn} == {2, 4}
    # every dimension the planner varies varies in a draw (a field the draw dropped would stay at
    # its default, and the layout still be one the planner lists)
    many = [zplan.LayoutRecord(world=w, batch_size=16, **f) for w, f in sampled_layouts(300, seed=3)]
    for field in dataclasses.fields(zplan.LayoutRecord):
        if len({getattr(rec, field.name) for w in (2, 4) for rec in listed[w]}) > 1:
            assert len({getattr(rec, field.name) for rec in many}) > 1, field.name
    assert sampled_layouts(40, seed=3) == sampled_layouts(40, seed=3) != sampled_layouts(40, seed=4)
    total = len(listed[2]) + len(listed[4])
    for bad in (0, total + 1):
        with pytest.raises(ValueError, match=rf"--sample {bad} is invalid: expected an integer in \[1, {total}\]"):
            sampled_layouts(bad)


@pytest.mark.distributed  # two gloo ranks, four short runs
def test_a_split_backward_recomputes_each_checkpointed_block_once():
    """(k): through the trainer on 2 ranks under zbv with checkpointing, each block runs its
    forward once a micro-batch and is recomputed once (moe.recompute.checkpoint_once); torch's
    checkpoint in its place recomputes once per graph task of the split backward, more than once."""
    from experiments.bench.plan import RECOMPUTED, part_k

    (row,) = part_k(steps=3, repeats=1, layouts=RECOMPUTED[:1])["rows"]
    assert row["once"][0]["recomputations"] == 1.0
    assert row["torch"][0]["recomputations"] > 1.5
