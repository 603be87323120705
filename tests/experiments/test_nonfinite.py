"""Non-finite steps: a NaN on one rank skips that optimizer step on every rank, under ZeRO stages
0-3, in the engine and in the trainer; repeated ones stop the run naming the step and the quantity;
metrics.jsonl stays valid JSON.

"Skipped" is checked against runs built without the skip mechanism: the same training with step k
left out altogether (the engine: a loop that never runs step k; the trainer: a run whose k-th
engine.step() is replaced by engine.zero_grad()).
"""

from __future__ import annotations

import itertools
import json
import math
from contextlib import contextmanager, nullcontext

import numpy as np
import pytest
import torch

import experiments.training.loop as train_mod
from experiments.train import train
from experiments.training.nonfinite import NonFiniteError
from moe import scale_aux_losses
from tests.support.dist import run_distributed
from tests.support.training import LOSS_RTOL, SHORT, WEIGHT_ATOL, assemble_weights, cfg_of, metrics_rows
from tests.support.zero_nets import (
    B_PER_RANK,
    CLIP,
    LR,
    PARAM_ATOL,
    WD,
    E,
    _compare,
    batches,
    run_reference,
    sharded_net,
)
from zero import Layout, ZeroEngine

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

NAN = float("nan")

# ----- the engine ---------------------------------------------------------------------------------
K, NF_STEPS, ACCUM = 1, 4, 2  # step K (from 0) is non-finite on rank 1; 2 micro-batches, clipping on
STAGE_EP = [(0, 1), (1, 2), (2, 1), (3, 2)]  # each stage once, with and without expert parallelism


def _engine_run(layout: Layout, stage: int, inject: str | None = None, leave_out: tuple = ()):
    """test_zero's loop (2 micro-batches, the first under no_sync, clipping), NF_STEPS steps. On rank
    1 at step K, ``inject="loss"`` makes the loss NaN (its gradients stay finite: only the
    extra_finite flag tells), ``inject="grad"`` makes the first micro-batch's gradients NaN (the loss
    stays finite). ``leave_out``: steps never run. Returns what each step did, the final weights and
    the first step's gradients."""
    net = sharded_net(layout)
    scale_aux_losses(net, 1.0 / ACCUM)
    engine = ZeroEngine(
        net,
        layout,
        stage=stage,
        lr=LR,
        weight_decay=WD,
        max_grad_norm=CLIP,
        param_groups=lambda name, p: {} if p.dim() >= 2 else {"weight_decay": 0.0},
    )
    x, y = batches(ACCUM, layout.dp)
    rows = slice(layout.dp_rank * B_PER_RANK, (layout.dp_rank + 1) * B_PER_RANK)
    losses, record = [], []
    for s in range(NF_STEPS):
        if s in leave_out:
            continue
        here = inject if (s == K and layout.rank == 1) else None
        loss_seen = torch.zeros(())
        for m in range(ACCUM):
            with engine.no_sync() if m < ACCUM - 1 else nullcontext():
                out = engine(x[s, m, rows])
                if here == "grad" and m == 0:
                    out.register_hook(lambda g: torch.full_like(g, NAN))
                loss = ((out - y[s, m, rows]) ** 2).mean() / ACCUM
                engine.backward(loss)
            loss_seen += loss.detach() + (NAN if here == "loss" else 0.0)
        if s == 0:
            first_grads = engine.full_gradients()
        # beside the flags, per-rank values summed over the ranks in the same all-reduce (the
        # trainer's preemption flag): rank r adds r + 1 and, at step s, s
        sums = torch.tensor([layout.rank + 1.0, float(s)])
        engine.step(extra_finite=torch.isfinite(loss_seen).reshape(1), extra_sums=sums)
        gathered = any(f.is_gathered() for f in engine.flats if f.sharded_params)
        record.append(
            (
                s,
                engine.last_step_skipped,
                list(engine.last_nonfinite),
                math.isfinite(engine.last_grad_norm),
                gathered,
                list(engine.last_extra_sums),
            )
        )
        if not engine.last_step_skipped:
            torch.distributed.all_reduce(loss_seen, group=layout.dp_group)
            losses.append(loss_seen.item() / layout.dp)
    steps_taken = {int(st["step"]) for st in engine.optimizer.state.values()}
    return dict(
        record=record,
        skipped=engine.skipped_steps,
        step_count=engine.step_count,
        opt_steps=steps_taken,
        losses=losses,
        params=engine.full_parameters(),
        first_grads=first_grads,
        engine=engine,
    )


def _engine_rank(rank, world):
    ref = run_reference(ACCUM, CLIP, world, steps=NF_STEPS, skip=(K,))  # one process, torch AdamW, no step K
    out = {}
    for stage, ep in STAGE_EP:
        layout = Layout.build(ep=ep, num_experts=E)
        without = _engine_run(layout, stage, leave_out=(K,))
        for inject in ("loss", "grad"):
            got = _engine_run(layout, stage, inject)
            out[(stage, inject)] = dict(
                record=got["record"],
                skipped=got["skipped"],
                step_count=got["step_count"],
                opt_steps=got["opt_steps"],
                # the same ranks and arithmetic without step K: bit for bit
                same_as_without=all(torch.equal(got["params"][n], w) for n, w in without["params"].items()),
                same_losses=got["losses"] == without["losses"],
                # against one process (rounding of the reduction order only): (loss, weight, grad) errors
                vs_reference=_compare(ref, (got["losses"], got["params"], got["first_grads"]), layout),
            )
    # weights_finite() is a collective over every rank's shards: a NaN in rank 1's shard is seen by all
    engine = got["engine"]
    before = engine.weights_finite()
    if rank == 1:
        engine.flats[0].shards[0][3][0] = NAN
    out["weights_finite"] = (before, engine.weights_finite())
    return out


def _rank(rank, world, runs):
    return _engine_rank(rank, world), _train_rank(rank, world, runs)


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory, stdlib):
    """Every 2-rank run of this module in one spawn (a spawn costs seconds of imports): the engine
    runs, then the trainer runs of TRAIN_RUNS (directories under the returned path)."""
    root = tmp_path_factory.mktemp("nonfinite")
    runs = [(overrides, root / name, nan_steps) for name, overrides, nan_steps in TRAIN_RUNS]
    return run_distributed(_rank, 2, runs, timeout=400), root


@pytest.fixture(scope="module")
def engine_results(dist_results):
    return [engine for engine, _ in dist_results[0]]


@pytest.mark.distributed
@pytest.mark.parametrize("stage,ep", STAGE_EP)
@pytest.mark.parametrize("inject", ["loss", "grad"])
def test_nan_on_one_rank_skips_the_step_on_every_rank(engine_results, stage, ep, inject):
    for rank, out in enumerate(engine_results):
        r = out[(stage, inject)]
        skipped = [s for s, skip, *_ in r["record"] if skip]
        assert skipped == [K], (rank, r["record"])
        s, _, nonfinite, norm_finite, gathered, _ = r["record"][K]
        # the loss flag is counted on the one rank that raised it; a NaN gradient shows in the norm
        assert (nonfinite, norm_finite) == (([1], True) if inject == "loss" else ([0], False)), (rank, r["record"][K])
        assert not gathered, "a skipped stage-3 step frees the gathered weights like a taken one"
        # the extra sums, over both ranks, after every step (the skipped one too); they skip nothing
        assert [rec[5] for rec in r["record"]] == [[3.0, 2.0 * s] for s in range(NF_STEPS)], (rank, r["record"])
        assert r["skipped"] == 1 and r["step_count"] == NF_STEPS - 1 and r["opt_steps"] == {NF_STEPS - 1}, r
        assert r["same_as_without"] and r["same_losses"], f"rank {rank}: not the run without step {K}"
        loss_err, w_err, g_err = r["vs_reference"]
        # test_zero's tolerances: the same runs differ from one process by reduction order only
        assert loss_err < 1e-5 and w_err < PARAM_ATOL and g_err < 1e-6, r["vs_reference"]


@pytest.mark.distributed
def test_weights_finite_sees_every_rank(engine_results):
    assert [out["weights_finite"] for out in engine_results] == [(True, False), (True, False)]


def test_skip_is_optional_and_flags_must_be_bool():
    net = sharded_net(Layout.single())
    engine = ZeroEngine(net, None, stage=1, lr=LR)
    x = torch.randn(2, 3, net.inp.in_features)
    engine.backward(engine(x).mean())
    with pytest.raises(ValueError, match="extra_finite must be a bool tensor.*float32"):
        engine.step(extra_finite=torch.ones(1))
    with pytest.raises(ValueError, match="extra_sums must be a floating-point tensor.*int64"):
        engine.step(extra_sums=torch.ones(1, dtype=torch.int64))
    engine.zero_grad()
    assert engine.weights_finite()
    out = engine(x)
    out.register_hook(lambda g: torch.full_like(g, NAN))
    engine.backward(out.mean())
    assert math.isnan(engine.step(skip_if_nonfinite=False))  # the old behaviour, on request
    assert not engine.last_step_skipped and engine.skipped_steps == 0 and not engine.weights_finite()


# ----- the trainer --------------------------------------------------------------------------------
STEP_K = 2  # counted from 1, as metrics.jsonl counts
BASE = [*SHORT, "train.steps=4", "train.log_every=1", "train.eval_every=4"]


@contextmanager
def nan_loss_at(steps):
    """``experiments.train.lm_loss`` is NaN at the given steps for the training loss (the mean;
    evaluate() sums). Its gradients stay finite: only the loss's own finiteness can tell."""
    real, calls = train_mod.lm_loss, itertools.count(1)

    def lm_loss(logits, y, reduction="mean"):
        loss = real(logits, y, reduction)
        if reduction != "mean":
            return loss
        # train.grad_accum=1 and no pipeline: one call per step
        return loss + NAN if next(calls) in steps else loss

    train_mod.lm_loss = lm_loss
    try:
        yield
    finally:
        train_mod.lm_loss = real


@contextmanager
def step_left_out(k):
    """The k-th engine.step() of a run is engine.zero_grad() instead: step k's update never happens."""
    real, calls = ZeroEngine.step, itertools.count(1)

    def step(self, *args, **kw):
        if next(calls) == k:
            self.zero_grad()
            return 0.0
        return real(self, *args, **kw)

    ZeroEngine.step = step
    try:
        yield
    finally:
        ZeroEngine.step = real


def strict_rows(run_dir):
    """metrics.jsonl parsed as strict JSON: NaN or Infinity tokens fail."""

    def refuse(token):
        raise AssertionError(f"metrics.jsonl holds {token}, which is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train_rank(rank, world, runs):
    from experiments.training.data import load_stdlib

    data, out = load_stdlib(), []  # read once (from the cache the stdlib fixture built), not once per run
    for overrides, run_dir, nan_steps in runs:
        with nan_loss_at(nan_steps if rank == 1 else ()):
            try:
                out.append(train(cfg_of(*overrides), run_dir=run_dir, data=data, keep_weights=True))
            except NonFiniteError as e:
                out.append(str(e))
    return out


TRAIN_LAYOUTS = [[], ["parallel=zero3_ep2"]]  # dp=2 stage 0, and ep=2 under ZeRO-3
# (run directory, overrides, steps whose loss is NaN on rank 1): one NaN under each layout, then
# NaN from step k on, which must stop the run
TRAIN_RUNS = [(f"dist{i}", BASE + extra, {STEP_K}) for i, extra in enumerate(TRAIN_LAYOUTS)]
TRAIN_RUNS.append(("stop", BASE + ["train.max_bad_steps=2"], set(range(STEP_K, 100))))


@pytest.mark.distributed
def test_trainer_skips_a_step_with_a_nan_loss_on_one_rank(dist_results, tmp_path, stdlib):
    per_rank = [train_runs for _, train_runs in dist_results[0]]
    run_root = dist_results[1]
    # the reference: one process in which step k's update never happens, built without the skip
    with step_left_out(STEP_K):
        ref = train(cfg_of(*BASE), run_dir=tmp_path / "ref", data=stdlib, keep_weights=True)
    # one process with the injection skips exactly that step: bit for bit the same run
    with nan_loss_at({STEP_K}):
        one = train(cfg_of(*BASE), run_dir=tmp_path / "one", data=stdlib, keep_weights=True)
    assert all(torch.equal(one["weights"][n], w) for n, w in ref["weights"].items())
    others = [i for i in range(4) if i != STEP_K - 1]
    assert [one["train_losses"][i] for i in others] == [ref["train_losses"][i] for i in others]
    ref_rows = metrics_rows(tmp_path / "ref")

    for i, extra in enumerate(TRAIN_LAYOUTS):
        summaries = [r[i] for r in per_rank]
        assert [s["skipped_steps"] for s in summaries] == [1, 1], extra
        rows = strict_rows(run_root / f"dist{i}")
        assert [r["skipped_steps"] for r in rows] == [0, 1, 1, 1], extra
        # the only step of row k was skipped: its means are null, the other rows are full
        assert rows[STEP_K - 1]["loss"] is None and rows[STEP_K - 1]["grad_norm"] is None, rows[STEP_K - 1]
        assert json.loads((run_root / f"dist{i}" / "summary.json").read_text())["skipped_steps"] == 1
        # the 2-rank run with the skip trains like one process without the step (test_train's
        # layout tolerances: the runs differ in summation order only)
        got = assemble_weights(summaries, ref["weights"])
        for name, w in ref["weights"].items():
            torch.testing.assert_close(got[name], w, rtol=0, atol=WEIGHT_ATOL, msg=lambda m: f"{extra} {name}: {m}")
        np.testing.assert_allclose(
            [rows[j]["loss"] for j in others], [ref_rows[j]["loss"] for j in others], rtol=LOSS_RTOL
        )
        np.testing.assert_allclose(
            [rows[j]["grad_norm"] for j in others], [ref_rows[j]["grad_norm"] for j in others], rtol=LOSS_RTOL
        )

    # repeated NaN losses on rank 1 stop both ranks at the second one, naming the loss
    for message in (r[-1] for r in per_rank):
        assert isinstance(message, str), message
        assert f"training stopped at step {STEP_K + 1}: 2 consecutive optimizer steps were skipped" in message
        assert "first non-finite quantity was the loss (non-finite on 1 of 2 ranks)" in message
        assert f"it began at step {STEP_K}" in message and "train.max_bad_steps=2" in message
    rows = strict_rows(run_root / "stop")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["skipped_steps"] == 2  # a row at the stop


def test_diverging_run_stops_naming_the_gradient_norm(tmp_path, stdlib):
    # optim.lr=1e4 used to log NaN (invalid JSON) at every step and exit 0 with "final val loss nan"
    cfg = cfg_of(*SHORT, "optim.lr=1e4", "train.steps=30", "train.log_every=1", "train.max_bad_steps=3")
    with pytest.raises(
        NonFiniteError,
        match=r"3 consecutive optimizer steps .* first non-finite quantity was the "
        r"gradient norm \((inf|nan)\).*optim\.lr=",
    ):
        train(cfg, run_dir=tmp_path / "run", data=stdlib)
    rows = strict_rows(tmp_path / "run")
    assert rows[-1]["skipped_steps"] == 3 and rows[-1]["loss"] is None


def test_a_layer_aux_loss_is_named(tmp_path, stdlib, monkeypatch):
    # NaN into the second MoE layer from step 2 on: its aux_loss is the first non-finite quantity
    # (computed before the loss and the gradient norm, and after the first layer's)
    build = train_mod.build_model

    def poisoned(cfg, *args, **kwargs):
        model = build(cfg, *args, **kwargs)
        calls = itertools.count(1)

        def hook(module, args):
            if module.training and next(calls) >= 2:
                return (args[0] * NAN,)

        model.moe_layers()[1].register_forward_pre_hook(hook)
        return model

    monkeypatch.setattr(train_mod, "build_model", poisoned)
    cfg = cfg_of(*BASE, "train.max_bad_steps=2")
    with pytest.raises(
        NonFiniteError,
        match=r"at step 3 the first non-finite quantity was the aux_loss of MoE layer "
        r"blocks\.1\.ffn \(non-finite on 1 of 1 ranks\)",
    ):
        train(cfg, run_dir=tmp_path / "run", data=stdlib)


def test_max_bad_steps_must_be_positive(tmp_path, stdlib):
    with pytest.raises(ValueError, match=r"train\.max_bad_steps=0 is invalid: expected a positive integer"):
        train(cfg_of(*BASE, "train.max_bad_steps=0"), run_dir=tmp_path / "run", data=stdlib)
