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

import math

import pytest
import torch
import torch.nn.functional as F

import moe
import routing_kernels as rk
from moe import MoEConfig, MoELayer
from routing_kernels.cpu import forced_schedule
from tests.support.layer_cases import (
    CASES,
    check_against_naive,
    make,
    no_aux,
    run_layer,
)
from tests.support.naive import (
    naive_capacity_keep,
    naive_expert_choice,
    naive_weights_for,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


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
