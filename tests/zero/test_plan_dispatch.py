"""The planner's node-limited MoE dispatch (``parallel.ep_dispatch=node``): the expected nodes a
token crosses to against a naive count over every routing, the exchanges' time and buffers by hand
from a made-up profile's α and β, the keys through overrides, Hydra and preflight, and
``layout_problem``'s messages against the trainer's own. (That the planner lists exactly the node
layouts the trainer accepts is in test_plan.py, beside the flat listing's check.)"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

import zero.plan as zplan
from experiments.plan import fixed_keys
from experiments.training.preflight import record_of
from experiments.training.schema import model_config
from moe import MoEConfig
from moe.costs import model_costs
from moe.model import TransformerConfig
from tests.support.training import cfg_of
from zero import validate_ep_dispatch
from zero.plan.profile import COLLECTIVES, AlphaBeta, Profile
from zero.plan.terms import _Costing, expected_nodes

pytestmark = pytest.mark.usefixtures("one_thread")


# ----- the expected nodes a token needs --------------------------------------------------------------


def _naive_nodes(E: int, K: int, N: int, G: int | None, TG: int | None) -> float:
    """Every routing of one token counted: its TG groups (all choices alike, each group's node by
    position), or with no groups (or groups that straddle nodes) its K experts; the mean of the
    distinct nodes they sit on, capped at K."""
    if G is not None and G % N == 0:
        picks = list(itertools.combinations(range(G), TG))
        per_node = G // N
    else:
        picks = list(itertools.combinations(range(E), K))
        per_node = E // N
    mean = sum(len({x // per_node for x in pick}) for pick in picks) / len(picks)
    return min(float(K), mean)


@pytest.mark.parametrize(
    "E,K,N,G,TG",
    [
        (8, 2, 2, None, None),
        (12, 3, 3, None, None),
        (12, 5, 4, None, None),
        (16, 4, 2, 8, 3),  # four groups a node
        (12, 4, 4, 4, 2),  # a group a node
        (16, 4, 4, 8, 4),
        (12, 2, 2, 6, 3),  # 3 groups, 2 slots: the cap does not bind (1.9 nodes)
        (16, 2, 4, 8, 4),  # the cap binds: 4 groups on 3.1 nodes, but 2 slots
        (12, 3, 2, 3, 2),  # 3 groups on 2 nodes straddle them: the plain count
    ],
)
def test_expected_nodes_is_the_mean_over_every_routing(E, K, N, G, TG):
    assert expected_nodes(E, K, N, G, TG) == pytest.approx(_naive_nodes(E, K, N, G, TG), rel=1e-12)


def test_expected_nodes_of_deepseek_v3_and_the_ends():
    # 8 groups on 8 nodes (EP64 of 8 a node), 4 of them a token: 4 nodes, as its report says
    assert expected_nodes(256, 8, 8, 8, 4) == 4.0
    # no groups: 8 experts of 256 over 8 nodes spread to 5.3 (too many routings to count: sampled)
    rng = random.Random(0)
    sampled = [len({e // 32 for e in rng.sample(range(256), 8)}) for _ in range(20000)]
    assert expected_nodes(256, 8, 8) == pytest.approx(sum(sampled) / len(sampled), abs=0.03)
    assert expected_nodes(8, 3, 1) == 1.0  # one node
    assert expected_nodes(8, 1, 4) == pytest.approx(1.0)  # one slot: one node
    assert expected_nodes(8, 8, 4) == pytest.approx(4.0)  # every expert: every node


# ----- the time and buffers by hand --------------------------------------------------------------------


# a made-up profile: two tiers of different α and β, nothing else that moves
A_IN, B_IN, A_OUT, B_OUT = 3e-5, 2e9, 4e-4, 1e8


def _profile(node_size: int) -> Profile:
    return Profile(
        name="test",
        device="a test device",
        device_memory_bytes=1e12,
        node_size=node_size,
        matmul_flops={"fp32": [[64, 1e10]]},
        memory_bandwidth=1e10,
        collectives={
            "intra": {op: AlphaBeta(A_IN, B_IN) for op in COLLECTIVES},
            "inter": {op: AlphaBeta(A_OUT, B_OUT) for op in COLLECTIVES},
        },
        host_link_bandwidth=5e9,
        host_adam_params_per_s=1e8,
        op_overhead_s=1e-5,
    )


def _a2a(alpha: float, beta: float, n: int, nbytes: float) -> float:
    """One All-to-All over n ranks of one tier: the ring's n - 1 steps, (n - 1) / n of the bytes."""
    return (n - 1) * alpha + (n - 1) / n * nbytes / beta


def _costs(E=8, K=2, groups=None):
    G, TG = groups or (None, None)
    moe = MoEConfig(16, 32, E, K, num_groups=G, topk_groups=TG)
    cfg = TransformerConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_seq_len=8, moe=moe)
    costs = model_costs(cfg, 8)
    return costs, next(b for b in costs.blocks if b.is_moe)


@pytest.mark.parametrize("world,node_size,groups", [(4, 2, None), (8, 2, (4, 2)), (8, 4, None), (2, 1, None)], ids=str)
def test_the_node_exchanges_by_hand(world, node_size, groups):
    """Per micro-batch, T tokens a rank, K slots, d nodes a token: across nodes (one rank a node, N)
    the rows out and back (T d each), the slots' weights and ids with them (4K, 8K bytes a row;
    the weights' gradient back in the backward) and N counts; inside the node (L ranks) the flat
    exchange of a row per slot out and back at the busiest rank's skew, and its L X counts."""
    costs, b = _costs(groups=groups)
    ep = world
    N, L = ep // node_size, node_size
    rec = zplan.LayoutRecord(world=world, batch_size=4 * world, ep=ep, ep_dispatch="node")
    skew = 1.5
    c = _Costing(rec, costs, _profile(node_size), None, time_skew=skew)
    T, K, row, X = c.tokens, b.top_k, b.row_bytes, b.num_experts // ep
    d = expected_nodes(b.num_experts, K, N, *(groups or (None, None)))
    x = _a2a(A_OUT, B_OUT, N, T * d * row)
    w = _a2a(A_OUT, B_OUT, N, T * d * 4 * K)
    ids = _a2a(A_OUT, B_OUT, N, T * d * 8 * K)
    inside = _a2a(A_IN, B_IN, L, T * K * skew * row)
    counts = _a2a(A_OUT, B_OUT, N, 8 * N) + _a2a(A_IN, B_IN, L, 8 * L * X)
    got = c.node_comm(b)
    assert got["F"] == pytest.approx(2 * x + w + ids + 2 * inside + counts, rel=1e-12)
    assert got["I"] == pytest.approx(2 * x + w + 2 * inside, rel=1e-12)
    # the layer's whole synchronous communication: the routing statistics over dp, then these;
    # a recomputed forward runs these again, not the statistics (taken back from its forward)
    stats = c.coll("all_reduce", b.stats_bytes, c.groups.dp)
    assert stats > 0
    assert c.moe_comm(b) == pytest.approx({"F": stats + got["F"], "I": got["I"], "R": got["F"]}, rel=1e-12)
    # the flat one beside it: the slots' rows over the whole ep group, E counts
    flat = _Costing(dataclasses.replace(rec, ep_dispatch="flat"), costs, c.profile, None, time_skew=skew)
    a2a = flat.coll("all_to_all", T * K * skew * row, flat.groups.ep)
    assert flat.moe_comm(b)["I"] == pytest.approx(2 * a2a, rel=1e-12)
    # predict sums them per micro-batch, flat and node each its own (its terms cached apart)
    for r, cst in ((dataclasses.replace(rec, ep_dispatch="flat"), flat), (rec, c), (rec, c)):
        p = zplan.predict(r, costs, cst.profile, time_skew=skew)
        per_mb = sum(cst.moe_comm(bb)["F"] + cst.moe_comm(bb)["I"] for bb in costs.blocks)
        assert p.time_parts["moe_comm"] == pytest.approx(per_mb, rel=1e-12), r.label()


def test_node_dispatch_is_faster_where_the_links_across_nodes_are_slow():
    costs, _ = _costs(E=16, K=4, groups=(4, 2))  # a token's 4 slots on 2 of 4 nodes
    rec = zplan.LayoutRecord(world=8, batch_size=32, ep=8)
    flat = zplan.predict(rec, costs, _profile(2))
    node = zplan.predict(dataclasses.replace(rec, ep_dispatch="node"), costs, _profile(2))
    assert node.time_parts["moe_comm"] < flat.time_parts["moe_comm"] and node.step_s < flat.step_s


@pytest.mark.parametrize("skew", [None, 1.5, 100.0])
def test_the_buffers_are_the_larger_exchanges_by_hand(skew):
    """Across nodes T d rows sent and at worst N T received (skew: skew x T d, at most N T), each
    with 12 K bytes of ids and weights; inside the node the slots' rows as flat (2 x the worst
    rows) while the rows received across nodes are still held."""
    costs, b = _costs(E=8, K=2)
    rec = zplan.LayoutRecord(world=8, batch_size=32, ep=8, ep_dispatch="node")
    c = _Costing(rec, costs, _profile(2), skew)
    T, K, N = c.tokens, b.top_k, 4
    d = expected_nodes(8, K, N)
    got = N * T if skew is None else max(T * d, min(skew * T * d, N * T))
    inter = (T * d + got) * (b.row_bytes + 12 * K)
    slots = 2 * c.rows(b)[1] * b.row_bytes
    inside = got * (b.row_bytes + 12 * K) + slots
    assert c.a2a_bytes(b) == pytest.approx(max(inside, inter), rel=1e-12)
    flat = _Costing(dataclasses.replace(rec, ep_dispatch="flat"), costs, c.profile, skew)
    assert flat.a2a_bytes(b) == pytest.approx(slots, rel=1e-12)
    p = zplan.predict(rec, costs, c.profile, skew=skew)
    assert p.memory_parts["a2a_buffers"] == pytest.approx(max(inside, inter), rel=1e-12)


# ----- the keys, the record and the messages ----------------------------------------------------------

MODEL = ["model=tiny", "logger=none", "model.n_layers=2", "moe.num_experts=4", "train.batch_size=8", "train.seq_len=8"]


def test_the_key_is_set_only_for_node_and_reads_back():
    flat = zplan.LayoutRecord(world=8, batch_size=8, ep=4)
    node = dataclasses.replace(flat, ep_dispatch="node")
    assert not any("ep_dispatch" in o for o in flat.overrides()) and "epnode" not in flat.label()
    assert "parallel.ep_dispatch=node" in node.overrides() and "dp8 ep4 epnode" in node.label()
    assert [o for o in node.overrides() if "ep_dispatch" not in o] == flat.overrides()
    assert node.to_dict()["ep_dispatch"] == "node" and zplan.LayoutRecord(**node.to_dict()) == node
    assert fixed_keys(node.overrides())["ep_dispatch"] == "node"
    # through Hydra into the trainer's config and back through preflight's record
    for rec in (flat, node):
        cfg = cfg_of(*MODEL, *rec.overrides())
        assert cfg.parallel.ep_dispatch == rec.ep_dispatch
        assert record_of(cfg, 8) == dataclasses.replace(rec, zero_quant_block=int(cfg.parallel.zero_quant_block))


def test_layout_problem_gives_the_trainers_messages():
    costs = model_costs(model_config(cfg_of(*MODEL)), 8)
    L, E = costs.num_layers, costs.num_experts

    def trainer(dispatch, ep, node_size):
        with pytest.raises(ValueError) as e:
            validate_ep_dispatch(dispatch, ep, node_size, "parallel.ep_dispatch")
        return str(e.value)

    rec = zplan.LayoutRecord(world=8, batch_size=8, ep=4, ep_dispatch="node")
    assert zplan.layout_problem(rec, L, E, node_size=2) is None
    assert zplan.layout_problem(rec, L, E, node_size=4) == trainer("node", 4, 4)  # one node: nothing to cross
    assert zplan.layout_problem(rec, L, E, node_size=3) == trainer("node", 4, 3)  # not whole nodes
    assert "ep=4" in zplan.layout_problem(rec, L, E, node_size=4)
    bad = dataclasses.replace(rec, ep_dispatch="ring")
    assert zplan.layout_problem(bad, L, E, node_size=2) == trainer("ring", 4, 2)
    assert "'ring' is invalid" in zplan.layout_problem(bad, L, E, node_size=2)
    # without the node size node cannot be checked; flat needs none
    assert "needs the ranks per node" in zplan.layout_problem(rec, L, E)
    assert zplan.layout_problem(dataclasses.replace(rec, ep_dispatch="flat"), L, E) is None
    with pytest.raises(ValueError, match=r"ep_dispatch='node' needs node_size"):
        zplan.enumerate(costs, world=8, batch_size=8, fixed={"ep_dispatch": "node"})
    held = zplan.enumerate(costs, world=8, batch_size=8, fixed={"ep_dispatch": "node"}, node_size=2)
    assert held and {(r.ep_dispatch, r.ep) for r in held} == {("node", 4)}
    # a profile whose nodes the layout does not span whole is named, not predicted
    with pytest.raises(ValueError, match=r"node_size=4\).*ep_dispatch=node needs each ep group"):
        zplan.predict(rec, costs, _profile(4))


def test_preflight_predicts_a_node_config_on_the_runs_nodes():
    """The trainer's node size (parallel.node_size here) decides what it accepts and where the
    two exchanges run, whatever the profile's nodes are (cpu_2core: one node of 16)."""
    import torch

    from experiments.plan import costs_of
    from experiments.training.preflight import predict_config, profile_of

    cpu = torch.device("cpu")
    node = ["parallel.ep=4", "parallel.ep_dispatch=node"]
    cfg = cfg_of(*MODEL, *node, "parallel.node_size=2")
    rec, p = predict_config(cfg, 8, cpu)
    prof = profile_of(cfg, cpu)
    assert rec.ep_dispatch == "node" and prof.node_size != 2
    want = zplan.predict(rec, costs_of(cfg, prof), dataclasses.replace(prof, node_size=2))
    assert p.step_s == want.step_s and p.memory_bytes == want.memory_bytes
    # one node holds the whole ep group: the trainer refuses it, so the planner does not judge it
    assert predict_config(cfg_of(*MODEL, *node, "parallel.node_size=4"), 8, cpu) is None


def test_auto_lists_node_dispatch_by_the_runs_nodes():
    """parallel=auto holding ep_dispatch=node: the layouts it ranks are those the trainer accepts on
    the run's nodes (parallel.node_size=2 of 8 ranks), not on the profile's (cpu_2core: one node of
    16, where no ep group spans two nodes and nothing could be picked)."""
    from experiments.training.preflight import resolve_auto

    cfg = cfg_of(*MODEL, "parallel.node_size=2")
    rec, _, n = resolve_auto(cfg, 8, {"ep_dispatch": "node"})
    assert n > 0 and rec.ep_dispatch == "node" and rec.ep % 2 == 0 and rec.ep > 2
    assert cfg.parallel.ep_dispatch == "node" and cfg.parallel.ep == rec.ep
    assert zplan.layout_problem(rec, 4, 4, None, 2) is None


@pytest.mark.parametrize("kernel", ["fused", "grouped"])
def test_what_a_layer_saves_follows_where_its_experts_run(kernel):
    """Saved bytes per token of an MoE layer by layout (``_Costing.saved_bytes``; what the rows
    mode saves is measured in tests/moe/test_costs.py): without expert parallelism ``act_bytes``;
    between flat exchanges (and node dispatch's exchange inside a node) K routed rows of
    ``rows_mode_row_bytes`` more; node dispatch with one rank a node runs its experts in tokens
    mode over the rows received, a row per token and node, and saves those. The worst case's
    extra rows and the predicted activations follow."""
    costs = model_costs(
        TransformerConfig(
            vocab_size=64, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_seq_len=8, moe=MoEConfig(16, 32, 8, 2)
        ),
        8,
        experts=kernel,
    )
    b = next(b for b in costs.blocks if b.is_moe)
    assert b.rows_mode_row_bytes == 16 + (2 * 4 * 16 if kernel == "fused" else 0)
    cases = {
        zplan.LayoutRecord(world=4, batch_size=16): b.act_bytes,
        zplan.LayoutRecord(world=4, batch_size=16, ep=4): b.act_bytes + 2 * b.rows_mode_row_bytes,
        zplan.LayoutRecord(world=4, batch_size=16, ep=4, ep_dispatch="node"): b.act_bytes + 2 * b.rows_mode_row_bytes,
    }
    one_a_node = zplan.LayoutRecord(world=4, batch_size=16, ep=4, ep_dispatch="node")
    for rec, want in cases.items():
        c = _Costing(rec, costs, _profile(2), 2.0)
        assert c.saved_bytes(b) == pytest.approx(want, rel=1e-12), rec.label()
        dense = next(x for x in costs.blocks if not x.is_moe and x.act_bytes)
        assert c.saved_bytes(dense) == dense.act_bytes
    c = _Costing(one_a_node, costs, _profile(1), 2.0)
    d = expected_nodes(8, 2, 4, None, None)
    assert c.saved_bytes(b) == pytest.approx(b.act_bytes + d * b.row_bytes, rel=1e-12)
    assert c.saved_row_bytes(b) == b.expert_row_bytes
    # the predicted peak: with ep, the activations carry the rows mode's bytes (no skew: no extra rows)
    flat, ep1 = (zplan.LayoutRecord(world=4, batch_size=16, ep=e) for e in (4, 1))
    p_flat, p_ep1 = (zplan.predict(r, costs, _profile(2), skew=1.0) for r in (flat, ep1))
    T = 16 // 4 * costs.seq_len
    moe_layers = sum(1 for x in costs.blocks if x.is_moe)
    extra = p_flat.memory_parts["activations"] - p_ep1.memory_parts["activations"]
    assert extra == pytest.approx(moe_layers * T * 2 * b.rows_mode_row_bytes, rel=1e-9)
    # the worst case's extra rows cost what a row saves there
    skewed = zplan.predict(flat, costs, _profile(2), skew=1.5)
    per_row = _Costing(flat, costs, _profile(2), 1.5).saved_row_bytes(b)
    assert per_row == b.expert_row_bytes + b.rows_mode_row_bytes
    assert skewed.memory_parts["expert_rows"] == pytest.approx(moe_layers * 0.5 * T * 2 * per_row, rel=1e-9)
