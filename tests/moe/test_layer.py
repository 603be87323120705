"""MoELayer against the naive per-token loop of tests/support/naive.py: outputs and every gradient.

Shapes follow the project's legend (docs/design.md).

The layer runs each expert backend of ``routing_kernels.expert_ffn`` that this machine has:
``cpu_blocks`` (the CPU default: permute, experts and combine as one pass in parallel lanes),
``loop`` (routing_kernels' separate permute and combine around the per-expert reference loop) and
``grouped_mm`` (``torch._grouped_mm``, the GPU's bf16 path, which torch also runs on the CPU).

The reference runs in fp64 on copies of the layer's parameters and follows the layer's own routing
decision (which experts), recomputing the combine weights token by token from the router weight,
so the router's gradient is checked through the whole layer. Routing decisions themselves are
checked against the naive router in test_router.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import moe
import routing_kernels as rk
from moe import MoEConfig, MoELayer
from routing_kernels.cpu import BlockQueue, LaneFailed, forced_schedule, lane_count, release_lanes
from tests.support.naive import (
    naive_capacity_keep,
    naive_expert_choice,
    naive_moe,
    naive_params,
    naive_weights_for,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# Max-abs error relative to the reference's max-abs value. fp32: the layer's sums run over at
# most a few hundred terms, each rounding at ~6e-8, so 2e-5 leaves room without hiding a wrong
# index or weight (those give O(1) errors). bf16: every matmul output and the activation round to
# 8 mantissa bits (~4e-3 each) and errors compound over the 3 matmuls and the combine. Measured
# over 40 seeds (weights, inputs, output gradient) of every bf16 case below, fused and unfused:
# output <= 1.6e-2, input gradient <= 1.2e-2, expert and shared-expert weight gradients <= 1.65e-2;
# the tolerance is 2x the largest of those.
TOL = {torch.float32: 2e-5, torch.bfloat16: 3.3e-2}
# The router's weight gradient in bf16 is, per token, a difference of two bf16-rounded expert
# outputs dotted with the output gradient (d weight_i / d logit_j ~ w_i w_j (y_i - y_j) . g): it
# cancels, and with few tokens nothing averages the cancellation out. Measured <= 2.0e-2 in 439 of
# those 440 runs, 5.6e-2 once (3 tokens, two experts of nearly equal output); 2x that maximum.
BF16_ROUTER_GRAD_TOL = 0.11


def tolerance(dtype, what: str) -> float:
    if dtype == torch.bfloat16 and "router" in what:
        return BF16_ROUTER_GRAD_TOL
    return TOL[dtype]


def rel_err(actual, expected):
    if expected.numel() == 0:
        return 0.0
    a, b = actual.double(), expected.double()
    # floor the scale: a gradient that is zero analytically (k=1 with renormalised weights: the
    # weight is p/p = 1) is ~1e-23 of round-off in the reference and exactly 0 in the layer
    scale = max(b.abs().max().item(), 1e-6)
    return (a - b).abs().max().item() / scale


def assert_close(actual, expected, dtype, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err, tol = rel_err(actual, expected), tolerance(dtype, what)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.2g} ({dtype})"


def make(cfg: MoEConfig, dtype=torch.float32, seed=0) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(cfg)
    if cfg.expert_bias:
        # a non-zero bias, so a test sees it steer the selection and stay out of the weights
        layer.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, cfg.num_experts))
    return layer.to(dtype)


def no_aux(**kw) -> MoEConfig:
    # losses off: these tests compare the routed computation alone; the aux path has its own tests
    return MoEConfig(aux_loss_coef=0.0, z_loss_coef=0.0, **kw)


def run_layer(layer, x, grad):
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out = layer(x)
    out.backward(grad)
    grads = {n: p.grad for n, p in layer.named_parameters()}
    return out.detach(), x.grad, grads


def run_naive(layer, x, grad):
    """The fp64 per-token loop on the layer's own routing decision."""
    cfg = layer.cfg
    D = cfg.d_model
    params = naive_params(layer)
    x64 = x.detach().double().requires_grad_(True)
    x_TD = x64.reshape(-1, D)
    with torch.no_grad():
        routing = layer.router(x.reshape(-1, D))
    if cfg.router == "expert_choice":
        chosen = routing.expert_ids_TK >= 0
        probs = torch.softmax(x_TD @ params["router.weight"].t(), dim=-1)
        ids, w = routing.expert_ids_TK, probs * chosen * cfg.route_scale
    else:
        ids = routing.expert_ids_TK
        w = naive_weights_for(cfg, params["router.weight"], x_TD, routing.selected_TK)
    out = naive_moe(cfg, params, x_TD, ids, w).view(x.shape)
    out.backward(grad.double())
    return out.detach(), x64.grad, {n: p.grad for n, p in params.items()}


def check_against_naive(layer, x, dtype, label=""):
    torch.manual_seed(123)
    grad = torch.randn(x.shape, dtype=dtype)
    out, gx, grads = run_layer(layer, x, grad)
    ref_out, ref_gx, ref_grads = run_naive(layer, x, grad)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, ref_out, dtype, f"{label} output")
    assert_close(gx, ref_gx, dtype, f"{label} d input")
    assert set(grads) == set(ref_grads)
    for name in grads:
        assert grads[name] is not None, f"{label} {name} got no gradient"
        assert_close(grads[name], ref_grads[name], dtype, f"{label} d {name}")


CASES = {
    # name: (input shape, config kwargs)
    "odd": ((37, 24), dict(d_ff=40, num_experts=5, top_k=2)),
    "E1": ((16, 16), dict(d_ff=24, num_experts=1, top_k=1)),
    "k_eq_E": ((20, 16), dict(d_ff=24, num_experts=4, top_k=4)),
    "fewer_tokens_than_experts": ((3, 16), dict(d_ff=24, num_experts=16, top_k=2)),
    "one_token": ((1, 8), dict(d_ff=12, num_experts=3, top_k=2)),
    "3d_input": ((2, 7, 16), dict(d_ff=24, num_experts=6, top_k=2)),
    "topk_then_softmax": ((19, 16), dict(d_ff=20, num_experts=6, top_k=3, softmax_before_topk=False)),
    "no_renorm_scaled": ((19, 16), dict(d_ff=20, num_experts=6, top_k=2, normalize_topk=False, route_scale=2.5)),
    "sigmoid_groups": (
        (23, 16),
        dict(d_ff=20, num_experts=8, top_k=3, score_func="sigmoid", num_groups=4, topk_groups=2, route_scale=2.5),
    ),
    "gelu_shared": ((17, 16), dict(d_ff=20, num_experts=4, top_k=2, activation="gelu", num_shared_experts=1)),
    "swiglu_shared2": ((17, 16), dict(d_ff=20, num_experts=4, top_k=2, num_shared_experts=2, shared_d_ff=28)),
    "expert_bias": ((29, 16), dict(d_ff=20, num_experts=6, top_k=2, expert_bias=True)),
    "capacity_probs": ((31, 16), dict(d_ff=20, num_experts=4, top_k=2, capacity_factor=0.5, drop_policy="probs")),
    "capacity_position": (
        (31, 16),
        dict(d_ff=20, num_experts=4, top_k=2, capacity_factor=0.75, drop_policy="position"),
    ),
    "expert_choice": ((21, 16), dict(d_ff=20, num_experts=5, top_k=2, router="expert_choice")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_naive_fp32(name):
    shape, kw = CASES[name]
    layer = make(no_aux(d_model=shape[-1], **kw))
    torch.manual_seed(1)
    check_against_naive(layer, torch.randn(shape), torch.float32, name)


@pytest.mark.parametrize("name", ["odd", "k_eq_E", "3d_input", "sigmoid_groups", "gelu_shared", "capacity_probs"])
def test_matches_naive_bf16(name):
    shape, kw = CASES[name]
    layer = make(no_aux(d_model=shape[-1], **kw), dtype=torch.bfloat16)
    torch.manual_seed(1)
    check_against_naive(layer, torch.randn(shape).bfloat16(), torch.bfloat16, name)


@pytest.mark.parametrize("backend", ["cpu_blocks", "loop"])
@pytest.mark.parametrize("name", ["odd", "gelu_shared", "capacity_probs"])
def test_matches_naive_in_small_blocks(name, backend, monkeypatch):
    # the experts and the combine work block by block (rows of one expert, tokens); tiny blocks make
    # segments span several blocks, ragged last ones included, with weight gradients accumulated
    import routing_kernels.reference

    monkeypatch.setattr(routing_kernels.reference, "_COMBINE_BLOCK_T", 4)
    shape, kw = CASES[name]
    layer = make(no_aux(d_model=shape[-1], **kw))
    torch.manual_seed(1)
    with rk.use_expert_backend(backend), forced_schedule(block_rows=3, combine_tokens=4):
        check_against_naive(layer, torch.randn(shape), torch.float32, name)


@pytest.fixture
def two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def lanes(two_threads):
    """Two intra-op threads, and two lanes for any size (routing_kernels.cpu.forced_schedule): the
    CPU path then runs its expert blocks in two parallel lanes, whatever the routing. Yields the
    schedule's log (``.lanes``: the lane count of every pass)."""
    with forced_schedule(lanes=2) as log:
        yield log


def ran_in_two_lanes(log) -> bool:
    return bool(log.lanes) and all(n == 2 for n in log.lanes)


@pytest.mark.parametrize(
    "name", ["odd", "k_eq_E", "3d_input", "gelu_shared", "capacity_probs", "expert_choice", "fewer_tokens_than_experts"]
)
def test_lanes_match_naive(name, lanes):
    shape, kw = CASES[name]
    layer = make(no_aux(d_model=shape[-1], **kw))
    torch.manual_seed(1)
    check_against_naive(layer, torch.randn(shape), torch.float32, name)
    assert ran_in_two_lanes(lanes), f"ran in lanes {lanes.lanes}"


@pytest.mark.parametrize("name", ["odd", "gelu_shared", "capacity_position", "expert_choice"])
def test_lanes_same_bits_whatever_the_schedule(name, two_threads):
    # blocks of 3 rows: every expert's rows span many blocks, taken by either lane in any order, so
    # weight gradients wait for their turn; which lane runs which block must not change one bit.
    # (A schedule skewed by sleeping in one lane was not fixed: on a loaded machine the other lane
    # could be descheduled long enough that the sleeping one still took every block, in both runs.)
    shape, kw = CASES[name]
    layer = make(MoEConfig(d_model=shape[-1], **kw))
    x, grad = torch.randn(shape), torch.randn(shape)
    runs, logs = [], []
    # lane 0 takes the even blocks, then the odd ones (and the other lane the rest)
    for pattern in (lambda n: n % 2, lambda n: 1 - n % 2):
        with forced_schedule(lanes=2, block_rows=3, lane_of=pattern) as log:
            runs.append(run_layer(layer, x, grad))
        logs.append(log)
    schedules = [sorted(log.blocks.get(0, [])) for log in logs]
    assert schedules[0] != schedules[1], "both runs gave the lanes the same blocks: nothing was tested"
    for log in logs:
        assert all(len(log.blocks.get(i, [])) > 0 for i in (0, 1)), log.blocks
    first, second = runs
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for n in first[2]:
        assert torch.equal(first[2][n], second[2][n]), n
    assert all(ran_in_two_lanes(log) for log in logs)


def test_lane_errors_surface_and_the_next_call_works(two_threads):
    # the lanes alternate blocks: left to the machine, a lane started late on a loaded machine could
    # find the queue empty, and a failure planted in it would never happen (seen once in a suite run)
    shape, kw = CASES["odd"]
    layer = make(MoEConfig(d_model=shape[-1], **kw))
    x, grad = torch.randn(shape), torch.randn(shape)
    with forced_schedule(lanes=2, block_rows=3, lane_of=lambda n: n % 2):
        expected = run_layer(layer, x, grad)
        # in every lane; then in one lane only, while the other may be waiting for that lane's block
        for failing in ((0, 1), (1,)):

            def fail(lane, block, failing=failing):
                if lane in failing:
                    raise RuntimeError("lane failure")

            with forced_schedule(on_block=fail), pytest.raises(RuntimeError, match="lane failure"):
                run_layer(layer, x, grad)
        again = run_layer(layer, x, grad)
    assert torch.equal(again[0], expected[0]) and torch.equal(again[1], expected[1])


def test_block_queue_order_turns_and_failure():
    import threading

    q = BlockQueue([5, 0, 2, 9], block=4)
    units = []
    while (u := q.take()) is not None:
        units.append(u)
    # first blocks of every expert, largest first, then second blocks, ...; an expert's rows are cut
    # into equal parts (9 rows: 3 + 3 + 3), rows in expert order (starts 0, 5, 7)
    assert units == [(3, 7, 10, 0), (0, 0, 2, 0), (2, 5, 7, 0), (0, 2, 5, 1), (3, 10, 13, 1), (3, 13, 16, 2)]
    # in lanes, the last blocks are halved (their halves `lanes` apart, renumbered in row order),
    # unless another tail block is of the same expert (expert 3 above)
    assert BlockQueue([5, 0, 2, 9], block=4, lanes=2).blocks == units
    assert BlockQueue([8, 8, 8], block=4, lanes=2).blocks == [
        (0, 0, 4, 0),
        (1, 8, 12, 0),
        (2, 16, 20, 0),
        (0, 4, 8, 1),
        (1, 12, 14, 1),
        (2, 20, 22, 1),
        (1, 14, 16, 2),
        (2, 22, 24, 2),
    ]
    q.wait_turn(3, 0)  # block 0 never waits
    q.wait_s = 0.05
    with pytest.raises(TimeoutError, match="block 0 of expert 3"):
        q.wait_turn(3, 1)
    q.end_turn(3)
    q.wait_turn(3, 1)
    # a failing lane wakes a waiting one, which stops instead of waiting out the timeout
    q.wait_s = 60.0
    errors = []

    def waiter():
        try:
            q.wait_turn(0, 1)
        except LaneFailed as err:
            errors.append(err)

    t = threading.Thread(target=waiter)
    t.start()
    q.fail()
    t.join(10)
    assert not t.is_alive() and len(errors) == 1
    assert q.take() is None


def test_block_queue_covers_rows_in_turn_order():
    # any counts, block size and lane count: the blocks tile every expert's rows exactly, are
    # numbered 0, 1, ... in row order, and each comes after its predecessor in the queue (what
    # makes the turns deadlock-free)
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(300):
        counts = [rng.choice([0, 1, 2, 5, 9, 40]) for _ in range(rng.randint(1, 7))]
        q = BlockQueue(counts, block=rng.randint(1, 12), lanes=rng.randint(1, 4))
        position = {(e, i): j for j, (e, _, _, i) in enumerate(q.blocks)}
        for e, (n, start) in enumerate(zip(counts, [0, *itertools.accumulate(counts)])):
            mine = sorted((i, a, b) for u, a, b, i in q.blocks if u == e)
            if n == 0:
                assert not mine
                continue
            assert [i for i, _, _ in mine] == list(range(len(mine)))
            assert [a for _, a, _ in mine] == [start] + [b for _, _, b in mine[:-1]]
            assert mine[-1][2] == start + n and all(b > a for _, a, b in mine)
            assert all(position[e, i - 1] < position[e, i] for i, _, _ in mine[1:])


def test_lane_count_falls_back():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert lane_count([2100, 1900, 2000, 2050], 512, 1024) == 2
        assert lane_count([9000, 100, 100, 100], 512, 1024) == 2  # a hot expert's blocks spread too
        assert lane_count([3, 2, 1, 0], 512, 1024) == 1  # too little work to hand off
        assert lane_count([0, 0], 512, 1024) == 1
        # small matmuls (512 rows x 64 x 256 per expert): the lanes' Python would contend for the GIL
        assert lane_count([512] * 8, 64, 256) == 1
        torch.set_num_threads(1)
        assert lane_count([2100, 1900], 512, 1024) == 1
    finally:
        torch.set_num_threads(n)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
@pytest.mark.parametrize("name", ["odd", "fewer_tokens_than_experts", "gelu_shared", "capacity_position"])
def test_grouped_mm_path_matches_naive(name, monkeypatch):
    # the GPU's bf16 path (one torch._grouped_mm per weight), forced on here where torch runs it on the
    # CPU: same routing, same numbers, empty experts included (fewer tokens than experts)
    shape, kw = CASES[name]
    layer = make(no_aux(d_model=shape[-1], **kw))
    import routing_kernels.dispatch as dispatch

    ran, real = [], dispatch._EXPERT_IMPLS["grouped_mm"]
    monkeypatch.setitem(dispatch._EXPERT_IMPLS, "grouped_mm", lambda *a: ran.append(1) or real(*a))
    torch.manual_seed(1)
    with rk.use_expert_backend("grouped_mm"):
        check_against_naive(layer, torch.randn(shape), torch.float32, name)
    assert ran, "the grouped_mm backend did not run"


@pytest.mark.parametrize(
    "name", ["odd", "fewer_tokens_than_experts", "gelu_shared", "capacity_position", "expert_choice"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loop_backend_matches_naive(name, dtype):
    # on the CPU the layer fuses permute/experts/combine; the separate ops (routing_kernels permute
    # and unpermute_combine around the per-expert loop) are what a GPU without grouped GEMM runs
    shape, kw = CASES[name]
    layer = make(no_aux(d_model=shape[-1], **kw), dtype=dtype)
    torch.manual_seed(1)
    with rk.use_expert_backend("loop"):
        check_against_naive(layer, torch.randn(shape).to(dtype), dtype, name)


def test_cpu_blocks_and_loop_agree():
    cfg = no_aux(d_model=24, d_ff=40, num_experts=7, top_k=3, capacity_factor=0.8)
    layer = make(cfg)
    torch.manual_seed(13)
    x, g = torch.randn(50, 24), torch.randn(50, 24)
    with rk.use_expert_backend("cpu_blocks"):
        a = run_layer(layer, x, g)
    with rk.use_expert_backend("loop"):
        b = run_layer(layer, x, g)
    # same products, summed in another order (per block vs per token): fp32 rounding only
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-6)
    for n in a[2]:
        torch.testing.assert_close(a[2][n], b[2][n], rtol=1e-5, atol=1e-6, msg=n)


def test_pooled_buffers_stay_with_a_live_graph():
    # the CPU path keeps the buffers of saved activations from step to step; a second forward
    # while the first graph is alive (pipeline micro-batches, retain_graph) must not reuse them
    layer = make(no_aux(d_model=16, d_ff=24, num_experts=3, top_k=2))
    params = list(layer.parameters())
    torch.manual_seed(14)
    x1, x2, g = torch.randn(40, 16), torch.randn(40, 16), torch.randn(40, 16)
    out1 = layer(x1)
    first = torch.autograd.grad(out1, params, g, retain_graph=True)
    for _ in range(2):  # the second round may reuse out2's buffers, freed by its backward
        out2 = layer(x2)
        torch.autograd.grad(out2, params, g)
    again = torch.autograd.grad(out1, params, g)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_all_tokens_to_one_expert():
    # a router row aligned with all-positive inputs wins every token; the other experts are empty
    layer = make(no_aux(d_model=16, d_ff=24, num_experts=5, top_k=1))
    with torch.no_grad():
        layer.router.weight.fill_(-0.5)
        layer.router.weight[3] = 0.5
    torch.manual_seed(2)
    x = torch.rand(26, 16) + 0.5
    layer(x)
    assert layer.stats.tokens_per_expert.tolist() == [0, 0, 0, 26, 0]
    check_against_naive(layer, x, torch.float32, "one expert")
    _, _, grads = run_layer(layer, x, torch.randn(26, 16))
    # an expert that received no rows has an exact zero gradient, not garbage
    for name in ("experts.w1", "experts.w3", "experts.w2"):
        g = grads[name]
        assert torch.count_nonzero(g[[0, 1, 2, 4]]) == 0 and torch.count_nonzero(g[3]) > 0


def test_empty_batch():
    layer = make(MoEConfig(d_model=8, d_ff=12, num_experts=4, top_k=2))
    x = torch.randn(0, 8, requires_grad=True)
    out = layer(x)
    assert out.shape == (0, 8)
    out.sum().backward()
    assert x.grad.shape == (0, 8)
    assert layer.stats.tokens_per_expert.tolist() == [0, 0, 0, 0]


# --- capacity ---------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("cf", [0.25, 0.5, 1.0, 1.3])
def test_capacity_keeps_exact_counts_and_set(policy, cf):
    T, E, K = 53, 6, 2
    cfg = no_aux(d_model=16, d_ff=8, num_experts=E, top_k=K, capacity_factor=cf, drop_policy=policy)
    layer = make(cfg)
    torch.manual_seed(3)
    # a skewed router so that some experts overflow and others stay under capacity
    with torch.no_grad():
        layer.router.weight[0] += 0.5
    x = torch.randn(T, 16) + 0.3
    routing = layer.router(x)
    selected, w = routing.selected_TK, routing.weights_TK
    cap = math.ceil(cf * K * T / E)
    keep = naive_capacity_keep(cfg, selected, naive_weights_for(cfg, layer.router.weight.detach(), x, selected))
    assert torch.equal(routing.expert_ids_TK >= 0, keep)
    assert torch.equal(routing.expert_ids_TK[keep], selected[keep])
    sel_counts = torch.bincount(selected.reshape(-1), minlength=E)
    kept_counts = torch.bincount(routing.expert_ids_TK[keep], minlength=E)
    assert kept_counts.tolist() == [min(int(c), cap) for c in sel_counts]
    assert torch.all(w[~keep] == 0)
    assert int(routing.num_dropped) == int((~keep).sum())
    layer(x)
    assert layer.stats.dropped_fraction.item() == pytest.approx(float((~keep).sum()) / (K * T))
    assert layer.stats.tokens_per_expert.tolist() == sel_counts.tolist()  # before capacity


def test_dropped_token_contributes_zero():
    # capacity so small that most tokens lose every assignment: their output must be exactly 0
    cfg = no_aux(d_model=8, d_ff=12, num_experts=4, top_k=1, capacity_factor=0.25)
    layer = make(cfg)
    torch.manual_seed(4)
    x = torch.randn(40, 8)
    out = layer(x)
    routing = layer.router(x)
    dropped_T = (routing.expert_ids_TK < 0).all(1)
    assert dropped_T.sum() >= 20
    assert torch.all(out[dropped_T] == 0)
    assert torch.all(out[~dropped_T].abs().sum(1) > 0)


# --- expert choice ----------------------------------------------------------------------------


def test_expert_choice_takes_top_c_tokens():
    cfg = no_aux(d_model=16, d_ff=8, num_experts=5, top_k=2, router="expert_choice", capacity_factor=1.5)
    layer = make(cfg)
    torch.manual_seed(5)
    x = torch.randn(33, 16)
    routing = layer.router(x)
    probs = torch.softmax(x.double() @ layer.router.weight.detach().double().t(), dim=-1)
    chosen = naive_expert_choice(cfg, probs)
    C = math.ceil(1.5 * 2 * 33 / 5)
    assert chosen.sum(0).tolist() == [C] * 5
    assert torch.equal(routing.expert_ids_TK >= 0, chosen)
    layer(x)
    assert layer.stats.tokens_per_expert.tolist() == [C] * 5


# --- auxiliary losses through the layer -------------------------------------------------------


def explicit_aux(cfg, weight_ED, x_TD, counts_E, seq_len):
    """The three losses written out: Switch/GShard, per-sequence, z-loss."""
    E, K = cfg.num_experts, cfg.top_k
    T = x_TD.shape[0]
    logits = x_TD @ weight_ED.t()
    probs = torch.softmax(logits, dim=-1)
    lb = E * torch.sum(counts_E.double() / (K * T) * probs.mean(0))
    routing_ids = torch.topk(probs.detach(), K, dim=-1).indices
    seq_terms = []
    for s in range(T // seq_len):
        rows = slice(s * seq_len, (s + 1) * seq_len)
        c = torch.bincount(routing_ids[rows].reshape(-1), minlength=E).double()
        seq_terms.append(E * torch.sum(c / (K * seq_len) * probs[rows].mean(0)))
    seq = torch.stack(seq_terms).mean()
    z = torch.logsumexp(logits, dim=-1).square().mean()
    return cfg.aux_loss_coef * lb + cfg.seq_aux_loss_coef * seq + cfg.z_loss_coef * z, (lb, seq, z)


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_aux_loss_reaches_router_through_output(scale):
    B, S, D = 3, 11, 16
    cfg = MoEConfig(
        d_model=D, d_ff=20, num_experts=6, top_k=2, aux_loss_coef=0.3, seq_aux_loss_coef=0.2, z_loss_coef=0.05
    )
    layer = make(cfg)
    moe.scale_aux_losses(layer, scale)
    torch.manual_seed(6)
    x = torch.randn(B, S, D)
    g = torch.randn(B, S, D)
    # the layer: only the task loss is backpropagated; the aux losses ride on the output
    _, _, grads = run_layer(layer, x, g * scale)
    counts_E = layer.stats.tokens_per_expert
    # the reference: the same forward with the losses off, plus the losses added to the loss by hand
    plain = copy.deepcopy(layer)
    plain.cfg = no_aux(d_model=D, d_ff=20, num_experts=6, top_k=2)
    plain.router.cfg = plain.cfg
    plain.zero_grad()
    x_TD = x.reshape(-1, D)
    out = plain(x)
    aux, (lb, seq, z) = explicit_aux(cfg, plain.router.weight.double(), x_TD.double(), counts_E, S)
    (scale * ((out * g).sum() + aux)).backward()
    assert_close(grads["router.weight"], plain.router.weight.grad, torch.float32, "router grad")
    for name in ("experts.w1", "experts.w2"):
        assert_close(grads[name], dict(plain.named_parameters())[name].grad, torch.float32, name)
    # the reported values are the losses themselves, not scaled by coefficient or by ``scale``
    assert layer.stats.aux_loss.item() == pytest.approx(lb.item(), rel=1e-5)
    assert layer.stats.seq_aux_loss.item() == pytest.approx(seq.item(), rel=1e-5)
    assert layer.stats.z_loss.item() == pytest.approx(z.item(), rel=1e-5)


def test_router_statistics():
    cfg = MoEConfig(d_model=16, d_ff=8, num_experts=4, top_k=2)
    layer = make(cfg)
    torch.manual_seed(7)
    x = torch.randn(25, 16)
    layer(x)
    probs = torch.softmax(x.double() @ layer.router.weight.detach().double().t(), -1)
    ids = torch.topk(probs, 2, -1).indices
    assert layer.stats.tokens_per_expert.tolist() == torch.bincount(ids.reshape(-1), minlength=4).tolist()
    entropy = -(probs * probs.log()).sum(-1).mean()
    assert layer.stats.router_entropy.item() == pytest.approx(entropy.item(), rel=1e-5)
    assert layer.stats.dropped_fraction.item() == 0.0
    d = layer.stats.as_dict()
    assert set(d) == {"aux_loss", "seq_aux_loss", "z_loss", "tokens_per_expert", "dropped_fraction", "router_entropy"}


# --- aux-loss-free balancing ------------------------------------------------------------------


def load_imbalance(counts):
    counts = counts.double()
    return (counts.max() / counts.mean()).item()


def test_expert_bias_moves_load_toward_uniform():
    E = 8
    cfg = MoEConfig(
        d_model=16, d_ff=8, num_experts=E, top_k=2, expert_bias=True, bias_update_rate=0.02, aux_loss_coef=0.0
    )
    torch.manual_seed(8)
    layer = MoELayer(cfg)
    x = torch.randn(256, 16) + 0.5
    with torch.no_grad():
        # experts 0 and 1 lean toward the input mean, so they take most tokens
        layer.router.weight[:2] += 0.4
    layer.train()
    with torch.no_grad():
        layer(x)
    start = load_imbalance(layer.stats.tokens_per_expert)
    assert start > 2.0
    layer.update_expert_bias()
    history = []
    for _ in range(60):
        with torch.no_grad():
            layer(x)
        history.append(load_imbalance(layer.stats.tokens_per_expert))
        moe.update_expert_biases(layer)
    # sign updates of a fixed size oscillate around balance on a fixed batch, so look at the best of
    # the last steps: the max/mean load must have at least halved
    assert min(history[-10:]) < 0.5 * start
    # the overloaded experts' biases went down, the bias update resets the running load
    assert layer.router.expert_bias[:2].max() < 0 and torch.all(layer.load_since_update == 0)


def test_expert_bias_selects_but_does_not_weight():
    cfg = no_aux(d_model=16, d_ff=8, num_experts=6, top_k=2, expert_bias=True)
    layer = make(cfg)
    torch.manual_seed(9)
    x = torch.randn(40, 16)
    before = layer.router(x)
    with torch.no_grad():
        layer.router.expert_bias.zero_()
        layer.router.expert_bias[5] = 10.0  # expert 5 is now everyone's pick
    after = layer.router(x)
    assert torch.all((after.expert_ids_TK == 5).any(1))
    assert not torch.equal(before.expert_ids_TK, after.expert_ids_TK)
    # the weights are still the (renormalised) softmax probabilities of the chosen experts
    probs = torch.softmax(x @ layer.router.weight.detach().t(), -1)
    w = probs.gather(1, after.expert_ids_TK)
    torch.testing.assert_close(after.weights_TK, w / w.sum(1, keepdim=True), rtol=1e-6, atol=1e-7)


# --- activation checkpointing -----------------------------------------------------------------


@pytest.mark.parametrize("reentrant,early_stop", [(True, True), (False, True), (False, False)])
def test_activation_checkpointing_counts_once(reentrant, early_stop):
    # non-reentrant recompute normally stops after the last saved tensor, before the statistics;
    # early_stop=False makes it re-run the whole forward, statistics included
    cfg = MoEConfig(
        d_model=16,
        d_ff=20,
        num_experts=5,
        top_k=2,
        aux_loss_coef=0.1,
        z_loss_coef=0.01,
        seq_aux_loss_coef=0.05,
        expert_bias=True,
    )
    layer = make(cfg)
    layer.train()
    torch.manual_seed(10)
    x = torch.randn(2, 13, 16)
    g = torch.randn(2, 13, 16)
    out, gx, grads = run_layer(layer, x, g)
    stats, load = layer.stats, layer.load_since_update.clone()

    ck = copy.deepcopy(layer)
    ck.load_since_update.zero_()
    ck.zero_grad(set_to_none=True)
    xc = x.clone().requires_grad_(True)
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        out_c = checkpoint(ck, xc, use_reentrant=reentrant)
        out_c.backward(g)
    assert torch.equal(out_c.detach(), out)
    torch.testing.assert_close(xc.grad, gx, rtol=0, atol=0)
    for name, p in ck.named_parameters():
        # recompute runs the same ops in the same order: identical bits, so an aux loss counted
        # twice (a router gradient off by coef * dloss) cannot hide in a tolerance
        torch.testing.assert_close(p.grad, grads[name], rtol=0, atol=0, msg=name)
    assert torch.equal(ck.load_since_update, load)
    assert torch.equal(ck.stats.tokens_per_expert, stats.tokens_per_expert)
    assert ck.stats.aux_loss.item() == stats.aux_loss.item()


# --- determinism and validation ---------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 2])
def test_same_seed_same_bits(threads):
    # big enough that the row gathers, scatter-adds and matmuls split over two threads
    cfg = MoEConfig(d_model=96, d_ff=64, num_experts=7, top_k=3, num_shared_experts=1)
    results = []
    torch.set_num_threads(threads)  # the module fixture restores the count afterwards
    for _ in range(2):
        layer = make(cfg, seed=11)
        torch.manual_seed(12)
        x, g = torch.randn(1500, 96), torch.randn(1500, 96)
        results.append(run_layer(layer, x, g))
    torch.set_num_threads(1)
    (o1, gx1, p1), (o2, gx2, p2) = results
    assert torch.equal(o1, o2) and torch.equal(gx1, gx2)
    assert all(torch.equal(p1[n], p2[n]) for n in p1)


def test_last_dim_must_be_d_model():
    layer = make(MoEConfig(d_model=16, d_ff=8))
    with pytest.raises(ValueError, match=r"d_model=16.*\(4, 15\)"):
        layer(torch.randn(4, 15))


def test_parameter_layout():
    cfg = MoEConfig(d_model=12, d_ff=20, num_experts=5, top_k=2)
    layer = MoELayer(cfg)
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes == {
        "router.weight": (5, 12),
        "experts.w1": (5, 12, 20),
        "experts.w3": (5, 12, 20),
        "experts.w2": (5, 20, 12),
    }
    assert all(moe.is_expert_param(p) for n, p in layer.named_parameters() if n.startswith("experts."))
    assert not moe.is_expert_param(layer.router.weight)
    # the stable parameter layout: SwiGLU is (silu(x @ w1[e]) * (x @ w3[e])) @ w2[e] on the expert's rows
    x = torch.randn(6, 12)
    e = 3
    y = layer.experts(x, [0, 0, 0, 6, 0])
    ref = (F.silu(x @ layer.experts.w1[e]) * (x @ layer.experts.w3[e])) @ layer.experts.w2[e]
    torch.testing.assert_close(y, ref)


@pytest.mark.parametrize("reentrant", [False, True])
def test_lanes_under_activation_checkpointing(reentrant, lanes):
    # the recompute runs the lanes again inside the backward pass (on autograd's thread): the same
    # ops in the same lanes, so gradients are bit-identical to the run without checkpointing
    cfg = MoEConfig(d_model=16, d_ff=20, num_experts=6, top_k=2)
    layer = make(cfg)
    x, g = torch.randn(3, 11, 16), torch.randn(3, 11, 16)
    out, gx, grads = run_layer(layer, x, g)
    ck = copy.deepcopy(layer)
    ck.zero_grad(set_to_none=True)
    xc = x.clone().requires_grad_(True)
    out_c = checkpoint(ck, xc, use_reentrant=reentrant)
    out_c.backward(g)
    assert torch.equal(out_c.detach(), out) and torch.equal(xc.grad, gx)
    for name, p in ck.named_parameters():
        assert torch.equal(p.grad, grads[name]), name
    assert ran_in_two_lanes(lanes)


def test_lanes_leave_thread_defaults_alone(lanes):
    # lane threads run one intra-op thread each; threads the program starts later must still get
    # the process's setting (torch.set_num_threads in a thread also sets their default)
    import threading

    release_lanes()  # fresh lane threads: their start-up is under test
    shape, kw = CASES["odd"]
    layer = make(MoEConfig(d_model=shape[-1], **kw))
    layer(torch.randn(shape)).sum().backward()
    assert lanes.lanes and lanes.lanes[0] == 2
    seen = {}

    def probe():
        torch.ones(100_000).sum()
        seen["threads"] = torch.get_num_threads()

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    assert seen["threads"] == torch.get_num_threads() == 2
    assert lanes.lane_threads and all(n == 1 for n in lanes.lane_threads), lanes.lane_threads


def test_lanes_share_many_threads(lanes):
    # 4 intra-op threads and 2 lanes (what lane_count gives with at most 2): each lane runs 2
    # threads, so none sits idle, and the results still match the reference; the caller keeps its 4
    torch.set_num_threads(4)
    assert lane_count([2100, 1900], 512, 1024, max_lanes=2) == 2
    shape, kw = CASES["odd"]
    layer = make(no_aux(d_model=shape[-1], **kw))
    torch.manual_seed(1)
    check_against_naive(layer, torch.randn(shape), torch.float32, "odd")
    assert ran_in_two_lanes(lanes)
    assert lanes.lane_threads and all(n == 2 for n in lanes.lane_threads), lanes.lane_threads
    assert torch.get_num_threads() == 4
    for threads, expected in ((16, 8), (12, 6), (9, 3), (7, 7)):
        torch.set_num_threads(threads)
        assert lane_count([2100, 1900], 512, 1024) == expected, threads


def test_shared_expert_gate_scales_the_shared_output():
    # out = routed + sigmoid(x @ w_gate) * shared(x); a gate needs a shared expert
    torch.manual_seed(0)
    cfg = MoEConfig(
        d_model=8,
        d_ff=12,
        num_experts=4,
        top_k=2,
        num_shared_experts=1,
        shared_expert_gate=True,
        aux_loss_coef=0.0,
        z_loss_coef=0.0,
    )
    layer = MoELayer(cfg)
    x = torch.randn(5, 8)
    routed = layer.dispatcher(x, *(lambda r: (r.expert_ids_TK, r.weights_TK))(layer.router(x)), layer.experts)
    want = routed + torch.sigmoid(x @ layer.shared_expert_gate.weight.t()) * layer.shared_experts(x)
    torch.testing.assert_close(layer(x), want)
    with pytest.raises(ValueError, match="shared_expert_gate"):
        MoEConfig(d_model=8, d_ff=12, shared_expert_gate=True)
