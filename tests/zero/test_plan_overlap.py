"""The planner's ``parallel.pp_overlap`` (DualPipeV's overlapped forward-backward pairs run at once):
the listing (dualpipev both ways, nothing else with it), ``layout_problem``'s messages against the
trainer's own, the key through overrides, Hydra, preflight and ``parallel=auto``, the pair's time
by hand on a planted order, and what the overlap changes in a prediction: on a GPU profile at most
the step's All-to-All, on a CPU whose cores all compute nothing, without exchanges nothing. (That
the planner lists exactly the layouts the trainer accepts, pp_overlap among the keys, is
test_plan.py's check.)"""

from __future__ import annotations

import dataclasses

import pytest

import zero.plan as zplan
from experiments.plan import costs_of, fixed_keys
from experiments.training.build import build_plan
from experiments.training.preflight import predict_config, profile_of, record_of, resolve_auto
from experiments.training.schema import model_config
from moe import MoEConfig
from moe.costs import model_costs
from moe.model import TransformerConfig
from tests.support.training import cfg_of
from zero.pipeline import plan_pipeline
from zero.plan.schedule import rank_orders, simulate, simulate_plan
from zero.plan.terms import _Costing

pytestmark = pytest.mark.usefixtures("one_thread")

# 2 blocks: 4 pipeline layers, dualpipev's 4 stages on pp=2
MODEL = ["model=tiny", "logger=none", "model.n_layers=2", "moe.num_experts=4", "train.batch_size=8", "train.seq_len=8"]
DUALPIPEV = ["parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.pp_virtual_stages=2"]


@pytest.fixture(scope="module")
def costs():
    return model_costs(model_config(cfg_of(*MODEL)), 8)


def _moe_costs(d_model: int = 1024, experts: int | None = 8):
    """A model whose All-to-All matters on a GPU profile (6 blocks: 8 pipeline layers); ``experts``
    None: dense."""
    moe = MoEConfig(d_model=d_model, d_ff=2 * d_model, num_experts=experts, top_k=2) if experts else None
    cfg = TransformerConfig(
        vocab_size=1024,
        d_model=d_model,
        n_layers=6,
        n_heads=8,
        d_ff=2 * d_model,
        max_seq_len=1024,
        moe=moe,
        moe_every=1 if experts else 0,
    )
    return model_costs(cfg, 1024, act_dtype="bf16")


def _dualpipev(world: int, ep: int, **kw) -> zplan.LayoutRecord:
    return zplan.LayoutRecord(
        world=world,
        batch_size=8 * world,
        pp=2,
        ep=ep,
        pp_schedule="dualpipev",
        pp_virtual_stages=2,
        pp_microbatches=8,
        mixed_precision="bf16",
        **kw,
    )


# ----- the listing, the messages and the key ------------------------------------------------------------


@pytest.mark.parametrize("world,node_size", [(2, None), (4, None), (4, 1)])
def test_every_dualpipev_layout_is_listed_both_ways_and_nothing_else_with_overlap(costs, world, node_size):
    recs = zplan.enumerate(costs, world=world, batch_size=8, node_size=node_size)
    on = [r for r in recs if r.pp_overlap]
    off = [r for r in recs if not r.pp_overlap]
    assert on, "no layout with the overlap"
    assert {r.pp_schedule for r in on} == {"dualpipev"}
    assert {dataclasses.replace(r, pp_overlap=False) for r in on} == {r for r in off if r.pp_schedule == "dualpipev"}
    assert len(recs) == len(set(recs))
    # holding the key lists one side each, in the listing's order
    assert zplan.enumerate(costs, world=world, batch_size=8, node_size=node_size, fixed={"pp_overlap": True}) == on
    assert zplan.enumerate(costs, world=world, batch_size=8, node_size=node_size, fixed={"pp_overlap": False}) == off
    held = zplan.enumerate(costs, world=world, batch_size=8, fixed={"pp_overlap": True, "pp_schedule": "1f1b"})
    assert held == []
    if node_size is not None:  # the node dispatch too
        assert {r.ep_dispatch for r in on} == {"flat", "node"}


def test_layout_problem_gives_the_trainers_messages(costs):
    L, E = costs.num_layers, costs.num_experts

    def trainer(*overrides):
        with pytest.raises(ValueError) as e:
            build_plan(cfg_of(*MODEL, *overrides))
        return str(e.value)

    rec = _dualpipev(2, 1, pp_overlap=True)
    rec = dataclasses.replace(rec, batch_size=8, pp_microbatches=4, mixed_precision="fp32")
    assert zplan.layout_problem(rec, L, E) is None
    # without a pipeline
    one = zplan.LayoutRecord(world=2, batch_size=8, pp_overlap=True)
    assert zplan.layout_problem(one, L, E) == trainer("parallel.pp=1", "parallel.pp_overlap=true")
    assert "parallel.pp=1" in zplan.layout_problem(one, L, E)
    # under a schedule without overlapped pairs, named
    for sched, v in (("1f1b", 1), ("zbv", 2), ("interleaved_1f1b", 2)):
        other = dataclasses.replace(rec, pp_schedule=sched, pp_virtual_stages=v)
        assert zplan.layout_problem(dataclasses.replace(other, pp_overlap=False), L, E) is None
        want = trainer(
            "parallel.pp=2",
            f"parallel.pp_schedule={sched}",
            f"parallel.pp_virtual_stages={v}",
            "parallel.pp_microbatches=4",
            "parallel.pp_overlap=true",
        )
        assert zplan.layout_problem(other, L, E) == want and f"pp_schedule={sched}" in want
    # not a bool, named, with and without a pipeline
    for bad in ("yes", 1):
        for r in (rec, one):
            problem = zplan.layout_problem(dataclasses.replace(r, pp_overlap=bad), L, E)
            assert problem == f"parallel.pp_overlap={bad!r} is invalid: expected true or false"


def test_the_key_is_set_only_when_on_and_reads_back(costs):
    off = dataclasses.replace(_dualpipev(2, 1), batch_size=8, pp_microbatches=4, mixed_precision="fp32")
    on = dataclasses.replace(off, pp_overlap=True)
    assert not any("pp_overlap" in o for o in off.overrides()) and "overlap" not in off.label()
    # after the pipeline's keys (pp, ep, zero_stage, zero_offload, pp_schedule, pp_virtual_stages, pp_microbatches)
    assert on.overrides() == [*off.overrides()[:7], "parallel.pp_overlap=true", *off.overrides()[7:]]
    assert on.label() == off.label().replace("dualpipevx2 m4", "dualpipevx2 m4 overlap")
    assert zplan.LayoutRecord(**on.to_dict()) == on
    assert fixed_keys(on.overrides())["pp_overlap"] is True
    assert fixed_keys(["parallel.pp_overlap=false"]) == {"pp_overlap": False}
    assert on.plan(costs.num_layers).overlap and not off.plan(costs.num_layers).overlap
    # through Hydra into the trainer's config and back through preflight's record
    for rec in (off, on):
        cfg = cfg_of(*MODEL, *rec.overrides())
        assert cfg.parallel.pp_overlap == rec.pp_overlap and build_plan(cfg).overlap == rec.pp_overlap
        assert record_of(cfg, 2) == dataclasses.replace(rec, zero_quant_block=int(cfg.parallel.zero_quant_block))


def test_preflight_predicts_the_overlap_and_leaves_what_the_trainer_refuses_to_it():
    import torch

    cpu = torch.device("cpu")
    on = cfg_of(*MODEL, *DUALPIPEV, "parallel.pp_overlap=true")
    rec, _ = predict_config(on, 2, cpu)
    assert rec.pp_overlap and rec.pp_schedule == "dualpipev"
    # pp=1 with the overlap: the trainer's build_plan names it, the planner does not judge it
    assert predict_config(cfg_of(*MODEL, "parallel.pp_overlap=true"), 2, cpu) is None


def test_auto_picks_the_overlap_where_it_is_faster():
    """On a GPU profile a dualpipev layout with ep > 1 is faster with the overlap than without (its
    twin, listed beside it): holding dualpipev and ep=2, parallel=auto runs an overlapped one and
    sets the key; on the CPU (every core computing) the two tie and the listing's order keeps the
    overlap off."""
    import torch

    cfg = cfg_of(*MODEL, "parallel=auto", "train.plan_cluster=h800_node")
    rec, p, n = resolve_auto(cfg, 4, {"pp": 2, "pp_schedule": "dualpipev", "ep": 2})
    assert rec.pp_overlap and n > 0
    assert cfg.parallel.pp_overlap is True and build_plan(cfg).overlap
    profile = profile_of(cfg, torch.device("cpu"))
    twin = zplan.predict(dataclasses.replace(rec, pp_overlap=False), costs_of(cfg, profile), profile)
    assert p.step_s < twin.step_s
    cpu = cfg_of(*MODEL, "parallel=auto")
    rec, _, _ = resolve_auto(cpu, 4, {"pp": 2, "pp_schedule": "dualpipev", "ep": 2})
    assert rec.pp_schedule == "dualpipev"
    assert not rec.pp_overlap and cpu.parallel.pp_overlap is False


# ----- the pair's time by hand --------------------------------------------------------------------------

# two ranks, stage 0 on rank 0 and stage 1 on rank 1, three micro-batches; rank 0 pairs the forward
# of micro-batch 2 with the backward of micro-batch 0 (DualPipeV's OVERLAP_F_B)
ORDERS = (
    ((("F", 0, 0),), (("F", 0, 1),), (("F", 0, 2), ("B", 0, 0)), (("B", 0, 1),), (("B", 0, 2),)),
    ((("F", 1, 0),), (("B", 1, 0),), (("F", 1, 1),), (("B", 1, 1),), (("F", 1, 2),), (("B", 1, 2),)),
)


@pytest.mark.parametrize(
    "f0,mf,b0,mb,plain,overlapped",
    [
        # the compute binds: cF + cB = 2 + 2.5 hides all of mF + mB = 2.5. One after the other:
        # rank 0 F 0-3, 3-6; the pair waits for B(1,0) (rank 1: F 3-4, B 4-5), runs 6-9 and 9-13;
        # B(0,1) 13-17 (rank 1's B(1,1) ended at 8); rank 1 F(1,2) 9-10, B 10-11; B(0,2) 17-21.
        # At once: the pair 6-10.5, its forward ending at 9 as alone; B(0,1) 10.5-14.5, B(0,2) -18.5
        (3.0, 1.0, 4.0, 1.5, (21.0, 11.0), (18.5, 11.0)),
        # the exchanges bind: mF + mB = 5.5 hides all of cF + cB = 1.5: the pair 6-11.5; B(0,1)
        # 11.5-15.5, B(0,2) -19.5
        (3.0, 2.5, 4.0, 3.0, (21.0, 11.0), (19.5, 11.0)),
        # the backward alone binds: dB = 4 over cF + cB = 2.5 and mF + mB = 3.5. One after the other
        # rank 0 F 0-2, 2-4; rank 1 F 2-3, B 3-4, F 4-5, B 5-6; the pair 4-6, 6-10; B(0,1) 10-14;
        # rank 1 F(1,2) 6-7, B 7-8; B(0,2) 14-18. At once: the pair 4-8 (its forward ending at 6),
        # B(0,1) 8-12, B(0,2) 12-16
        (2.0, 1.5, 4.0, 2.0, (18.0, 8.0), (16.0, 8.0)),
    ],
)
def test_an_overlapped_pair_by_hand(f0, mf, b0, mb, plain, overlapped):
    dur = {"F": [f0, 1.0], "B": [b0, 1.0]}
    comm = {"F": [mf, 0.0], "B": [mb, 0.0]}
    seq = simulate(ORDERS, [0, 1], dur)
    at_once = simulate(ORDERS, [0, 1], dur, comm=comm)
    assert seq.finish == pytest.approx(plain, abs=1e-12)
    assert at_once.finish == pytest.approx(overlapped, abs=1e-12)
    assert at_once.makespan == pytest.approx(overlapped[0], abs=1e-12)
    # the pair's time is busy time once; the lone passes as before
    span = max(f0 - mf + b0 - mb, mf + mb, f0, b0)
    assert at_once.busy == pytest.approx((3 * f0 + 3 * b0 - (f0 + b0 - span), 6.0), abs=1e-12)
    # no exchanges: exactly one after the other
    assert simulate(ORDERS, [0, 1], dur, comm={"F": [0.0, 0.0], "B": [0.0, 0.0]}) == seq


def test_the_memoised_simulation_tells_the_overlap_apart():
    plan = plan_pipeline(8, pp=2, pp_schedule="dualpipev", pp_microbatches=8, pp_virtual_stages=2, pp_overlap=True)
    stage_rank = [plan.rank_of(s) for s in range(4)]
    dur = {"F": [1.0, 2.0, 2.0, 1.5], "I": [0.0, 2.0, 2.0, 1.5], "W": [2.0, 2.0, 2.0, 1.5]}
    dur["B"] = [a + b for a, b in zip(dur["I"], dur["W"])]
    latency = [0.1, 0.0, 0.1, 0.0]
    comm = {"F": [0.5, 1.0, 1.0, 0.5], "B": [0.5, 1.5, 1.5, 1.0]}
    args = (rank_orders(plan), stage_rank, dur, latency)
    plain, at_once = simulate(*args), simulate(*args, comm=comm)
    assert at_once.makespan < plain.makespan
    assert simulate_plan(plan, stage_rank, dur, latency) == plain
    assert simulate_plan(plan, stage_rank, dur, latency, comm=comm) == at_once
    less = {"F": [0.0] * 4, "B": [0.1] * 4}
    assert simulate_plan(plan, stage_rank, dur, latency, comm=less) == simulate(*args, comm=less) != at_once


# ----- what it changes in a prediction ------------------------------------------------------------------


@pytest.mark.parametrize("profile", ["h800_node", "h100_node"])
@pytest.mark.parametrize("stage,ckpt", [(0, False), (1, True), (3, False)])
def test_on_a_gpu_the_overlap_hides_at_most_the_steps_all_to_all(profile, stage, ckpt):
    costs, prof = _moe_costs(), zplan.load_profile(profile)
    off = _dualpipev(16, 8, zero_stage=stage, checkpoint_activations=ckpt)
    on = dataclasses.replace(off, pp_overlap=True)
    assert zplan.layout_problem(on, costs.num_layers, costs.num_experts) is None
    assert _Costing(on, costs, prof, None).overlap
    p, q = zplan.predict(off, costs, prof), zplan.predict(on, costs, prof)
    hidden = p.step_s - q.step_s
    assert q.time_parts["moe_comm"] == p.time_parts["moe_comm"] > 0
    assert 0 < hidden <= p.time_parts["moe_comm"]
    # a sizeable part of it: the pairs are most of DualPipeV's steady state
    assert hidden > 0.25 * p.time_parts["moe_comm"]
    # the memory is the walk's, the same either way
    assert q.memory_bytes == p.memory_bytes and q.memory_parts == p.memory_parts


def test_on_a_cpu_whose_cores_all_compute_the_overlap_changes_nothing():
    costs, prof = _moe_costs(256), zplan.load_profile("cpu_2core")
    off = _dualpipev(4, 2)
    on = dataclasses.replace(off, pp_overlap=True)
    assert not _Costing(on, costs, prof, None).overlap
    p, q = zplan.predict(off, costs, prof), zplan.predict(on, costs, prof)
    assert p.time_parts["moe_comm"] > 0
    assert q.step_s == p.step_s and q == p


@pytest.mark.parametrize("experts,world", [(8, 2), (None, 4)], ids=["moe-dp1", "dense-dp2"])
def test_without_exchanges_the_overlap_changes_nothing(experts, world):
    """ep=1 and dp=1 (no All-to-All, no statistics all-reduce), or a dense model: nothing to hide."""
    costs, prof = _moe_costs(experts=experts), zplan.load_profile("h800_node")
    off = _dualpipev(world, 1)
    on = dataclasses.replace(off, pp_overlap=True)
    p, q = zplan.predict(off, costs, prof), zplan.predict(on, costs, prof)
    assert p.time_parts["moe_comm"] == 0.0
    assert q.step_s == p.step_s and q == p
