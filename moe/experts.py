"""Grouped experts: every local expert's FFN over its contiguous segment of rows, as one computation.

Legend: S rows in expert order, D model dim, F expert hidden dim, E local experts.

Parameter layout (ARCHITECTURE.md contract 2): ``w1 [E, D, F]`` gate, ``w3 [E, D, F]`` up,
``w2 [E, F, D]`` down; SwiGLU is ``(silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]``, GELU is
``gelu(x @ w1[e]) @ w2[e]``.

The forward and backward are written by hand: per-expert matmuls write straight into slices of one
buffer, the elementwise work runs once over all rows, and only the two pre-activations are saved.
That keeps the layer close to the machine's matmul rate instead of paying autograd's copies.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def _segments(counts: list[int]):
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, start, start + n
        start += n


def _grouped_mm(x_SD: torch.Tensor, w_EDF: torch.Tensor, counts: list[int]) -> torch.Tensor:
    out = x_SD.new_empty(x_SD.shape[0], w_EDF.shape[2])
    for e, a, b in _segments(counts):
        torch.mm(x_SD[a:b], w_EDF[e], out=out[a:b])
    return out


def _grouped_mm_t(g_SF: torch.Tensor, w_EDF: torch.Tensor, counts: list[int], out=None, accumulate=False):
    # g @ w[e]^T per segment; accumulate adds into ``out`` (the second branch of SwiGLU's dx)
    if out is None:
        out = g_SF.new_empty(g_SF.shape[0], w_EDF.shape[1])
    for e, a, b in _segments(counts):
        if accumulate:
            out[a:b].addmm_(g_SF[a:b], w_EDF[e].t())
        else:
            torch.mm(g_SF[a:b], w_EDF[e].t(), out=out[a:b])
    return out


def _grouped_wgrad(x_SD: torch.Tensor, g_SF: torch.Tensor, counts: list[int], like: torch.Tensor) -> torch.Tensor:
    # dW[e] = x[e]^T @ g[e]; an expert with no rows gets an exact zero gradient
    grad = torch.zeros_like(like)
    for e, a, b in _segments(counts):
        torch.mm(x_SD[a:b].t(), g_SF[a:b], out=grad[e])
    return grad


def _silu_and_grad(h):
    s = torch.sigmoid(h)
    return h * s, s * (1 + h * (1 - s))


class _SwiGLUExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_SD, w1, w3, w2, counts):
        h1_SF = _grouped_mm(x_SD, w1, counts)
        h3_SF = _grouped_mm(x_SD, w3, counts)
        act_SF = F.silu(h1_SF).mul_(h3_SF)
        y_SD = _grouped_mm(act_SF, w2, counts)
        ctx.save_for_backward(x_SD, w1, w3, w2, h1_SF, h3_SF)
        ctx.counts = counts
        return y_SD

    @staticmethod
    def backward(ctx, g_SD):
        x_SD, w1, w3, w2, h1_SF, h3_SF = ctx.saved_tensors
        counts = ctx.counts
        g_SD = g_SD.contiguous()
        silu_SF, dsilu_SF = _silu_and_grad(h1_SF)
        dact_SF = _grouped_mm_t(g_SD, w2, counts)
        dw2 = _grouped_wgrad(silu_SF * h3_SF, g_SD, counts, w2)
        dh3_SF = dact_SF * silu_SF
        dh1_SF = dact_SF.mul_(h3_SF).mul_(dsilu_SF)
        dw1 = _grouped_wgrad(x_SD, dh1_SF, counts, w1)
        dw3 = _grouped_wgrad(x_SD, dh3_SF, counts, w3)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = _grouped_mm_t(dh1_SF, w1, counts)
            _grouped_mm_t(dh3_SF, w3, counts, out=dx, accumulate=True)
        return dx, dw1, dw3, dw2, None


class _GeluExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_SD, w1, w2, counts):
        h_SF = _grouped_mm(x_SD, w1, counts)
        y_SD = _grouped_mm(F.gelu(h_SF), w2, counts)
        ctx.save_for_backward(x_SD, w1, w2, h_SF)
        ctx.counts = counts
        return y_SD

    @staticmethod
    def backward(ctx, g_SD):
        x_SD, w1, w2, h_SF = ctx.saved_tensors
        counts = ctx.counts
        g_SD = g_SD.contiguous()
        with torch.enable_grad():
            h = h_SF.detach().requires_grad_(True)
            act = F.gelu(h)
        dw2 = _grouped_wgrad(act.detach(), g_SD, counts, w2)
        dact_SF = _grouped_mm_t(g_SD, w2, counts)
        (dh_SF,) = torch.autograd.grad(act, h, dact_SF)
        dw1 = _grouped_wgrad(x_SD, dh_SF, counts, w1)
        dx = _grouped_mm_t(dh_SF, w1, counts) if ctx.needs_input_grad[0] else None
        return dx, dw1, dw2, None


class GroupedExperts(nn.Module):
    """``num_local`` experts; with expert parallelism this rank holds global experts
    ``[expert_offset, expert_offset + num_local)`` of ``num_global``."""

    def __init__(self, num_local: int, d_model: int, d_ff: int, activation: str = "swiglu", *, expert_offset: int = 0, num_global: int | None = None):
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
        for p in self.parameters():
            p.expert_parallel = True  # read by gradient sync / ZeRO: shard and reduce over edp
        self.reset_parameters()

    def reset_parameters(self):
        # like nn.Linear's default: uniform in +-1/sqrt(fan_in)
        d_model, d_ff = self.w1.shape[1], self.w1.shape[2]
        for w, fan_in in ((self.w1, d_model), (self.w3, d_model), (self.w2, d_ff)):
            if w is not None:
                bound = 1.0 / math.sqrt(fan_in)
                nn.init.uniform_(w, -bound, bound)

    def forward(self, x_SD: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if len(counts) != self.num_local:
            raise ValueError(f"got {len(counts)} segment counts for {self.num_local} local experts")
        if self.activation == "swiglu":
            return _SwiGLUExperts.apply(x_SD, self.w1, self.w3, self.w2, counts)
        return _GeluExperts.apply(x_SD, self.w1, self.w2, counts)


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
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))
