"""The MoE layer shapes and the layer step that the layer benchmark (``moe_layer``) and the
profiler (``profile_layer``) share. Shapes follow the project's legend (docs/design.md)."""

from __future__ import annotations

import torch

from moe import MoEConfig, MoELayer

SHAPES = {
    # name: (T, D, F, E, K)
    "S1": (8192, 512, 1024, 8, 2),
    "S2": (8192, 512, 256, 64, 6),
}
GPU_SHAPES = {
    **SHAPES,
    "mixtral": (16384, 4096, 14336, 8, 2),  # Mixtral-8x7B's expert sizes
    "fine64": (16384, 2048, 1408, 64, 6),  # DeepSeekMoE-style fine-grained experts
}


def make_layer(T, D, F, E, K, seed=0):
    torch.manual_seed(seed)
    cfg = MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K)
    layer = MoELayer(cfg)
    x_TD = torch.randn(T, D, requires_grad=True)
    grad_TD = torch.randn(T, D)
    return layer, x_TD, grad_TD


def layer_step(layer, x_TD, grad_TD):
    for p in layer.parameters():
        p.grad = None
    x_TD.grad = None
    out_TD = layer(x_TD)
    out_TD.backward(grad_TD)
