"""The MoE layer shapes and the layer step that the layer benchmark (``moe_layer``) and the
profiler (``profile_layer``) share, and the residual GELU MLP the ZeRO benchmarks (``zero``,
``zeropp``) shard. Shapes follow the project's legend (docs/design.md)."""

from __future__ import annotations

import torch
import torch.nn as nn

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


# the ZeRO benchmarks' model: residual GELU blocks, each one ZeRO unit
class Block(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.up = nn.Linear(d, f)
        self.down = nn.Linear(f, d)

    def forward(self, x_TD):
        return x_TD + self.down(nn.functional.gelu(self.up(x_TD)))


class MLP(nn.Module):
    def __init__(self, d: int, f: int, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, f) for _ in range(layers))

    def forward(self, x_TD):
        for b in self.blocks:
            x_TD = b(x_TD)
        return x_TD
