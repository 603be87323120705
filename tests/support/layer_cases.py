"""What the MoELayer tests share: the layer built from a config, one forward and backward, the
fp64 naive reference of tests/support/naive.py following the layer's own routing, the comparison
with its tolerances (and their reasons), and the named cases every backend runs.

Shapes follow the project's legend (docs/design.md).
"""

from __future__ import annotations

import torch

from moe import MoEConfig, MoELayer
from tests.support.naive import (
    naive_moe,
    naive_params,
    naive_weights_for,
)

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
