"""The expert FFN as one ``torch._grouped_mm`` per weight: the CUDA backend of
``routing_kernels.expert_ffn`` (bf16 on Hopper by default; see ``dispatch.expert_backend``).

Shapes follow the project's legend (docs/design.md): S rows in expert order, D model dim, F expert
hidden dim, X experts held here. Autograd differentiates the two up projections' ``_grouped_mm``;
the activation and the down projection are one function (``_ActDown``) that keeps only the hidden
projections for the backward and recomputes the activation there.

The segment ends are computed on the device from the counts (a cumulative sum), so nothing here
reads the routing on the host: the op runs under ``torch.cuda.set_sync_debug_mode("error")`` and
traces into a ``torch.compile`` graph. Rows past the last end (a row bound larger than the kept
rows) are ignored by ``_grouped_mm``, which leaves whatever the allocator held there (NaN or inf
included, and 0 x NaN is NaN in a later combine); they are set to zeros, as the loop backend
returns them, by a device-side ``where`` (no host read), which also gives them zero gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as nnf


def available() -> bool:
    return hasattr(torch, "_grouped_mm")


def _aligned_start(t: torch.Tensor) -> bool:
    # under torch.compile a tensor has no address to check (nor a traceable storage offset): the
    # starts are taken as aligned there (Inductor copies misaligned graph inputs; under another
    # backend a misaligned weight fails in _grouped_mm with its own error: force the loop backend)
    return torch.compiler.is_compiling() or t.data_ptr() % 16 == 0


def accepts(x_SD: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``_grouped_mm`` takes these operands: at least one row, contiguous rows, every
    operand's start and row strides 16-byte aligned (a ZeRO flat buffer can hand out an odd offset;
    a hidden size F of 10 fp32 values is a 40-byte stride)."""
    return (
        available()
        and x_SD.shape[0] > 0
        and x_SD.is_contiguous()
        and all(
            _aligned_start(t) and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1])
            for t in (x_SD, *weights)
        )
    )


def preferred(x_SD: torch.Tensor, w1_XDF: torch.Tensor) -> bool:
    """Where it was measured to win and checked to agree with the loop: bf16 on a Hopper GPU
    (sm_90), 2.3-28x faster than the per-expert loop at fine-grained shapes and on par at Mixtral's
    (``python -m experiments.bench.moe_layer --device cuda --grouped-mm``)."""
    return (
        x_SD.is_cuda
        and x_SD.dtype == torch.bfloat16
        and w1_XDF.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x_SD.device)[0] == 9
    )


def _activation(h1_SF, h3_SF):
    """SwiGLU's ``silu(h1) * h3`` (and silu's output, which its gradient takes), or GELU's ``gelu(h1)``."""
    if h3_SF is None:
        return nnf.gelu(h1_SF), None
    silu_SF = nnf.silu(h1_SF)
    return silu_SF * h3_SF, silu_SF


class _ActDown(torch.autograd.Function):
    """``act(h1, h3) @ w2[e]`` per segment, saving only the hidden projections ``h1`` (and ``h3``):
    the backward recomputes the activation from them, one elementwise pass, where autograd would
    keep silu's output, the product and the down projection's input as well (2F values a row
    instead of 4F; GELU 1F instead of 2F). The gradients are autograd's own operators in its order
    (``_grouped_mm`` transposed, ``silu_backward``/``gelu_backward``), so they match it bit for bit.
    The CPU block kernel keeps the same two (``routing_kernels.cpu.blocks``)."""

    @staticmethod
    def forward(ctx, h1_SF, h3_SF, w2_XFD, ends_X):
        act_SF, _ = _activation(h1_SF, h3_SF)
        ctx.save_for_backward(h1_SF, h3_SF, w2_XFD, ends_X)
        return torch._grouped_mm(act_SF, w2_XFD, offs=ends_X)

    @staticmethod
    def backward(ctx, grad_SD):
        h1_SF, h3_SF, w2_XFD, ends_X = ctx.saved_tensors
        grad_SD = grad_SD.contiguous()
        act_SF, silu_SF = _activation(h1_SF, h3_SF)
        grad_w2 = torch._grouped_mm(act_SF.t(), grad_SD, offs=ends_X) if ctx.needs_input_grad[2] else None
        del act_SF  # freed before the next [S, F] buffers: the backward holds three at most
        grad_act = torch._grouped_mm(grad_SD, w2_XFD.transpose(-2, -1), offs=ends_X)
        if h3_SF is None:
            return torch.ops.aten.gelu_backward(grad_act, h1_SF), None, grad_w2, None
        grad_h3 = grad_act * silu_SF
        del silu_SF
        grad_silu = grad_act * h3_SF
        del grad_act
        return torch.ops.aten.silu_backward(grad_silu, h1_SF), grad_h3, grad_w2, None


def expert_ffn(x_SD, counts_X: torch.Tensor, w1_XDF, w3_XDF, w2_XFD):
    """``counts_X``: rows per expert, a tensor on ``x_SD``'s device."""
    # segment ends, as _grouped_mm takes them (int32)
    ends_X = torch.cumsum(counts_X, 0).to(torch.int32)
    h1_SF = torch._grouped_mm(x_SD, w1_XDF, offs=ends_X)
    h3_SF = None if w3_XDF is None else torch._grouped_mm(x_SD, w3_XDF, offs=ends_X)
    out_SD = _ActDown.apply(h1_SF, h3_SF, w2_XFD, ends_X)
    kept_S1 = (torch.arange(out_SD.shape[0], device=out_SD.device) < ends_X[-1:]).unsqueeze(1)
    return torch.where(kept_S1, out_SD, out_SD.new_zeros(()))
