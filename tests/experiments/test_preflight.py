"""The trainer's preflight (a layout predicted not to fit stops before anything is built),
``parallel=auto`` (the planner's fastest layout that fits), and the measured peak memory in
summary.json (``experiments.training.peak_memory``) against planted allocations."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import zero.plan as zplan
from experiments.plan import costs_of
from experiments.training import loop
from experiments.training.peak_memory import PeakMemory, paired_high_water
from experiments.training.preflight import PreflightError, profile_of, record_of, resolve_auto
from tests.support.dist import run_distributed
from tests.support.training import LOSS_RTOL, TINY, cfg_of, run
from zero.reduction import WAIT_RANGE

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = [*TINY, "logger=none"]
CPU = torch.device("cpu")


def _reference_ranking(cfg, world):
    """Every layout of ``world`` ranks with its prediction, fastest first, straight from zero.plan:
    what the trainer's choices are checked against."""
    profile = profile_of(cfg, CPU)
    costs = costs_of(cfg, profile)
    recs = zplan.enumerate(costs, world=world, batch_size=int(cfg.train.batch_size), mixed_precision="fp32")
    recs = zplan.with_balanced(recs, costs, profile)  # each pipeline also cut by its layers' costs
    ranked = [(r, zplan.predict(r, costs, profile)) for r in recs]
    ranked.sort(key=lambda rp: (rp[1].step_s, rp[1].memory_bytes))
    return ranked


def _need(p):
    """One CPU rank's bytes: the device is the host, so an offloaded optimizer state counts too."""
    return p.memory_bytes + p.host_bytes


def _nothing_may_be_built(monkeypatch):
    """The preflight must stop the trainer before any of these runs."""

    def refuse(what):
        def fail(*a, **k):
            raise AssertionError(f"{what} ran before the preflight refused the layout")

        return fail

    monkeypatch.setattr(loop, "build_layout", refuse("build_layout (process groups)"))
    monkeypatch.setattr(loop, "build_data", refuse("build_data"))
    monkeypatch.setattr(loop, "build_model", refuse("build_model"))
    monkeypatch.setattr(torch.distributed, "init_process_group", refuse("init_process_group"))
    monkeypatch.setattr(loop.PeakMemory, "start", refuse("the memory meter"))


def test_an_over_budget_layout_is_refused_before_anything_is_built(monkeypatch):
    cfg = cfg_of(*BASE)
    ranked = _reference_ranking(cfg, 1)
    mine = dict(ranked)[record_of(cfg, 1)]
    # a budget the chosen layout (ZeRO-0, no checkpointing) exceeds but checkpointed layouts fit
    budget = int(_need(mine)) - 1
    fitting = [(r, p) for r, p in ranked if _need(p) <= budget]
    assert fitting, "the test needs layouts under the budget"
    _nothing_may_be_built(monkeypatch)
    with pytest.raises(PreflightError) as e:
        loop.Trainer(cfg_of(*BASE, f"train.preflight_budget_bytes={budget}"))
    msg = str(e.value)
    assert f"predicted to need {mine.memory_bytes:,.0f} bytes" in msg and f"budget of {budget:,} bytes" in msg
    for part, v in mine.memory_parts.items():
        if v:
            assert f"{part} {v:,.0f}" in msg
    # the three fastest layouts under the budget, in order, each with its overrides
    listed = [line.strip() for line in msg.splitlines() if line.startswith("  ")]
    assert len(listed) == min(3, len(fitting))
    for line, (r, p) in zip(listed, fitting):
        assert line.startswith(r.label() + ":") and line.endswith(" ".join(r.overrides())), (line, r.label())
        assert f" {_need(p) / 1e9:.4g} GB per rank, {p.step_s:.4g} s/step" in line, line


def test_nothing_fits_is_said_and_preflight_false_skips(monkeypatch, tmp_path, stdlib):
    with pytest.raises(PreflightError, match="no layout of 1 ranks fits"):
        loop.Trainer(cfg_of(*BASE, "train.preflight_budget_bytes=1000"), data=stdlib)
    summary = run(cfg_of(*BASE, "train.preflight_budget_bytes=1000", "train.preflight=false"), tmp_path, stdlib)
    assert summary["plan"] is None and summary["memory"]["predicted_peak_bytes"] is None
    assert len(summary["train_losses"]) == 2


def test_a_fitting_layout_runs_and_reports_its_prediction_and_measured_peak(tmp_path, stdlib):
    cfg = cfg_of(*BASE, "parallel.zero_stage=1", "model.checkpoint_activations=true")
    ref = dict(_reference_ranking(cfg, 1))[record_of(cfg, 1)]
    summary = run(cfg, tmp_path, stdlib)
    plan = json.loads((tmp_path / "run" / "summary.json").read_text())["plan"]
    assert plan["auto"] is False and plan["layout"] == "pp1 dp1 ep1 z1 ckpt"
    assert plan["predicted_peak_bytes"] == ref.memory_bytes and plan["predicted_parts"] == ref.memory_parts
    mem = summary["memory"]
    assert mem["predicted_peak_bytes"] == ref.memory_bytes
    (peak,) = mem["measured_peak_bytes"]
    # at least the model states the engine holds (weights, gradients, Adam's moments)
    assert peak >= 16 * summary["params_total"]


@pytest.mark.parametrize(
    "override,match",
    [
        ("train.preflight_budget_bytes=-1", "train.preflight_budget_bytes=-1.0 is invalid"),
        ("train.memory_steps=-1", "train.memory_steps=-1 is invalid"),
        ("train.plan_cluster=nope", "train.plan_cluster='nope' is invalid: .*valid names are"),
    ],
)
def test_bad_plan_keys_are_named_before_anything_is_built(monkeypatch, override, match):
    _nothing_may_be_built(monkeypatch)
    with pytest.raises(ValueError, match=match):
        loop.Trainer(cfg_of(*BASE, override))


def test_auto_runs_the_fastest_layout_that_fits(tmp_path, stdlib):
    cfg = cfg_of(*BASE)
    ranked = _reference_ranking(cfg, 1)
    summary = run(cfg_of(*BASE, "parallel=auto"), tmp_path, stdlib)
    assert summary["plan"]["auto"] is True and summary["plan"]["layout"] == ranked[0][0].label()
    assert summary["plan"]["layouts_ranked"] == len(ranked)
    # a budget the fastest exceeds: the fastest under it
    budget = int(_need(ranked[0][1])) - 1
    expect = next(r for r, p in ranked if _need(p) <= budget)
    summary = run(cfg_of(*BASE, "parallel=auto", f"train.preflight_budget_bytes={budget}"), tmp_path, stdlib, "b")
    assert summary["plan"]["layout"] == expect.label() != ranked[0][0].label()
    assert summary["plan"]["overrides"] == expect.overrides()


def test_auto_holds_the_keys_given():
    cfg = cfg_of(*BASE, "parallel=auto")
    rec, _, n = resolve_auto(cfg, 2, {"zero_stage": 3, "checkpoint_activations": True})
    ranked = [(r, p) for r, p in _reference_ranking(cfg_of(*BASE), 2) if r.zero_stage == 3 and r.checkpoint_activations]
    assert n == len(ranked) and rec == ranked[0][0]
    # the config now asks for it
    assert (cfg.parallel.zero_stage, cfg.model.checkpoint_activations, cfg.parallel.pp) == (3, True, rec.pp)
    # a split in the config is held: the fastest pipeline of that many stages, cut that way
    cfg = cfg_of(*BASE, "parallel=auto", "parallel.pp_layers=[1,3]")
    rec, _, n = resolve_auto(cfg, 2)
    profile = profile_of(cfg, CPU)
    costs = costs_of(cfg, profile)
    held = [
        dataclasses.replace(r, pp_layers=(1, 3))
        for r, _ in _reference_ranking(cfg_of(*BASE), 2)
        if r.pp == 2 and r.pp_virtual_stages == 1 and r.pp_layers is None
    ]
    predicted = {r: zplan.predict(r, costs, profile) for r in held}
    expect = min(held, key=lambda r: (predicted[r].step_s, predicted[r].memory_bytes))
    assert rec == expect and n == len(held) and "parallel.pp_layers=[1,3]" in rec.overrides()
    assert list(cfg.parallel.pp_layers) == [1, 3] and cfg.parallel.pp == 2


def test_a_split_given_is_predicted_as_given_and_refused_with_its_numbers(monkeypatch):
    """``parallel.pp_layers`` is the planner's to predict (each stage its own layers), so the
    preflight judges an uneven split too, before anything is built."""
    from experiments.training.preflight import predict_config, preflight

    split = [*BASE, "parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.pp_microbatches=2"]
    cfg = cfg_of(*split, "parallel.pp_layers=[1,3]")
    rec, p = predict_config(cfg, 2, CPU)
    profile = profile_of(cfg, CPU)
    costs = costs_of(cfg, profile)
    assert rec.pp_layers == (1, 3) and p == zplan.predict(rec, costs, profile)
    even = zplan.predict(dataclasses.replace(rec, pp_layers=None), costs, profile)
    assert p.memory_bytes != even.memory_bytes  # rank 1 holds both blocks and the head
    budget = int(_need(p)) - 1
    _nothing_may_be_built(monkeypatch)
    with pytest.raises(PreflightError, match=f"predicted to need {p.memory_bytes:,.0f} bytes"):
        preflight(cfg_of(*split, "parallel.pp_layers=[1,3]", f"train.preflight_budget_bytes={budget}"), 2)


def _auto_rank(rank, world, overrides, run_dir):
    from experiments.train import train

    torch.set_num_threads(1)
    return train(cfg_of(*overrides), run_dir=run_dir)


@pytest.mark.distributed
def test_auto_on_two_gloo_ranks_trains_like_one_process(tmp_path, stdlib):
    overrides = [*BASE, "parallel=auto", "train.steps=3", "train.eval_every=3"]
    got = run_distributed(_auto_rank, 2, overrides, tmp_path / "auto", timeout=400)
    expect = _reference_ranking(cfg_of(*BASE), 2)[0][0]
    on_disk = json.loads((tmp_path / "auto" / "summary.json").read_text())
    for s in (*got, on_disk):
        assert s["plan"]["layout"] == expect.label() and s["plan"]["overrides"] == expect.overrides()
    assert [s["layout"]["pp"] for s in got] == [expect.pp] * 2 and [s["layout"]["ep"] for s in got] == [expect.ep] * 2
    assert len(on_disk["memory"]["measured_peak_bytes"]) == 2 and None not in on_disk["memory"]["measured_peak_bytes"]
    # the same global batch on one process: the same losses (the layouts' own tolerance)
    single = run(cfg_of(*BASE, "train.steps=3", "train.eval_every=3"), tmp_path, stdlib, "single")
    torch.testing.assert_close(got[0]["train_losses"], single["train_losses"], rtol=LOSS_RTOL, atol=0)


# ----- the measured peak ---------------------------------------------------------------------------

MiB = 1 << 20


def test_high_water_is_the_largest_running_sum_in_time_order_paired_by_address():
    # (time, address, bytes): 4 at A, 6 at B, A freed, 1 at C
    assert paired_high_water([(3, 0xA, -4), (1, 0xA, 4), (2, 0xB, 6), (4, 0xC, 1)]) == 10
    assert paired_high_water([]) == 0
    # a free of a block from before the events counts nothing (whatever bytes it names)
    assert paired_high_water([(1, 0xA, 4), (2, 0xF, -100), (3, 0xB, 3)]) == 7
    # A's free went unseen (another thread's): an allocation at A frees it there, not on top of it
    assert paired_high_water([(1, 0xA, 4), (2, 0xB, 3), (3, 0xA, 5), (4, 0xA, -5)]) == 8


def test_cpu_meter_sees_a_block_another_thread_freed_once_its_address_is_taken():
    import threading

    def drop_elsewhere(box):  # the last reference dropped on a thread the profiler does not follow
        t = threading.Thread(target=box.clear)
        t.start()
        t.join()

    meter = PeakMemory(CPU, steps=1).start()
    for _ in range(40):  # 1 MiB blocks one after another, each freed on another thread
        drop_elsewhere([torch.empty(MiB // 4)])
    meter.step_done()
    # unpaired, every block counts: 40 MiB. Paired, each is freed where a later one takes its
    # address; glibc does not always hand a freed block's address to the next of its size (it maps
    # blocks this large afresh until a freed one raises its threshold, and the other thread's own
    # allocations move the heap), so a few stay counted: 2 or 3 of 40 in 20 windows of one process
    # here, up to 8 in a fresh one
    assert meter.peak() <= 20 * MiB, meter.peak() / MiB


def test_cpu_meter_counts_planted_allocations_exactly():
    keep = torch.ones(1000)  # allocated before the start: neither it nor its free counts
    meter = PeakMemory(CPU, steps=1).start()
    a = torch.empty(8 * MiB // 4)
    del keep, a
    b = torch.empty(2 * MiB // 4)
    c = torch.empty(3 * MiB // 4)  # with b: 5 MiB < 8 MiB
    s = torch.empty(MiB // 4)
    s.untyped_storage().resize_(0)  # ZeRO-3's free and gather: resize_ reaches the allocator
    s.untyped_storage().resize_(5 * MiB)  # 2 + 3 + 5 = 10 MiB alive
    meter.step_done()  # the window closes
    d = torch.empty(64 * MiB // 4)  # after the window: not seen
    assert meter.peak() == 10 * MiB
    del b, c, s, d


def test_cpu_meter_off_and_closed():
    meter = PeakMemory(CPU, steps=0).start()
    assert meter.peak() is None and meter.method is None
    meter = PeakMemory(CPU, steps=2).start()
    meter.close()  # a failed run: the profiler is stopped, nothing reported
    assert meter.peak() is None


def test_the_trainers_peak_moves_by_a_planted_allocation(monkeypatch, tmp_path, stdlib):
    cfg = [*BASE, "train.eval_every=100", "train.memory_steps=2"]
    plain = run(cfg_of(*cfg), tmp_path, stdlib, "plain")["memory"]["measured_peak_bytes"][0]
    step = loop.Trainer.train_step

    def planted(self, i):
        ballast = torch.ones(32 * MiB // 4)  # alive through the whole step: forward, backward, optimizer
        out = step(self, i)
        del ballast
        return out

    monkeypatch.setattr(loop.Trainer, "train_step", planted)
    got = run(cfg_of(*cfg), tmp_path, stdlib, "planted")["memory"]["measured_peak_bytes"][0]
    # the same allocations in the same order (a fixed seed, one thread) plus the ballast under the peak
    assert got - plain == 32 * MiB


def test_an_inferred_free_takes_its_own_allocation_only():
    # (time, address, bytes, allocation): the free the meter infers for allocation 0 at time 5
    # finds the block at A already freed and another in its place: it takes nothing
    events = [(1, 0xA, 4), (2, 0xA, -4), (3, 0xA, 6), (5, 0xA, -4, 0), (6, 0xB, 1)]
    assert paired_high_water(events) == 7
    # unseen free: the inferred one takes the block at time 5
    assert paired_high_water([(1, 0xA, 4), (5, 0xA, -4, 0), (6, 0xB, 3)]) == 4


class _ExtraFields_Allocation:  # the name the meter reads off the profiler's allocation events
    def __init__(self, ptr, size):
        self.ptr, self.alloc_size = ptr, size


def _node(name, t0, t1=None, parent=None, fields=None):
    from types import SimpleNamespace

    n = SimpleNamespace(name=name, start_time_ns=t0, end_time_ns=t1 or t0, parent=parent, children=[])
    n.extra_fields = fields
    if parent is not None:
        parent.children.append(n)
    return n


def test_a_collectives_copy_is_freed_by_the_end_of_the_engines_wait():
    """gloo's reduce-scatter clones its input; the clone goes with the collective's work, on gloo's
    worker thread when that finishes last, a free the profiler does not see. The meter frees such a
    copy at the end of the engine's wait for its reductions (its profiler range), unless it saw the
    free before. An allocation elsewhere, or a collective's own output, is left alone."""
    from experiments.training.peak_memory import _allocation_events

    def trace(seen_free: bool, op: str = "aten::clone"):
        rs = _node("c10d::_reduce_scatter_base_", 10, 20)
        inner = _node(op, 11, 19, rs)
        empty = _node("aten::empty_strided", 12, 13, inner)
        roots = [rs, _node(WAIT_RANGE, 30, 40)]
        _node("[memory]", 12, parent=empty, fields=_ExtraFields_Allocation(0xA, 8 * MiB))
        if seen_free:
            roots.append(_node("[memory]", 35, fields=_ExtraFields_Allocation(0xA, -8 * MiB)))
        roots.append(_node("[memory]", 50, fields=_ExtraFields_Allocation(0xB, 3 * MiB)))  # after the wait
        return paired_high_water(_allocation_events(roots))

    assert trace(seen_free=False) == 8 * MiB  # was 11 MiB: the copy counted beside the later block
    assert trace(seen_free=True) == 8 * MiB
    assert trace(seen_free=False, op="aten::empty") == 11 * MiB  # not a copy of an input: left alone


def _reduce_scatter_trace(rank, world):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from experiments.training.peak_memory import _allocations, _library_copy

    x = torch.randn(MiB // 4)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = torch.empty(MiB // 4)
        work = dist.reduce_scatter_tensor(out, x, async_op=True)
        with record_function(WAIT_RANGE):
            work.wait()
        del work
    copies, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation" and node.extra_fields.alloc_size > 0:
            copies.append(_library_copy(node))
    return copies, paired_high_water(_allocations(prof))


@pytest.mark.distributed
def test_the_meter_finds_gloos_reduce_scatter_copy_in_a_real_trace():
    """The op names the meter looks for are torch's: a reduce-scatter through gloo, traced by the
    profiler, has its input's clone under a ``c10d::`` op, and the meter's peak over that window
    is the clone and the output, however the clone's free fell."""
    [(copies, peak)] = run_distributed(_reduce_scatter_trace, 1)
    assert copies.count(True) == 1, copies
    assert peak == 2 * MiB


def test_the_census_lists_the_blocks_alive_at_the_peak_with_what_allocated_them():
    """``census_at_peak``: the blocks counted at the high-water mark, each with the operators and
    pipeline action that allocated it (what `--part c` groups); a block freed before the peak, or
    allocated after it, is not among them."""
    from experiments.bench.plan import census_groups
    from experiments.training.peak_memory import census_at_peak

    f0 = _node("PP:1F0", 0, 10)
    mm = _node("aten::mm", 1, 2, f0)
    b0 = _node("PP:1B0", 20, 30)
    add = _node("aten::add", 21, 22, b0)
    roots = [
        f0,
        b0,
        _node("[memory]", 1, parent=mm, fields=_ExtraFields_Allocation(0xA, 4 * MiB)),
        _node("[memory]", 2, parent=mm, fields=_ExtraFields_Allocation(0xB, 1 * MiB)),
        _node("[memory]", 3, fields=_ExtraFields_Allocation(0xB, -1 * MiB)),  # freed before the peak
        _node("[memory]", 21, parent=add, fields=_ExtraFields_Allocation(0xC, 2 * MiB)),  # the peak: 6 MiB
        _node("[memory]", 25, fields=_ExtraFields_Allocation(0xA, -4 * MiB)),
        _node("[memory]", 26, fields=_ExtraFields_Allocation(0xD, 3 * MiB)),  # after the peak
    ]
    blocks = sorted(census_at_peak(roots))
    assert blocks == [(2 * MiB, ("aten::add", "PP:1B0")), (4 * MiB, ("aten::mm", "PP:1F0"))]
    assert census_groups(blocks) == [
        ("PP:1F0", "aten::mm < PP:1F0", 4 * MiB, 1),
        ("PP:1B0", "aten::add < PP:1B0", 2 * MiB, 1),
    ]
