"""ZeRO++'s exact parts: hpZ (zero.zeropp) equals stage 3 bit for bit (losses and weights, several
AdamW steps with gradient accumulation, so the second micro-batch's forward gathers from the
secondary partition too), and the per-tier byte counters (zero.comm) are checked exactly against
their byte model, recomputed here from each flat's sizes; the node tier of the layout and the
options' refusals. The distributed runs: tests/support/zeropp_runs.py."""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.dist import run_distributed
from tests.support.zero_nets import D, TinyNet
from tests.support.zeropp_runs import BYTE_BLOCK, BYTE_CONFIGS, NODE, WORLD, equal_and_bytes_rank
from zero import Layout, validate_node_size
from zero.comm import CommCounter, Tiers, all_reduce_bytes, all_to_all_bytes, broadcast_bytes, gather_bytes
from zero.engine import ZeroEngine
from zero.zeropp import row_bytes

# --- single process: the byte model and bad input -------------------------------------------


def test_byte_model_formulas():
    # ranks 0-3 on nodes of 2: a dp group of 4 is 2 nodes x 2 members
    t = Tiers((0, 1, 2, 3), 1, 2)
    assert t.split == (2, 2)
    N = 4 * 1000
    assert gather_bytes(N, t) == (1 * N // 2, 1 * N // 4)  # intra (k-1)N/k, inter (n-1)N/W
    assert sum(gather_bytes(N, t)) == 3 * N // 4  # (W-1)/W N, a ring's per-rank total
    assert all_reduce_bytes(6, t) == (2 * 4, 2 * 2)  # 6 bytes round up to 8
    assert all_to_all_bytes([10, 10, 10, 10], t) == (10, 20)  # rank 0 on my node, 2 and 3 across
    # one member per node (an edp group of ranks 0 and 2): every byte crosses
    assert gather_bytes(N, Tiers((0, 2), 0, 2)) == (0, N // 2)
    # a group inside one node
    assert gather_bytes(N, Tiers((0, 1), 0, 2)) == (N // 2, 0)
    # nodes holding different numbers of members: each rank's N/W to each member, by where it sits
    odd = Tiers((0, 1, 2, 3, 4, 5), 0, 4)
    assert odd.split is None
    assert gather_bytes(6 * 10, odd) == (3 * 10, 2 * 10)
    # broadcast: the all-gather of the pieces, and the source's scatter
    assert broadcast_bytes(8, t, src=0) == gather_bytes(8, t)
    assert broadcast_bytes(8, Tiers((0, 1, 2, 3), 0, 2), src=0) == (4 + 2, 2 + 4)


def test_counter_reset_per_step():
    c = CommCounter(node_size=2)
    c.add("setup", 5, 5)
    c.end_setup()
    c.add("grad_reduce", 1, 2)
    c.add("grad_reduce", 1, 2)
    c.end_step()
    assert c.totals(c.last) == {"intra": 2, "inter": 4} and c.current == {}
    assert c.totals(c.setup) == {"intra": 5, "inter": 5}
    with pytest.raises(ValueError, match="unknown communication label"):
        c.add("nonsense", 1, 1)


def test_node_size_must_divide_world():
    with pytest.raises(ValueError, match=r"node_size=3 does not divide the world size 4.*divisors of 4: \[1, 2, 4\]"):
        validate_node_size(4, 3)
    with pytest.raises(ValueError, match="node_size=0 must be a positive integer"):
        validate_node_size(4, 0)
    with pytest.raises(ValueError, match="node_size=2 does not divide the world size 1"):
        Layout.build(node_size=2)


def _engine(stage=3, layout=None, **kw):
    torch.manual_seed(0)
    return ZeroEngine(TinyNet(None), layout, stage=stage, **kw)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"stage": 2, "qwz": True}, "qwz=True needs stage=3.*got stage=2"),
        ({"stage": 1, "hpz": True}, "hpz=True needs stage=3.*got stage=1"),
        ({"stage": 0, "qgz": True}, "qgz=True needs stage 1, 2 or 3.*got stage=0"),
        ({"qgz": True, "qgz_bits": 2}, r"qgz_bits: bits=2 is not supported: valid bit widths are \(4, 8\)"),
        ({"qwz": True, "quant_block": 0}, "quant_block: block=0 must be a positive integer"),
        ({"hpz": 1}, "hpz=1 must be True or False"),
    ],
)
def test_bad_options_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        _engine(**kw)


def test_irregular_node_split_is_refused_before_any_collective():
    # world 12 = pp 2 x dp 6 on nodes of 4: stage 0's dp group (ranks 0-5) has 4 members on node 0
    # and 2 on node 1; no process group exists here, so any collective would fail differently
    layout = Layout(world=12, rank=0, pp=2, dp=6, ep=1, node_size=4)
    for opt in ("hpz", "qgz"):
        with pytest.raises(ValueError, match=rf"{opt}=True needs every dp group.*node_size=4.*\{{0: 4, 1: 2\}}"):
            _engine(layout=layout, **{opt: True})


def test_single_process_options_train():
    # one process: nothing to gather or reduce, every option is a no-op on the wire
    e = _engine(hpz=True, qwz=True, qgz=True)
    x = torch.randn(2, 3, D)
    e.backward(e(x).pow(2).mean())
    e.step()
    assert e.comm_bytes() == {"intra": 0, "inter": 0}


# --- distributed ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def equal_and_bytes():
    return run_distributed(equal_and_bytes_rank, WORLD, timeout=600)


@pytest.mark.distributed
def test_layout_node_tier(equal_and_bytes):
    for rank, out in enumerate(equal_and_bytes):
        node = rank // NODE
        dp = out[("layout", 1)]
        assert dp["dp_intra_group"] == [2 * node, 2 * node + 1]
        assert dp["dp_inter_group"] == [rank % 2, rank % 2 + 2]
        assert dp["edp_intra_group"] == dp["dp_intra_group"] and dp["edp_inter_group"] == dp["dp_inter_group"]
        assert dp["node_split_dp"] == (2, 2)
        ep = out[("layout", 2)]
        # edp groups {0, 2} and {1, 3}: one member per node, so the group is its own inter part
        assert ep["edp_group"] == [rank % 2, rank % 2 + 2] and ep["node_split_edp"] == (2, 1)
        assert ep["edp_intra_group"] is None and ep["edp_inter_group"] == ep["edp_group"]


@pytest.mark.distributed
@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("mp", ["fp32", "bf16"])
def test_hpz_bit_equal_to_stage3(equal_and_bytes, ep, mp):
    for out in equal_and_bytes:
        base, hpz = out[("eq", ep, mp, False)], out[("eq", ep, mp, True)]
        assert hpz["losses"] == base["losses"]
        assert base["params"].keys() == hpz["params"].keys()
        for n in base["params"]:
            assert torch.equal(hpz["params"][n], base["params"][n]), n
    # the run trained (not a run that never moved)
    losses = equal_and_bytes[0][("eq", ep, mp, False)]["losses"]
    assert losses[-1] < losses[0]


# --- the byte model, recomputed from each flat's sizes --------------------------------------


def _ag(N: int, n: int, k: int) -> tuple[int, int]:
    """Two-level all-gather of N bytes (or reduce-scatter of N) over n nodes x k members."""
    return (k - 1) * N // k, (n - 1) * N // (n * k)


def _add(acc: dict, label: str, pair) -> None:
    a = acc.setdefault(label, {"intra": 0, "inter": 0})
    a["intra"] += pair[0]
    a["inter"] += pair[1]


def expected_bytes(flats: list[dict], config: dict, block: int) -> dict:
    stage = config.get("stage", 3)
    hpz, qwz, qgz = config.get("hpz", False), config.get("qwz", False), config.get("qgz", False)
    bits = config.get("qgz_bits", 4)
    acc: dict = {}
    for f in flats:
        (n, k), P, C, e = f["split"], f["padded"], f["chunk"], f["elem"]
        if f["world"] == 1:
            continue
        if stage == 3:
            primary = f["world"] * row_bytes(C, 8, block) if qwz else e * P
            gathers = 1 if hpz and n > 1 else 2
            for _ in range(gathers):
                _add(acc, "param_gather", _ag(primary, n, k))
            if hpz and n > 1:  # the backward's gather from the node's secondary slices: intra only
                _add(acc, "param_gather_secondary", ((k - 1) * e * P // k, 0))
        else:  # stages 1-2: the updated slices back to every replica
            _add(acc, "param_update_gather", _ag(e * P, n, k))
        if qgz:
            if k > 1:
                _add(acc, "grad_reduce_intra", ((k - 1) * row_bytes(n * C, bits, block), 0))
            if n > 1:
                _add(acc, "grad_reduce_inter", (0, (n - 1) * row_bytes(C, bits, block)))
        else:
            _add(acc, "grad_reduce", _ag(e * P, n, k))
    # the norm's all-reduce: one fp32 over dp (4 ranks: 2 nodes x 2), 4 bytes already a multiple of 4
    rs = _ag(4, 2, 2)
    _add(acc, "grad_norm", (2 * rs[0], 2 * rs[1]))
    return acc


@pytest.mark.distributed
@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("mp", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(BYTE_CONFIGS))
def test_byte_counts_match_the_model(equal_and_bytes, ep, mp, name):
    for rank, out in enumerate(equal_and_bytes):
        run = out[("bytes", ep, mp, name)]
        want = expected_bytes(run["flats"], BYTE_CONFIGS[name], BYTE_CONFIGS[name].get("quant_block", BYTE_BLOCK))
        for step in run["bytes"]:
            assert step == want, (rank, name)
        assert run["totals"] == {t: sum(v[t] for v in want.values()) for t in ("intra", "inter")}
        assert run["setup"]["intra"] + run["setup"]["inter"] > 0  # the initial broadcast, apart


@pytest.mark.distributed
@pytest.mark.parametrize("ep", [1, 2])
def test_evaluation_between_steps_counted_aside(equal_and_bytes, ep):
    # an evaluation forward (no autograd) under engine.comm.aside(): its gathers are counted apart,
    # and it leaves hpZ no secondary slice, so the next step moves what a step without it moves
    for out in equal_and_bytes:
        run = out[("bytes_eval", ep)]
        want = expected_bytes(run["flats"], {"hpz": True}, BYTE_BLOCK)
        assert all(step == want for step in run["bytes"])
        evals = len(run["bytes"])
        assert set(run["asides"]) == {"param_gather"}
        per_eval = sum(_ag(f["elem"] * f["padded"], *f["split"])[1] for f in run["flats"])
        assert run["asides"]["param_gather"]["inter"] == evals * per_eval
        plain = out[("bytes", ep, "fp32", "hpz")]
        assert run["losses"] == plain["losses"]


@pytest.mark.distributed
@pytest.mark.parametrize("ep", [1, 2])
def test_zeropp_cuts_inter_node_bytes_4x(equal_and_bytes, ep):
    # the ZeRO++ paper's count with 16-bit weights and gradients: stage 3 moves 3M across nodes per
    # step (forward gather, backward gather, gradient reduce-scatter); qwZ halves the forward's
    # (int8), hpZ keeps the backward's inside the node, qgZ quarters the reduction's (int4):
    # 0.5M + 0 + 0.25M = 0.75M, 4x fewer, up to the fp32 scales (4 bytes per block of a chunk) and
    # the int4 padding of an odd chunk
    for out in equal_and_bytes:
        base = out[("bytes", ep, "bf16", "plain")]
        norm = base["bytes"][-1]["grad_norm"]["inter"]  # the same 4 bytes in every configuration
        base_inter = base["totals"]["inter"] - norm
        for name, block in (("zeropp", BYTE_BLOCK), ("zeropp_block256", 256)):
            zpp = out[("bytes", ep, "bf16", name)]
            assert zpp["bytes"][-1]["grad_norm"]["inter"] == norm
            overhead = 0  # per node crossed: the scales of qwZ's and qgZ's chunks, an odd chunk's half byte
            for f in zpp["flats"]:
                n, C = f["split"][0], f["chunk"]
                overhead += (n - 1) * (2 * 4 * math.ceil(C / block) + C % 2 / 2)
            zpp_inter = zpp["totals"]["inter"] - norm
            assert base_inter == 4 * (zpp_inter - overhead), name
        # all told, scales included, at the default block of 256: TinyNet's chunks are small (5-1152
        # elements, one scale each), so the scales cost ~3% here (a paper-sized chunk: 8 bytes per
        # 1.5 * 256 = 2%)
        assert base_inter / zpp_inter >= 3.8
