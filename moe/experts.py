"""Expert parameters: ``GroupedExperts`` (the routed experts) and ``DenseFFN`` (shared experts, dense
blocks).

Shapes follow the project's legend (docs/design.md): S rows in expert order, T tokens, K routing
slots, D model dim, F expert hidden dim, E experts of the model, X experts held by this process.

Parameter layout, stable so weights move in and out of other tools: ``w1 [X, D, F]`` gate,
``w3 [X, D, F]`` up, ``w2 [X, F, D]`` down; SwiGLU is ``(silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]``,
GELU ``gelu(x @ w1[e]) @ w2[e]`` (no ``w3``). The computation is ``routing_kernels.expert_ffn``,
whose dispatch point picks the backend for the device and dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as nnf

import routing_kernels as rk
from routing_kernels.runtime import mark_expert_params


class GroupedExperts(nn.Module):
    """``num_local`` experts; with expert parallelism this process holds experts
    ``[expert_offset, expert_offset + num_local)`` of the model's ``num_global``, and each parameter
    carries that mark (``routing_kernels.runtime.expert_shard``), by which ZeRO shards and reduces
    it over the expert-data-parallel group."""

    def __init__(
        self,
        num_local: int,
        d_model: int,
        d_ff: int,
        activation: str = "swiglu",
        *,
        expert_offset: int = 0,
        num_global: int | None = None,
    ):
        super().__init__()
        self.num_local = num_local
        self.expert_offset = expert_offset
        self.num_global = num_local if num_global is None else num_global
        self.activation = activation
        self.w1 = nn.Parameter(torch.empty(num_local, d_model, d_ff))
        if activation == "swiglu":
            self.w3 = nn.Parameter(torch.empty(num_local, d_model, d_ff))
        else:
            self.register_parameter("w3", None)
        self.w2 = nn.Parameter(torch.empty(num_local, d_ff, d_model))
        mark_expert_params(self.parameters(), expert_offset, self.num_global)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        # like nn.Linear's default: uniform in +-1/sqrt(fan_in). Each global expert draws from its
        # own generator, seeded from ONE draw of the global RNG: expert e gets the same weights
        # whichever process holds it, and the global RNG advances the same on every layout, so every
        # module initialised after this one is identical too (same model on any ep).
        if self.w1.is_meta:  # built to receive existing weights (moe.hf.patch): nothing to draw
            return
        base = int(torch.randint(0, 2**62, (1,)).item())
        d_model, d_ff = self.w1.shape[1], self.w1.shape[2]
        for j, (w, fan_in) in enumerate(((self.w1, d_model), (self.w3, d_model), (self.w2, d_ff))):
            if w is None:
                continue
            bound = 1.0 / math.sqrt(fan_in)
            for e in range(self.num_local):
                g = torch.Generator().manual_seed(base + 3 * (self.expert_offset + e) + j)
                w[e].copy_(torch.rand(w.shape[1:], generator=g).mul_(2 * bound).sub_(bound))

    def forward(
        self,
        x: torch.Tensor,
        counts,
        dest_TK: torch.Tensor | None = None,
        weights_TK: torch.Tensor | None = None,
        num_rows: int | None = None,
    ) -> torch.Tensor:
        """Rows ``x_SD`` in expert order (``counts[e]`` rows per expert, a device tensor or a list)
        -> ``[S, D]`` in that order; or, given ``dest_TK``/``weights_TK`` from
        ``routing_kernels.routing_metadata`` and the router, tokens ``x_TD`` -> each token's routed
        outputs summed with its weights, ``[T, D]`` (``num_rows``: a static bound on the kept rows)."""
        return rk.expert_ffn(
            x, counts, self.w1, self.w3, self.w2, dest_TK=dest_TK, weights_TK=weights_TK, num_rows=num_rows
        )


class DenseFFN(nn.Module):
    """A plain SwiGLU/GELU FFN; the shared expert(s) of a MoE layer and the dense blocks of a model."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "swiglu"):
        super().__init__()
        self.activation = activation
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False) if activation == "swiglu" else None
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        if self.w3 is not None:
            return self.w2(nnf.silu(self.w1(x)) * self.w3(x))
        return self.w2(nnf.gelu(self.w1(x)))
