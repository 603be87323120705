"""The expert FFN as one ``torch._grouped_mm`` per weight: the CUDA backend of
``routing_kernels.expert_ffn`` (bf16 on Hopper by default; see ``dispatch.expert_backend``).

Shapes follow the project's legend (docs/design.md): S rows in expert order, D model dim, F expert
hidden dim, X experts held here. Autograd differentiates ``_grouped_mm`` itself.

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


def expert_ffn(x_SD, counts_X: torch.Tensor, w1_XDF, w3_XDF, w2_XFD):
    """``counts_X``: rows per expert, a tensor on ``x_SD``'s device."""
    # segment ends, as _grouped_mm takes them (int32)
    ends_X = torch.cumsum(counts_X, 0).to(torch.int32)
    h1_SF = torch._grouped_mm(x_SD, w1_XDF, offs=ends_X)
    if w3_XDF is not None:
        act_SF = nnf.silu(h1_SF) * torch._grouped_mm(x_SD, w3_XDF, offs=ends_X)
    else:
        act_SF = nnf.gelu(h1_SF)
    out_SD = torch._grouped_mm(act_SF, w2_XFD, offs=ends_X)
    kept_S1 = (torch.arange(out_SD.shape[0], device=out_SD.device) < ends_X[-1:]).unsqueeze(1)
    return torch.where(kept_S1, out_SD, out_SD.new_zeros(()))
