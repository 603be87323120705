"""The planner's ZeRO++ (hpZ, qwZ, qgZ): its listing against a naive reference of the engine's rules,
the keys through Hydra and preflight, the two-level collective time, what each option changes in the
predicted time and memory, the CLI, and the predicted bytes per link tier against the engine's own
counters on 4 gloo ranks as 2 nodes, exactly."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

import zero.plan as zplan
from experiments.training.preflight import record_of
from experiments.training.schema import model_config
from moe.costs import model_costs
from tests.support.training import SHORT, cfg_of, metrics_rows
from zero.comm import Tiers
from zero.plan.terms import _Costing

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = ["model=tiny", "logger=none", "model.n_layers=2", "moe.num_experts=4", "train.batch_size=8", "train.seq_len=8"]


@pytest.fixture(scope="module")
def costs():
    return model_costs(model_config(cfg_of(*MODEL)), 8)


def _regular(ranks, node_size) -> bool:
    return Tiers(tuple(ranks), ranks[0], node_size).split is not None


@pytest.mark.parametrize("world,node_size", [(4, 2), (8, 4), (8, 3), (4, 1)])
def test_zeropp_lists_every_valid_combination_once(costs, world, node_size):
    plain = zplan.enumerate(costs, world=world, batch_size=8, node_size=node_size)  # node dispatch too
    got = zplan.enumerate(costs, world=world, batch_size=8, zeropp=True, node_size=node_size)
    # the reference: the engine's rules written out (zero.zeropp.check_options): hpZ and qwZ at
    # stage 3, qgZ at 1-3, hpZ and qgZ only where every dp and edp group sits evenly on its nodes
    want = []
    for r in plain:
        even = _regular(range(r.dp), node_size) and _regular(range(0, r.dp, r.ep), node_size)
        for hpz, qwz, qgz in itertools.product([False, True], repeat=3):
            if (hpz or qwz) and r.zero_stage != 3 or qgz and r.zero_stage == 0 or (hpz or qgz) and not even:
                continue
            want.append(dataclasses.replace(r, zero_hpz=hpz, zero_qwz=qwz, zero_qgz=qgz))
    assert len(got) == len(set(got)) and set(got) == set(want)
    assert any(r.zero_hpz for r in got) and any(r.zero_qgz and r.zero_stage == 1 for r in got)
    assert [r for r in got if not r.zeropp] == plain  # off, the listing is unchanged, in its order


def test_zeropp_needs_the_node_size(costs):
    with pytest.raises(ValueError, match=r"zeropp=True needs node_size.*got None"):
        zplan.enumerate(costs, world=4, batch_size=8, zeropp=True)


def test_the_keys_compose_and_preflight_reads_them_back(costs):
    recs = zplan.enumerate(costs, world=4, batch_size=8, zeropp=True, node_size=2)
    for rec in [r for r in recs if r.zeropp and r.pp == 1][::17][:6]:
        rec = dataclasses.replace(rec, zero_qgz_bits=8 if rec.zero_qgz else 4)
        cfg = cfg_of(*MODEL, *rec.overrides())
        assert record_of(cfg, 4) == rec, rec.label()
    assert "parallel.zero_hpz" not in " ".join(zplan.LayoutRecord(world=4, batch_size=8).overrides())


def test_a_group_on_several_nodes_is_timed_as_the_two_level_algorithm(costs):
    prof = zplan.load_profile("h100_node")  # 8 a node
    cst = _Costing(zplan.LayoutRecord(world=32, batch_size=32), costs, prof, None)
    intra, inter = prof.link("intra", "all_gather"), prof.link("inter", "all_gather")
    N = 64e6
    # 16 ranks as 2 nodes of 8: (n - 1) N / W across at the inter link, (k - 1) N / k inside
    want = (inter.alpha + N / 16 / inter.beta) + (7 * intra.alpha + 7 / 8 * N / intra.beta)
    assert cst.coll("all_gather", N, list(range(16))) == pytest.approx(want, rel=1e-12)
    assert cst.coll("all_reduce", N, list(range(16))) == pytest.approx(2 * want, rel=1e-12)
    # one member a node: every step crosses (the ring at the inter link), as before
    assert cst.coll("all_gather", N, [0, 8, 16, 24]) == pytest.approx(inter.time("all_gather", N, 4), rel=1e-12)
    assert cst.coll("all_gather", N, list(range(8))) == pytest.approx(intra.time("all_gather", N, 8), rel=1e-12)


def _pred(costs, profile, batch_size=16, **kw):
    rec = zplan.LayoutRecord(world=16, batch_size=batch_size, zero_stage=3, mixed_precision="bf16", **kw)
    return rec, zplan.predict(rec, costs, profile)


def test_what_each_option_changes_in_the_prediction(costs):
    prof = dataclasses.replace(zplan.load_profile("h100_node"), node_size=8)
    _, base = _pred(costs, prof)
    rec, hpz = _pred(costs, prof, zero_hpz=True)
    _, qwz = _pred(costs, prof, zero_qwz=True)
    _, qgz = _pred(costs, prof, zero_qgz=True)
    # hpZ: the backward's gathers stay inside the node: less gather time, a 1/8 slice of every
    # block's weights more (its dense weights over the 8 dp ranks of its node; ep=1: experts too)
    assert hpz.time_parts["gathers"] < base.time_parts["gathers"] and hpz.step_s <= base.step_s
    # (this model's compute hides most of its gathers; with accumulation, whose earlier backwards do
    # not end in the reduction the last one's gathers hide behind, and links across nodes 1000x
    # slower, what hpZ saves shows in the step)
    ab = zplan.AlphaBeta
    slow = {
        t: {op: ab(c.alpha, c.beta / (1000 if t == "inter" else 1)) for op, c in v.items()}
        for t, v in prof.collectives.items()
    }
    slow = dataclasses.replace(prof, collectives=slow)
    assert (
        _pred(costs, slow, 64, zero_hpz=True, grad_accum=4)[1].step_s < _pred(costs, slow, 64, grad_accum=4)[1].step_s
    )
    slices = sum(b.params_dense + b.params_expert for b in costs.blocks if b.shares_params_with is None) * 2 / 8
    assert hpz.memory_parts["gathered_params"] - base.memory_parts["gathered_params"] == pytest.approx(slices)
    assert hpz.comm_bytes["inter"] < base.comm_bytes["inter"] and hpz.comm_bytes["intra"] == base.comm_bytes["intra"]
    # qwZ: int8 and the scales on the forward's wire (and the backward's, without hpZ)
    assert qwz.time_parts["gathers"] < base.time_parts["gathers"]
    # (bf16: the two gathers halved, the reduce-scatter not: 2/3 of the bytes, and the scales)
    assert qwz.comm_bytes["inter"] == pytest.approx(2 / 3 * base.comm_bytes["inter"], rel=0.02)
    # qgZ: int4 gradients: less reduction time and fewer bytes across nodes
    assert qgz.time_parts["reduction"] < base.time_parts["reduction"]
    assert qgz.comm_bytes["inter"] < base.comm_bytes["inter"]
    # on one node there is nothing to keep inside it: hpZ costs memory and saves no time
    one = dataclasses.replace(prof, node_size=16)
    _, b1 = _pred(costs, one)
    _, h1 = _pred(costs, one, zero_hpz=True)
    assert h1.step_s == pytest.approx(b1.step_s) and h1.memory_bytes > b1.memory_bytes
    assert h1.comm_bytes == b1.comm_bytes


def test_the_cli_searches_zeropp_when_asked(capsys):
    from experiments import plan as cli

    args = [*MODEL, "plan.world=4", "plan.cluster=cpu_2core", "plan.top=400"]
    assert cli.main([*args, "plan.zeropp=true"]) in (0, 2)
    assert "hpZ" in capsys.readouterr().out
    assert cli.main(args) in (0, 2)
    out = capsys.readouterr().out
    assert "hpZ" not in out and "qgZ" not in out
    # holding a ZeRO++ key searches them: every row has it
    cfg = cfg_of(*MODEL)
    _, ranked = cli.plan_layouts(cfg, 4, zplan.load_profile("cpu_2core"), {"zero_hpz": True})
    assert ranked and all(r.zero_hpz and r.zero_stage == 3 for r, _ in ranked)


# --- the bytes against the engine's counters -----------------------------------------------------

BYTES_BASE = [*SHORT, "train.steps=2", "train.log_every=1", "train.eval_every=2", "parallel.node_size=2"]
BYTES_CASES = {
    "stage 3": ["parallel.zero_stage=3"],
    "hpZ": ["parallel.zero_stage=3", "parallel.zero_hpz=true"],
    "qwZ": ["parallel.zero_stage=3", "parallel.zero_qwz=true"],
    "all three, accumulating": [
        "parallel.zero_stage=3",
        "parallel.zero_hpz=true",
        "parallel.zero_qwz=true",
        "parallel.zero_qgz=true",
        "train.grad_accum=2",
    ],
    "qgZ int8 at stage 1": ["parallel.zero_stage=1", "parallel.zero_qgz=true", "parallel.zero_qgz_bits=8"],
    "stage 0": ["parallel.zero_stage=0"],
    "qgZ with ep2": ["parallel.zero_stage=3", "parallel.ep=2", "parallel.zero_qgz=true"],
    "hpZ under pp2": ["parallel.zero_stage=3", "parallel.zero_hpz=true", "parallel.pp=2", "model.n_layers=4"],
}


@pytest.mark.distributed
def test_the_predicted_bytes_are_the_engines_counters(tmp_path):
    # the trainer on 4 gloo ranks as 2 nodes of 2 (parallel.node_size): every row's
    # comm_bytes_intra / comm_bytes_inter, from zero.comm's counters, equal zero.plan.comm_bytes of
    # the same config's layout, exactly (both are integers of the same byte model; the planner
    # pads each layer's flat as zero.flat pads it)
    from tests.experiments.test_train_zero import _train_ranks
    from tests.support.dist import run_distributed

    runs = [([*BYTES_BASE, *o], tmp_path / str(i)) for i, o in enumerate(BYTES_CASES.values())]
    run_distributed(_train_ranks, 4, runs, timeout=900)
    for (name, o), (_, run_dir) in zip(BYTES_CASES.items(), runs):
        cfg = cfg_of(*BYTES_BASE, *o)
        want = zplan.comm_bytes(record_of(cfg, 4), model_costs(model_config(cfg), int(cfg.train.seq_len)), 2)
        rows = metrics_rows(run_dir)
        assert rows
        for row in rows:
            assert (row["comm_bytes_intra"], row["comm_bytes_inter"]) == (want["intra"], want["inter"]), name
