"""Pipeline stages (zero.pipeline on torch.distributed.pipelining): stage modules against the whole
model, plan validation, and every schedule, ZeRO stage and layout of the trainer against the
single-process run of the same global batch.

The reference for a pipeline of m micro-batches (x grad_accum rounds) is one process with
``train.grad_accum = m x rounds``: the same rows in the same micro-batches, so the batch statistics
of the balancing loss, capacity and expert choice see what they see in the pipeline.

Tolerances: the pipeline computes each micro-batch with the same arithmetic as one process; what
differs is the order in which micro-batch gradients are summed (a flat buffer of the engine against
``.grad``) and the reductions over dp, ~1e-7 relative per step. Losses and gradient norms: 1e-5
relative over 10 steps (the issue's bound; observed ~1e-7). Weights: AdamW's g / (|g| + eps) turns a
rounding difference of a gradient entry near eps into up to lr x (that difference) / eps, whatever
the weight's size, so the bound is absolute, 1e-5 (observed 5e-6), 300x below one step's lr (3e-3):
a wrong gradient shows as ~1e-3. The expert load is a count of tokens and must be identical.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as nnf

import moe
from experiments.train import train
from experiments.training.build import build_plan
from experiments.training.checks import check_config
from moe.model import Transformer, TransformerConfig
from tests.support.dist import RankExited, run_distributed
from tests.support.torchrun import run_torchrun_nodes
from tests.support.training import SHORT, cfg_of, check_like_one_process, metrics_rows, run
from zero import Layout, predict_memory
from zero.pipeline import SCHEDULES, even_split, plan_pipeline

ROOT = Path(__file__).resolve().parents[2]
STEPS = 10
BASE = [*SHORT, f"train.steps={STEPS}", "train.log_every=1", f"train.eval_every={STEPS}"]
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-5


def _tiny_model(n_layers=3, tie=False, seed=0):
    moe_cfg = moe.MoEConfig(d_model=16, d_ff=16, num_experts=4, top_k=2, aux_loss_coef=0.01, z_loss_coef=0.001)
    cfg = TransformerConfig(
        vocab_size=32, d_model=16, n_layers=n_layers, n_heads=2, d_ff=32, max_seq_len=8, moe=moe_cfg, tie_embeddings=tie
    )
    torch.manual_seed(seed)
    return Transformer(cfg)


@pytest.mark.parametrize("sizes", [[1, 1, 1, 1, 1], [2, 3], [1, 3, 1], [4, 1]])
def test_stages_chained_compute_the_whole_model_forward_and_every_gradient(sizes):
    # the naive reference: the unsplit model; the stages pass activations the way the pipeline
    # does (a detached leaf that requires grad, its gradient handed back), aux losses included
    full, split = _tiny_model(), _tiny_model()
    x = torch.randint(0, 32, (3, 8))
    y = torch.randint(0, 32, (3, 8))
    nnf.cross_entropy(full(x).flatten(0, 1), y.flatten()).backward()

    bounds = np.cumsum([0] + sizes)
    stages = [split.pipeline_stage(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in full.named_parameters()), "every parameter once, under its own name"
    inputs, outputs, h = [], [], x
    for s in stages:
        outputs.append(s(h))
        h = outputs[-1].detach().requires_grad_()
        inputs.append(h)
    nnf.cross_entropy(outputs[-1].flatten(0, 1), y.flatten()).backward()
    for k in range(len(stages) - 2, -1, -1):
        outputs[k].backward(inputs[k].grad)
    torch.testing.assert_close(outputs[-1], full(x), rtol=0, atol=0)
    for (n, p), (_, q) in zip(full.named_parameters(), split.named_parameters()):
        assert q.grad is not None, n
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=lambda m: f"{n}: {m}")


def test_stage_modules_share_the_models_parameters_and_refuse_what_cannot_split():
    model = _tiny_model(n_layers=2)
    stage = model.pipeline_stage(1, 3)
    assert [n for n, _ in stage.named_parameters()][0] == "blocks.0.attn_norm.weight"
    assert stage.blocks[0].attn.qkv.weight is model.blocks[0].attn.qkv.weight
    assert stage.embed is None and stage.lm_head is None
    held = model.keep_layers([(0, 1), (3, 4)])  # a rank's two virtual stages: embedding and head
    assert {n for n, _ in held.named_parameters()} == {"embed.weight", "norm.weight", "lm_head.weight"}
    with pytest.raises(ValueError, match=r"not one contiguous run"):
        held(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"pipeline layers \[2, 5\) are invalid: expected 0 <= lo < hi <= 4"):
        model.pipeline_stage(2, 5)
    with pytest.raises(ValueError, match=r"splits the whole model"):
        stage.pipeline_stage(1, 2)
    with pytest.raises(ValueError, match=r"tie_embeddings=True .* hold only one of them"):
        _tiny_model(n_layers=2, tie=True).pipeline_stage(0, 2)
    tied = _tiny_model(n_layers=2, tie=True).keep_layers([(0, 1), (3, 4)])  # both ends on one rank: allowed
    assert tied.embed.weight is tied.lm_head.weight


def test_plan_cuts_layers_and_maps_stages_to_ranks():
    assert even_split(7, 3) == [3, 2, 2]
    p = plan_pipeline(6, pp=2, pp_schedule="interleaved_1f1b", pp_microbatches=4, pp_virtual_stages=2)
    assert p.ranges == ((0, 2), (2, 4), (4, 5), (5, 6))
    assert p.stages_of(0) == [0, 2] and p.stages_of(1) == [1, 3]
    v = plan_pipeline(8, pp=2, pp_schedule="zbv", pp_microbatches=4, pp_virtual_stages=2, pp_layers=[1, 3, 3, 1])
    assert v.stages_of(0) == [0, 3] and v.stages_of(1) == [1, 2] and v.rank_of(3) == 0
    assert v.ranges == ((0, 1), (1, 4), (4, 7), (7, 8))


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_split_backward_names_the_schedules_whose_backward_runs_in_two_passes(schedule):
    # what the trainer turns compile's donated buffers off for (a second backward pass over a graph)
    from zero.plan.schedule import rank_orders

    virtual = 1 if SCHEDULES[schedule][1] == "single" else 2
    plan = plan_pipeline(6, pp=2, pp_schedule=schedule, pp_microbatches=4, pp_virtual_stages=virtual)
    kinds = {a[0] for rank in rank_orders(plan) for group in rank for a in group}
    assert plan.splits_backward == ("I" in kinds), (schedule, kinds)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(pp_schedule="pipedream"), r"pp_schedule='pipedream' is invalid: expected one of \['1f1b', 'dualpipev'"),
        (dict(pp_virtual_stages=2), r"pp_schedule=1f1b runs one stage per rank, but pp_virtual_stages=2"),
        (dict(pp_schedule="interleaved_1f1b"), r"pp_virtual_stages=1 must be >= 2"),
        (
            dict(pp_schedule="zbv", pp_virtual_stages=3),
            r"V-shaped, exactly two stages per rank: pp_virtual_stages=3 must be 2",
        ),
        (
            dict(pp=8, pp_microbatches=8),
            r"5 pipeline layers \(the embedding, each block and the head\) cannot fill "
            r"pp=8 x pp_virtual_stages=1 = 8 stages",
        ),
        (dict(pp_microbatches=1), r"pp_microbatches=1 is below what 1f1b needs: at least pp=2"),
        (
            dict(pp_schedule="dualpipev", pp_virtual_stages=2, pp_microbatches=3),
            r"pp_microbatches=3 is below what dualpipev needs: at least 2 x pp=4",
        ),
        (
            dict(pp_schedule="interleaved_1f1b", pp_virtual_stages=2, pp_microbatches=5),
            r"pp_microbatches=5 does not suit interleaved_1f1b with pp=2",
        ),
        (
            dict(pp_layers=[2, 2]),
            r"pp_layers=\[2, 2\] is invalid: expected 2 positive integers .* summing to the 5 pipeline layers",
        ),
        (dict(pp_layers=[5, 0]), r"pp_layers=\[5, 0\] is invalid"),
        (dict(pp_microbatches=0), r"pp_microbatches=0 is invalid: expected a positive integer"),
        (
            dict(pp_schedule="zbv", pp_virtual_stages=2, pp_microbatches=4, pp_overlap=True),
            r"pp_overlap=true needs a schedule with overlapped forward-backward pairs \(dualpipev\), "
            r"but pp_schedule=zbv",
        ),
        (
            dict(pp_schedule="dualpipev", pp_virtual_stages=2, pp_microbatches=4, pp_overlap="yes"),
            r"pp_overlap='yes' is invalid: expected true or false",
        ),
    ],
)
def test_bad_pipeline_configs_are_named(kw, match):
    args = dict(pp=2, pp_microbatches=2) | kw
    with pytest.raises(ValueError, match=match):
        plan_pipeline(5, **args)


def test_trainer_names_the_parallel_keys_before_any_process_group():
    with pytest.raises(ValueError, match=r"parallel.pp_microbatches=1 is below what 1f1b needs"):
        build_plan(cfg_of(*SHORT, "parallel=pp2", "parallel.pp_microbatches=1"))
    with pytest.raises(ValueError, match=r"parallel.pp_layers=\[1, 2\] is invalid"):
        build_plan(cfg_of(*SHORT, "parallel=pp2", "parallel.pp_layers=[1,2]"))
    cfg = cfg_of(*SHORT, "parallel=pp2", "parallel.pp_microbatches=3")
    with pytest.raises(
        ValueError,
        match=r"train.batch_size=8 must be divisible by dp=1 x train.grad_accum=1 x parallel.pp_microbatches=3",
    ):
        check_config(cfg, Layout(world=2, pp=2, dp=1), build_plan(cfg))
    # one process cannot hold two stages: refused by the numbers, not by a hang
    with pytest.raises(ValueError, match=r"world size 1 is not divisible by pp=2"):
        train(cfg_of(*SHORT, "parallel=pp2"))
    assert build_plan(cfg_of(*SHORT, "parallel=pp2")).microbatches == 4  # default 2 x pp x virtual
    with pytest.raises(ValueError, match=r"parallel.pp_overlap=true .* but parallel.pp=1"):
        build_plan(cfg_of(*SHORT, "parallel.pp_overlap=true"))
    with pytest.raises(ValueError, match=r"parallel.pp_overlap=true needs .* but pp_schedule=1f1b"):
        build_plan(cfg_of(*SHORT, "parallel=pp2", "parallel.pp_overlap=true"))
    overlap = ["parallel=pp2", "parallel.pp_schedule=dualpipev", "parallel.pp_virtual_stages=2"]
    overlap.append("parallel.pp_overlap=true")
    assert build_plan(cfg_of(*SHORT, *overlap)).overlap


def test_a_lane_runs_its_threads_collectives_on_the_twins_of_its_groups():
    import threading

    from routing_kernels.runtime import comm_lane, lane_group

    group, twin, other = object(), object(), object()
    seen = {}
    with comm_lane({group: twin}):
        assert lane_group(group) is twin and lane_group(other) is other and lane_group(None) is None
        worker = threading.Thread(target=lambda: seen.update(other_thread=lane_group(group)))
        worker.start()
        worker.join()
        with comm_lane({}):
            assert lane_group(group) is group  # nested: the inner map, then the outer again
        assert lane_group(group) is twin
    assert lane_group(group) is group and seen["other_thread"] is group
    assert Layout().twin_groups() == {}  # one process: no groups to twin


def test_memory_prediction_per_stage():
    per_stage = predict_memory(
        [{"dense": 4e9, "expert": 0}, {"dense": 2e9, "expert": 8e9}], dp=4, ep=2, stage=3, mixed_precision="bf16"
    )
    one = predict_memory({"dense": 2e9, "expert": 8e9}, dp=4, ep=2, stage=3, mixed_precision="bf16")
    assert per_stage[1] == one and per_stage[0]["expert"]["params"] == 0
    assert per_stage[0]["dense"]["params"] == 4e9 * 2 / 4


# ----- the trainer on 2 and 4 gloo ranks against one process --------------------------------------
# (overrides, micro-batches x accumulation rounds of the single-process reference)
RUNS_2 = [
    (["parallel.pp_schedule=gpipe", "parallel.pp_microbatches=1"], 1),  # m = 1
    (["parallel.pp_microbatches=2", "parallel.zero_stage=1", "train.grad_clip=0.05"], 2),  # m = p, clipping on
    (["parallel.pp_microbatches=4", "parallel.zero_stage=2", "train.grad_accum=2"], 8),  # m = 2p, accumulation on top
    (
        [
            "parallel.pp_schedule=interleaved_1f1b",
            "parallel.pp_virtual_stages=2",
            "parallel.pp_microbatches=2",
            "parallel.zero_stage=3",
        ],
        2,
    ),
    (["parallel.pp_schedule=interleaved_zb", "parallel.pp_virtual_stages=2", "parallel.pp_microbatches=4"], 4),
    # split backward with activation checkpointing: the input pass recomputes, the weight pass reuses
    (
        [
            "parallel.pp_schedule=zbv",
            "parallel.pp_virtual_stages=2",
            "parallel.pp_microbatches=4",
            "parallel.zero_stage=3",
            "model.checkpoint_activations=true",
        ],
        4,
    ),
    (
        [
            "parallel.pp_schedule=dualpipev",
            "parallel.pp_virtual_stages=2",
            "parallel.pp_microbatches=4",
            "parallel.zero_stage=2",
            "parallel.zero_offload=true",
        ],
        4,
    ),
    (
        [
            "parallel.pp_schedule=gpipe",
            "parallel.pp_layers=[1,3]",
            "parallel.pp_microbatches=4",
            "parallel.zero_stage=1",
        ],
        4,
    ),  # uneven
]
# With dp=2 every rank's j-th micro-batch is its half of one process's j-th micro-batch
# (LMData.get_batch's row order), so the balancing loss, a batch statistic reduced over dp, and the
# logged aux loss match one process too.
RUNS_4 = [
    # pp=2 x ep=2, the ep pair on two one-rank "nodes", each token sent to the other once
    (
        [
            "parallel=pp2",
            "parallel.ep=2",
            "parallel.pp_microbatches=2",
            "parallel.node_size=1",
            "parallel.ep_dispatch=node",
        ],
        2,
    ),
    (["parallel=pp2_ep2_zero3"], 4),  # pp=2 x dp=2 x ZeRO-3, ep=2
    # DualPipeV's overlapped pairs run their forward and backward at once (the backward's All-to-Alls
    # on the twin groups), pp=2 x ep=2 with ZeRO-1 and full recomputation: DeepSeek-V3's layout in
    # small (the backward lane re-runs forwards, their exchanges and statistics on the twins too)
    (
        [
            "parallel.pp_schedule=dualpipev",
            "parallel.pp_virtual_stages=2",
            "parallel.pp_microbatches=4",
            "parallel.pp_overlap=true",
            "parallel.ep=2",
            "parallel.zero_stage=1",
            "model.checkpoint_activations=true",
        ],
        4,
    ),
    (
        [
            "parallel=pp2",
            "parallel.pp_schedule=interleaved_1f1b",
            "parallel.pp_virtual_stages=2",
            "parallel.pp_microbatches=2",
            "parallel.zero_stage=1",
        ],
        2,
    ),  # interleaved with dp=2
]


def _trainer_runs(rank, world, runs, run_dirs):
    """Each run's summary and, per optimizer step, the stage-3 gathers it took, how many blocks
    have sharded weights, and the gathered bytes left after the step."""
    from zero import ZeroEngine, measure_memory

    torch.set_num_threads(1)
    step, seen = ZeroEngine.step, []

    def counting_step(self, *args, **kwargs):
        norm = step(self, *args, **kwargs)
        seen.append(
            (
                self.gather_stats["gathers"],
                sum(u.has_sharded_params() for u in self.units),
                measure_memory(self)["gathered"],
            )
        )
        return norm

    ZeroEngine.step = counting_step
    pairs = _watch_overlapped_pairs()
    out = []
    for overrides, run_dir in zip(runs, run_dirs):
        seen.clear()
        pairs.clear()
        summary = train(cfg_of(*BASE, "parallel=pp2", *overrides), run_dir=run_dir, keep_weights=True)
        summary["gathers"] = list(seen)
        summary["pairs"] = list(pairs)
        out.append(summary)
    return out


def _watch_overlapped_pairs() -> list:
    """Each overlapped pair's (forward's thread, backward's thread, whether the forward saw the
    backward under way before it began, whether the backward ran on the ep group's twin): each
    pair's forward waits (up to a minute) until its backward has started, so a pair whose passes
    run one after the other shows."""
    import threading

    from routing_kernels import runtime
    from zero.pipeline import Pipeline

    pairs = []
    pair, forward, backward = Pipeline._overlap_f_b, Pipeline._pair_forward, Pipeline._pair_backward

    def watched_pair(self, action, ctx):
        self._backward_began = threading.Event()
        return pair(self, action, ctx)

    def watched_forward(self, ctx, a):
        both = self._backward_began.wait(60)
        pairs.append(dict(forward_thread=threading.current_thread().name, both_under_way=both))
        return forward(self, ctx, a)

    def watched_backward(self, a):
        twins = getattr(runtime._lane, "twins", None)
        self._backward_began.set()
        pairs.append(
            dict(
                backward_thread=threading.current_thread().name,
                ep_twin=bool(twins) and twins.get(self.layout.ep_group) not in (None, self.layout.ep_group),
            )
        )
        return backward(self, a)

    Pipeline._overlap_f_b, Pipeline._pair_forward, Pipeline._pair_backward = (
        watched_pair,
        watched_forward,
        watched_backward,
    )
    return pairs


def _check_against_one_process(per_rank, runs, tmp_path, stdlib, world):
    for i, (overrides, micro) in enumerate(runs):
        got = [r[i] for r in per_rank]
        what = " ".join(overrides)
        assert [s["layout"]["pp"] for s in got] == [2] * world, what
        single_overrides = [o for o in overrides if not o.startswith(("parallel", "train.grad_accum"))]
        single = run(
            cfg_of(*BASE, *single_overrides, f"train.grad_accum={micro}"),
            tmp_path,
            stdlib,
            f"single{i}",
            keep_weights=True,
        )
        rows, ref_rows = metrics_rows(tmp_path / f"pp{i}"), metrics_rows(tmp_path / f"single{i}")
        check_like_one_process(got, rows, single, ref_rows, what, LOSS_RTOL, WEIGHT_ATOL)
        assert len(rows) == STEPS
        for s in got:
            if "parallel.pp_overlap=true" in overrides:
                fwd = [p for p in s["pairs"] if "forward_thread" in p]
                bwd = [p for p in s["pairs"] if "backward_thread" in p]
                # DualPipeV at pp=2, m=4: pairs on every rank in every step, each forward in the
                # worker thread while the backward ran here, on the ep group's twin
                assert fwd and len(fwd) == len(bwd), f"{what}: pairs {s['pairs'][:4]}"
                assert all(p["both_under_way"] and p["forward_thread"].startswith("pipeline-forward-lane") for p in fwd)
                assert all(p["backward_thread"] == "MainThread" and p["ep_twin"] for p in bwd), what
            else:
                assert not s["pairs"], what
            counts = s["gathers"]
            if counts[0][1]:  # ZeRO-3 with sharded blocks: each gathered once per step, whatever m
                # (the first step also gathers for torch's shape inference; the blocks stay gathered)
                per_step = [b[0] - a[0] for a, b in zip(counts, counts[1:])]
                assert per_step == [counts[0][1]] * (STEPS - 1), f"{what}: gathers per step {per_step}"
                assert all(c[2] == 0 for c in counts), f"{what}: gathered weights left after a step"


@pytest.mark.distributed
def test_two_stages_train_like_one_process_under_every_schedule(tmp_path, stdlib):
    per_rank = run_distributed(
        _trainer_runs, 2, [o for o, _ in RUNS_2], [tmp_path / f"pp{i}" for i in range(len(RUNS_2))], timeout=600
    )
    _check_against_one_process(per_rank, RUNS_2, tmp_path, stdlib, 2)


@pytest.mark.distributed
def test_pipeline_with_expert_parallelism_and_zero3_on_four_ranks(tmp_path, stdlib):
    per_rank = run_distributed(
        _trainer_runs, 4, [o for o, _ in RUNS_4], [tmp_path / f"pp{i}" for i in range(len(RUNS_4))], timeout=600
    )
    _check_against_one_process(per_rank, RUNS_4, tmp_path, stdlib, 4)


# ----- the balancing loss alone reaches the routers through the stages ------------------------------
def _aux_only(rank, world, cases):
    return [_aux_only_case(*case) for case in cases]


def _aux_only_case(schedule, virtual, m):
    """Router gradients with the cross-entropy zeroed: only the aux losses (scaled 1/m) remain."""
    from experiments.training.build import split_model
    from zero import ZeroEngine, default_blocks
    from zero.pipeline import Pipeline

    layout = Layout.build(pp=2)
    model = _tiny_model(n_layers=3)
    plan = plan_pipeline(
        model.num_pipeline_layers, pp=2, pp_schedule=schedule, pp_microbatches=m, pp_virtual_stages=virtual
    )
    held, chunks = split_model(model, plan, layout)
    engine = ZeroEngine(
        held, layout, blocks=default_blocks(held), entries=chunks, optimizer=lambda g: torch.optim.SGD(g, lr=0.0)
    )
    moe.scale_aux_losses(held, 1.0 / m)
    pipe = Pipeline(chunks, plan, layout, engine, loss_fn=lambda out, y: out.sum() * 0.0)
    x, y = _aux_batch()
    pipe.step(x, y)
    grads = engine.full_gradients()
    return {n: g for n, g in grads.items() if "router" in n}


def _aux_batch():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g)


@pytest.mark.distributed
def test_balancing_loss_alone_gives_one_process_router_gradients():
    # 1F1B, and ZBV, whose split backward computes input and weight gradients apart
    m, cases = 2, [("1f1b", 1, 2), ("zbv", 2, 2)]
    per_rank = run_distributed(_aux_only, 2, cases)
    model = _tiny_model(n_layers=3)
    moe.scale_aux_losses(model, 1.0 / m)
    x, y = _aux_batch()
    for a in range(m):
        (model(x[a * 2 : (a + 1) * 2]).sum() * 0.0).backward()
    want = {n: p.grad for n, p in model.named_parameters() if "router" in n}
    assert len(want) == 3
    for i, case in enumerate(cases):
        got = {**per_rank[0][i], **per_rank[1][i]}
        assert set(got) == set(want), case
        for n, g in want.items():
            assert g.abs().max() > 0, n  # the balancing loss really pulls on every router
            # the same per-micro-batch arithmetic, summed in another order: rounding only
            torch.testing.assert_close(got[n], g, rtol=1e-6, atol=1e-9, msg=lambda msg: f"{case} {n}: {msg}")


# ----- failures and launches ---------------------------------------------------------------------
def _stage_dies(rank, world, tmp):
    from zero.pipeline import Pipeline

    torch.set_num_threads(1)
    step = Pipeline.step
    calls = []

    def dying_step(self, *a, **kw):
        calls.append(1)
        if rank == 1 and len(calls) == 3:
            os._exit(3)  # the second stage crashes mid-run (an OOM kill, a node loss)
        return step(self, *a, **kw)

    Pipeline.step = dying_step
    start = time.monotonic()
    try:
        train(cfg_of(*BASE, "parallel=pp2", "parallel.timeout_s=5"), run_dir=tmp)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "after_s": time.monotonic() - start}
    return {"error": None}


@pytest.mark.distributed
def test_a_stage_that_dies_ends_the_other_with_an_error(tmp_path):
    out = run_distributed(_stage_dies, 2, str(tmp_path / "run"), init=False, allow_exit=True, timeout=200)
    assert isinstance(out[1], RankExited) and out[1].exitcode == 3
    assert out[0]["error"] is not None, "the first stage must not finish a step whose second stage is gone"
    # well within the test's timeout: the collective timeout (5 s) or the broken connection ended it
    assert out[0]["after_s"] < 120, out[0]


@pytest.mark.distributed
def test_two_torchrun_nodes_one_stage_each(tmp_path, stdlib):
    # two torchrun agents as two "nodes", one process each, one pipeline stage each
    run_dir = tmp_path / "two_nodes"
    args = ["parallel=pp2", *BASE, "train.steps=4", "train.eval_every=4", f"hydra.run.dir={run_dir}"]
    outs = run_torchrun_nodes(args, nnodes=2, nproc_per_node=1, rdzv_id="pp_two_nodes")
    for code, _, err in outs:
        assert code == 0, err[-3000:]
    assert sum(out.count("final val loss") for _, out, _ in outs) == 1  # global rank 0 alone reports
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["layout"]["pp"] == 2 and summary["layout"]["world"] == 2
    # the bytes each stage's engine sends: with dp=1 it gathers and reduces nothing, so only the
    # gradient norm's all-reduce over the two stages (the loss flags and the preemption flag ride in
    # it: the norm, then an aux and a z loss per MoE layer and the loss, then the preemption flag,
    # fp32), between nodes of one rank each (zero.comm: an all-reduce of N bytes over 2 ranks on 2
    # nodes sends N). The pipeline's activations and gradients (point-to-point) are the model's
    # traffic, not the engine's: not counted
    norm_bytes = 4 * (1 + 2 * summary["moe_layers"] + 1 + 1)
    assert summary["moe_layers"] > 0
    for r in metrics_rows(run_dir):
        assert (r["comm_bytes_intra"], r["comm_bytes_inter"]) == (0, norm_bytes), r
    single = run(cfg_of(*BASE, "train.steps=4", "train.eval_every=4", "train.grad_accum=4"), tmp_path, stdlib, "one")
    np.testing.assert_allclose(summary["train_losses"], single["train_losses"], rtol=LOSS_RTOL)
    assert summary["final_val_loss"] == pytest.approx(single["final_val_loss"], rel=LOSS_RTOL)


def test_schedules_table_is_what_the_trainer_offers():
    from experiments.training.schema import ParallelConfig

    doc = Path(ROOT / "experiments" / "training" / "schema.py").read_text()
    for name in SCHEDULES:
        assert name in doc, name
    assert ParallelConfig().pp_schedule in SCHEDULES
