"""``python -m experiments.plan``: the ranked table, the JSON and the chart from the trainer's own
config tree, held layout keys, the errors for bad input, and ``--calibrate``."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

import zero.plan as zplan
from experiments import plan as cli
from tests.support.paths import ROOT

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = ["model=tiny", "logger=none", "train.batch_size=6", "train.seq_len=16", "moe.num_experts=4"]


def _main(capsys, *argv):
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_writes_a_ranked_table_json_and_chart(capsys, tmp_path):
    out = tmp_path / "plan.json"
    rc, stdout, _ = _main(capsys, *MODEL, "plan.world=2", "plan.cluster=cpu_2core", f"plan.out={out}", "plan.top=7")
    assert rc == 0
    assert "| 1 | " in stdout and "| 7 | " in stdout and "| 8 | " not in stdout
    assert "picked: " in stdout and "torchrun --nproc_per_node=2 -m experiments.train" in stdout
    rows = json.loads(out.read_text())
    assert rows and [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    for r in rows:
        assert set(r) >= {"overrides", "memory_bytes", "memory_parts", "step_s", "fits"}
        assert math.isclose(sum(r["memory_parts"].values()), r["memory_bytes"], rel_tol=1e-12)
        assert all(o.split("=")[0] in zplan.KEYS.values() for o in r["overrides"])
    assert len({tuple(r["overrides"]) for r in rows}) == len(rows)
    # every layout of 2 ranks: pp 1 or 2, ep 1 or 2, each ZeRO stage, a pipeline schedule
    keys = {o for r in rows for o in r["overrides"]}
    assert {"parallel.pp=2", "parallel.ep=2", "parallel.zero_stage=3", "parallel.zero_offload=cpu"} <= keys
    pytest.importorskip("matplotlib")
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_layout_key_given_is_held(capsys, tmp_path):
    out = tmp_path / "p.json"
    rc, stdout, _ = _main(
        capsys,
        *MODEL,
        "parallel.pp=2",
        "train.grad_accum=3",
        "plan.world=2",
        "plan.cluster=h100_node",
        f"plan.out={out}",
    )
    assert rc == 0, stdout
    rows = json.loads(out.read_text())
    assert rows and all("parallel.pp=2" in r["overrides"] and "train.grad_accum=3" in r["overrides"] for r in rows)
    assert "held: {'pp': 2, 'grad_accum': 3}" in stdout


def test_a_held_split_is_the_only_cut_and_auto_cuts_are_listed_beside_the_even(capsys, tmp_path):
    """``parallel.pp_layers`` given: every layout listed is a pipeline of that many stages, cut that
    way. Not given: each pipeline cut by cost sits beside its even twin (where it gains)."""
    out = tmp_path / "held.json"
    rc, stdout, _ = _main(
        capsys, *MODEL, "parallel.pp_layers=[1,3]", "plan.world=2", "plan.cluster=cpu_2core", f"plan.out={out}"
    )
    assert rc == 0 and "held: {'pp_layers': [1, 3]}" in stdout
    rows = json.loads(out.read_text())
    assert rows and all({"parallel.pp_layers=[1,3]", "parallel.pp=2"} <= set(r["overrides"]) for r in rows)
    assert cli.fixed_keys(["parallel.pp_layers=[2,1,1,2]", "parallel.pp_layers=null"]) == {"pp_layers": [2, 1, 1, 2]}
    with pytest.raises(ValueError, match=r"parallel.pp_layers='\[a\]' is invalid: expected a list of integers"):
        cli.fixed_keys(["parallel.pp_layers=[a]"])
    # the trainer's default model on 2 ranks: zbv's even cut leaves rank 1 three blocks of four
    cfg = cli.compose(["model=small", "train.batch_size=16", "train.seq_len=128"])
    profile = zplan.load_profile("cpu_2core")
    _, ranked = cli.plan_layouts(cfg, 2, profile, {"pp_schedule": "zbv", "pp_microbatches": 4, "zero_stage": 0})
    labels = {r.label(): p.step_s for r, p in ranked if not r.checkpoint_activations and r.grad_accum == 1}
    even, cut = labels["pp2 zbvx2 m4 dp1 ep1 z0"], labels["pp2 zbvx2 m4 layers 2/1/1/2 dp1 ep1 z0"]
    assert cut < 0.8 * even


@pytest.mark.parametrize(
    "args,message",
    [
        (["plan.world=0", "plan.cluster=cpu_2core"], "plan.world=0 is invalid: expected a positive integer"),
        (["plan.world=two", "plan.cluster=cpu_2core"], "plan.world='two' is invalid: expected int"),
        (["plan.cluster=cpu_2core"], "plan.world is required"),
        (["plan.world=2", "plan.cluster=nope"], "plan.cluster='nope': no profile"),
        (["plan.world=2", "plan.cluster=cpu_2core", "plan.colour=red"], "'plan.colour=red': expected plan.<key>"),
        (["plan.world=5", "plan.cluster=cpu_2core"], "no layout of 5 ranks is valid for train.batch_size=6"),
    ],
)
def test_bad_input_gets_a_message_naming_the_value(capsys, args, message):
    rc, _, err = _main(capsys, *MODEL, *args)
    assert rc == 1 and message in err, err
    if "nope" in message:
        assert "h100_node" in err  # and what would be valid


def test_nothing_fits_says_what_the_smallest_layout_needs(capsys, tmp_path):
    small = zplan.load_profile("cpu_2core").to_dict()
    small.update(name="tiny_device", device_memory_bytes=1000.0, memory_shared_by_node=False)
    path = zplan.save_profile(zplan.Profile.from_dict(small), tmp_path / "tiny_device.yaml")
    rc, stdout, err = _main(capsys, *MODEL, "plan.world=2", f"plan.cluster={path}")
    assert rc == 2
    assert "nothing fits: the smallest layout" in err and "tiny_device has 1e-06 GB" in err
    assert "| NO |" in stdout


@pytest.mark.distributed
def test_calibrate_writes_a_profile_that_loads(tmp_path):
    out = tmp_path / "here.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.plan", "--calibrate", "--quick", "--no-collectives", "--base", "cpu_2core"]
        + ["--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    p = zplan.load_profile(out)
    assert p.name == "here" and p.memory_bandwidth > 0 and p.op_overhead_s > 0 and p.backward_op_overhead_s > 0
    assert all(len(row) == 4 and row[-1] > 0 for rows in p.matmul_flops.values() for row in rows)
    # the three non-matmul rates by rows (--quick: 256 and 4,096), each row positive
    for table in (p.elementwise_bandwidth, p.activation_bandwidth, p.forward_elementwise_bandwidth):
        assert [row[0] for row in table] == [256.0, 4096.0] and all(row[1] > 0 for row in table)
    # the split backward's passes, each a share of a whole backward at those rows
    for table in (p.split_input_share, p.split_weight_share):
        assert [row[0] for row in table] == [256.0, 4096.0] and all(0 < row[1] < 10 for row in table)
    assert p.collectives == zplan.load_profile("cpu_2core").collectives  # from --base: not measured here


def test_the_forwards_rate_is_what_the_reference_blocks_time_leaves_per_byte():
    """``forward_rest_rate`` inverts the planner's forward: a time made of the block's counted
    forward (products, attention, activation, operators) plus its other bytes at a rate R gives R
    back, whatever the tokens; a time under a tenth above the counted part is held at ten times
    what the time alone gives; the profile it predicts on leaves those bytes free."""
    from experiments.calibrate import _rates_profile, _reference_block_config, forward_rest_rate
    from moe.costs import model_costs
    from zero.plan.terms import _Costing

    shipped = zplan.load_profile("cpu_2core").to_dict()
    profile = _rates_profile(shipped, "cpu")
    assert profile.forward_elementwise_rate(256) == math.inf  # the bytes measured are not counted twice
    cfg = _reference_block_config()
    block = model_costs(cfg, cfg.max_seq_len, experts="fused").blocks[1]
    assert block.is_moe and block.elementwise_bytes > block.activation_bytes > 0
    rest = block.elementwise_bytes - block.activation_bytes
    for tokens in (256, 4096):
        costs = zplan.ModelCosts(blocks=(block,), seq_len=tokens)
        counted = _Costing(zplan.LayoutRecord(world=1, batch_size=1), costs, profile, None).compute(block)["F"]
        assert counted > 0
        for rate in (2e9, 5e9):
            measured = counted + rest * tokens / rate
            assert rest * tokens / rate > 0.1 * measured  # above the floor
            assert forward_rest_rate(block, tokens, measured, profile) == pytest.approx(rate)
        # the counted part alone: the remainder held at a tenth of the time
        assert forward_rest_rate(block, tokens, counted, profile) == pytest.approx(rest * tokens / (0.1 * counted))
        # on the rates with those bytes counted, the same time leaves less: the rate comes out higher
        full = zplan.Profile.from_dict({**profile.to_dict(), "forward_elementwise_bandwidth": 2e9})
        assert forward_rest_rate(block, tokens, counted + rest * tokens / 2e9, full) > 2e9


def test_calibration_keeps_the_median_of_its_repeats():
    from experiments.calibrate import median_of

    runs = [
        {"rate": 3.0, "rows": [[64, 16, 1.0], [64, 32, 9.0]], "name": "cpu"},
        {"rate": 1.0, "rows": [[64, 16, 5.0], [64, 32, 2.0]], "name": "cpu"},
        {"rate": 2.0, "rows": [[64, 16, 4.0], [64, 32, 4.0]], "name": "cpu"},
    ]
    # per figure, not per run: no run holds both middles
    assert median_of(runs) == {"rate": 2.0, "rows": [[64, 16, 4.0], [64, 32, 4.0]], "name": "cpu"}


def test_a_collective_beside_compute_costs_its_processs_cpu_time_per_call():
    """``cpu_per_call``: the process's CPU time over batches of (launch, wait), per call, the
    median batch, each batch after a barrier; on a clock the fakes move, a launch of 0.5 and a
    wait of 0.25 CPU seconds cost 0.75 a call, and one slow batch does not move the median."""
    from experiments.calibrate import cpu_per_call

    clock, barriers, slow = [0.0], [], [0]

    class Handle:
        def wait(self):
            clock[0] += 0.25

    def launch():
        slow[0] += 1
        clock[0] += 0.5 + (10.0 if slow[0] == 3 else 0.0)  # one call of the first batch stalls
        return Handle()

    cost = cpu_per_call(launch, 4, 3, lambda: barriers.append(1), clock=lambda: clock[0])
    assert cost == pytest.approx(0.75) and len(barriers) == 3


def test_the_calibrations_collectives_beside_compute_are_fitted_and_a_noisy_one_left_out():
    """What an asynchronous collective costs beside compute is fitted like the collectives' times
    (α per step, β); timings that do not grow with the size give no fit: that op is left out,
    saying why, and the profile keeps the others."""
    from experiments.calibrate import _collectives, median_collectives

    sizes = [1 << 12, 1 << 20, 1 << 24]
    ab = zplan.AlphaBeta(4e-4, 2e9)
    times = {op: [ab.time(op, s, 2) for s in sizes] for op in ("all_reduce", "reduce_scatter", "all_to_all")}
    beside = {"all_reduce": [zplan.AlphaBeta(3e-4, 1e9).time("all_reduce", s, 2) for s in sizes]}
    beside["all_gather"] = [3e-3, 2e-3, 1e-3]  # falls with the size: no bandwidth
    res = _collectives(times, times, 2, sizes, True, beside)
    assert res["fitted_beside"]["all_reduce"] == pytest.approx({"alpha": 3e-4, "beta": 1e9})
    assert set(res["fitted_beside"]) == {"all_reduce"} and "do not grow" in res["beside_unfitted"]["all_gather"]
    assert [s for s, _ in res["beside"]["all_reduce"]] == sizes
    # three runs' medians, fitted again; a run measured without them (idle ranks) has none
    again = median_collectives([res, res, res])
    assert again["fitted_beside"] == res["fitted_beside"]
    assert _collectives(times, times, 2, sizes, False)["fitted_beside"] == {}


@pytest.mark.distributed
def test_calibrate_fits_the_collectives_of_gloo_ranks(tmp_path):
    # three ranks: the point-to-point pair is ranks 0 and 1, and the third waits for them (it once
    # waited for a message nobody sent, until gloo's timeout). Three ranks on two cores, beside the
    # other xdist worker's test: a call waits milliseconds for its peers' turn on a core, so the
    # largest message must take well beyond that for the times to grow with the size (at 4 MiB an
    # all-gather took 3.2 ms and a 4 KiB one 4.4, and no bandwidth could be fitted; 16 MiB takes ~12)
    sizes = [1 << 12, 1 << 20, 1 << 24]
    res = cli.measure_collectives("gloo", world=3, sizes=sizes)
    assert res["busy"] and res["world"] == 3  # gloo: timed between computing ranks
    for op, ab in res["fitted"].items():
        assert ab["beta"] > 0 and ab["alpha"] >= 0, op
        assert [s for s, _ in res["raw"][op]] == sizes
        # fitted to the times between computing ranks, never below the idle cores' (their floor)
        assert all(t >= t_idle for (_, t), (_, t_idle) in zip(res["raw"][op], res["idle"][op])), op
        want = zplan.fit_alpha_beta(op, 3, sizes, [t for _, t in res["raw"][op]])
        assert ab == {"alpha": want.alpha, "beta": want.beta}, op
    # the asynchronous ones a step runs beside its compute, each timed beside it at every size;
    # each fitted, or left out saying why
    from experiments.calibrate import BESIDE_OPS

    assert set(res["beside"]) == set(BESIDE_OPS)
    for op, pts in res["beside"].items():
        assert [s for s, _ in pts] == sizes and all(t > 0 for _, t in pts), op
        assert (op in res["fitted_beside"]) != (op in res["beside_unfitted"]), op


def test_the_planner_benchmarks_routing_skew_and_rank_correlation():
    from experiments.bench.plan import _rank_skew, _spearman

    rows = [
        {"expert_load": [[4, 0, 2, 2], [1, 1, 1, 1]]},  # ranks of ep2: 4 and 4 | 2 and 2
        {"expert_load": [[5, 1, 1, 1]]},  # 6 and 2: 6 / 4
        {"tokens_per_s": 1.0},  # a row without MoE statistics
    ]
    assert _rank_skew(rows, 2) == pytest.approx(1.5)
    assert _rank_skew(rows, 4) == pytest.approx(5 / 2)  # one expert a rank: 5 of a mean 2
    assert _rank_skew(rows, 1) == 1.0
    assert _spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert _spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert _spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)  # ties share a rank


def test_the_planner_benchmarks_memory_skew_sums_a_ranks_layers():
    """The memory's skew: the busiest ep rank's rows summed over the layers (a pipeline rank's
    own, when given) over the mean of that sum, the largest over the steps; and a pipeline's
    predicted peak, each pipeline rank's at its own layers' skew, the largest of those."""
    import dataclasses

    from experiments.bench.plan import _memory_at_routing, _moe_layers_by_rank, _rank_rows_skew
    from experiments.plan import _model_config, compose
    from moe.costs import model_costs

    rows = [
        # ep2: layer 0 sends 6 of 8 rows to rank 0, layer 1 2 of 8: 8 and 8 in all
        {"expert_load": [[4, 2, 1, 1], [1, 1, 3, 3]]},
        {"expert_load": [[2, 2, 2, 2], [3, 3, 1, 1]]},  # 4 + 6 and 4 + 2: 10 and 6
        {"tokens_per_s": 1.0},
    ]
    assert _rank_rows_skew(rows, 2) == pytest.approx(10 / 8)
    assert _rank_rows_skew(rows[:1], 2) == 1.0  # a layer's skew another layer evens out
    assert _rank_rows_skew(rows[:1], 2, [[0], [1]]) == pytest.approx(6 / 4)
    assert _rank_rows_skew(rows, 1) == 1.0
    # a pipeline of two ranks: rank 0 holds MoE layer 0, rank 1 layers 1-3 (model=small's cut)
    cfg = _model_config(compose(["model=small"]))
    costs = model_costs(cfg, 128, experts="fused")
    prof = zplan.load_profile("cpu_2core")
    rec = zplan.LayoutRecord(
        world=4, batch_size=16, pp=2, ep=2, pp_schedule="dualpipev", pp_virtual_stages=2, pp_microbatches=4
    )
    assert _moe_layers_by_rank(rec, costs) == [[0], [1, 2, 3]]
    assert _moe_layers_by_rank(dataclasses.replace(rec, pp=1, pp_schedule=None), costs) is None
    steps = [{"expert_load": [[9, 1, 1, 1, 1, 1, 1, 1], *[[1, 1, 1, 1, 1, 1, 1, 1]] * 3]}]
    skew, p = _memory_at_routing(rec, costs, prof, steps)
    own = [zplan.predict(rec, costs, prof, skew=s) for s in (12 / 8, 1.0)]  # rank 0's layer, rank 1's
    want = max(sum(q.memory_parts_by_pp_rank[r].values()) for r, q in enumerate(own))
    assert p.memory_bytes == pytest.approx(want) and sum(p.memory_parts.values()) == pytest.approx(want)
    assert want < zplan.predict(rec, costs, prof, skew=12 / 8).memory_bytes  # rank 1 at rank 0's skew
    assert skew == (1.0 if want == sum(own[1].memory_parts_by_pp_rank[1].values()) else 12 / 8)


def test_the_planner_benchmarks_profile_drift_is_rate_by_rate():
    """``--calibrate``'s report of how far a fresh calibration lies from the shipped profile: the
    median over the product shapes of the rate ratios, and the bandwidth's, an operator's and a
    256 KiB All-to-All's ratios (1 everywhere against itself)."""
    import dataclasses

    from experiments.bench.plan import profile_drift

    shipped = zplan.load_profile("cpu_2core")
    assert profile_drift(shipped, shipped) == pytest.approx(
        dict(matmul_rate=1.0, memory_bandwidth=1.0, op_overhead=1.0, all_to_all_256k=1.0)
    )
    scale = lambda i: 3.0 if i == 0 else 0.5  # noqa: E731
    rows = {d: [[*r[:-1], r[-1] * scale(i)] for i, r in enumerate(v)] for d, v in shipped.matmul_flops.items()}
    slower = dataclasses.replace(
        shipped,
        matmul_flops=rows,
        memory_bandwidth=shipped.memory_bandwidth / 2,
        op_overhead_s=shipped.op_overhead_s * 3,
        collectives={
            t: {op: dataclasses.replace(ab, alpha=ab.alpha * 2, beta=ab.beta / 2) for op, ab in ops.items()}
            for t, ops in shipped.collectives.items()
        },
    )
    d = profile_drift(slower, shipped)
    # one shape 3x faster, every other at half: the median is a half
    assert d["matmul_rate"] == pytest.approx(0.5) and d["memory_bandwidth"] == pytest.approx(0.5)
    assert d["op_overhead"] == pytest.approx(3.0) and d["all_to_all_256k"] == pytest.approx(2.0)


def test_a_collective_between_computing_ranks_is_timed_by_its_typical_batch():
    """Between computing ranks a call now and then waits for its peer's thread: the median batch
    (as the compute rates beside it are medians) takes those waits in; on idle cores the least
    batch is the floor. Each less the same kind of batch without the calls; p2p counts half."""
    from experiments.calibrate import per_call_time

    with_calls = [0.030, 0.021, 0.020, 0.050, 0.024]  # one batch slowed by a scheduling wait
    without = [0.010, 0.011, 0.012, 0.010, 0.018]
    assert per_call_time(with_calls, without, 10, "all_to_all", typical=True) == pytest.approx((0.024 - 0.011) / 10)
    assert per_call_time(with_calls, without, 10, "all_to_all", typical=False) == pytest.approx((0.020 - 0.010) / 10)
    assert per_call_time(with_calls, without, 10, "p2p", typical=False) == pytest.approx((0.020 - 0.010) / 20)


def test_the_planner_benchmarks_layout_row_is_the_median_run():
    """A layout's runs as one row: the median of the runs' measured steps and of their own
    predictions, so one run slowed by the machine's other work does not move it."""
    from experiments.bench.plan import layout_row

    rec = zplan.LayoutRecord(world=2, batch_size=16)
    runs = [
        dict(
            predicted_s=p,
            predicted_s_shipped=p + 0.01,
            predicted_s_at_speed=p * 1.1,
            measured_s=m,
            predicted_model_states=5.0,
            measured_model_states=5.0 + i,
            predicted_peak=9.0,
            measured_peak=8.0 + i,
        )
        for i, (p, m) in enumerate([(0.15, 0.15), (0.14, 0.40), (0.16, 0.16)])
    ]
    row = layout_row(rec, runs)
    assert row["measured_s"] == pytest.approx(0.16) and row["predicted_s"] == pytest.approx(0.15)
    assert row["predicted_s_shipped"] == pytest.approx(0.16)
    assert row["predicted_s_at_speed"] == pytest.approx(0.165)
    assert row["measured_peak"] == 10.0 and row["measured_model_states"] == 7.0  # the largest
    assert row["layout"] == rec.label() and row["runs"] is runs


def test_the_speed_probes_factor_is_the_time_now_over_the_reference():
    from experiments.bench.plan import SpeedProbe

    probe = SpeedProbe.__new__(SpeedProbe)  # no processes: the times planted
    probe.ref, times = None, iter([0.10, 0.13, 0.05])
    probe.__class__ = type("Planted", (SpeedProbe,), {"__call__": lambda self: next(times)})
    with pytest.raises(RuntimeError, match="before reference"):
        probe.factor()
    assert probe.reference() == 0.10
    assert probe.factor() == pytest.approx(1.3) and probe.factor() == pytest.approx(0.5)


@pytest.mark.distributed  # starts the probe's processes
def test_the_speed_probe_times_its_work_on_every_worker_at_once():
    from experiments.bench.plan import SpeedProbe

    small, large = SpeedProbe(workers=2, batch=1, seq=16, steps=3), SpeedProbe(workers=2, batch=8, seq=128, steps=3)
    try:
        # 8 x 128 tokens through model=small take longer than 16 (2.7x here: the operators' own
        # costs weigh on so few tokens)
        assert 0 < 1.5 * small() < large()
    finally:
        small.close(), large.close()
    assert all(not proc.is_alive() for proc in small.procs + large.procs)


def test_the_planner_benchmarks_one_rank_shapes_start_from_the_trainers_model_small():
    # --part r reports its first shapes as model=small: the config it builds must be the one the
    # trainer composes for model=small at the benchmark's sequence length, and each other shape
    # must differ from it
    from experiments.bench.plan import BASE, ONE_RANK, _one_rank_config
    from experiments.plan import _model_config, compose

    small = _model_config(compose(BASE))
    assert _one_rank_config({}) == small
    assert all(label == "model=small" for label, fields, _, _ in ONE_RANK if not fields)
    assert all(_one_rank_config(fields) != small for _, fields, _, _ in ONE_RANK if fields)


def test_the_hand_over_extra_is_over_the_slower_ranks_compute_in_each_round():
    """``--part h``'s arithmetic by hand: rank 1 computes slower in rounds 1 and 3, rank 0 in round
    2; a chain and both ways pace at the slower rank, the chain's time holding one fill; the
    median over rounds of each round's extra over its slower rank's compute alone."""
    from experiments.bench.plan import hand_extras

    items = 20
    fill = (items + 1) / items
    r0 = [(6.0, 8.5 * fill, 10.0), (9.0, 10.0 * fill, 12.0), (6.0, 8.0 * fill, 9.0)]
    r1 = [(8.0, 9.0 * fill, 10.5), (7.0, 10.5 * fill, 11.0), (7.5, 9.0 * fill, 9.5)]
    alone, by_rank, extra = hand_extras([r0, r1], items)
    # slower rank per round: alone 8, 9, 7.5; chain 9, 10.5, 9; both 10.5, 12, 9.5
    assert alone == pytest.approx(8.0)
    assert by_rank == pytest.approx([6.0, 7.5])
    assert extra["chain"] == pytest.approx(1.5)  # 1.0, 1.5, 1.5
    assert extra["both"] == pytest.approx(2.5)  # 2.5, 3.0, 2.0
