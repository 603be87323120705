"""Block-wise symmetric absmax quantization (ZeRO++'s qwZ and qgZ): one program per block of one
row, int8 or packed int4 with fp32 scales."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import as_rows, check_quant_args
from ._common import _ROW_DTYPES, _check_device

# ---------------------------------------------------------------------------------------------
# block-wise quantization: one program per block of one row
# ---------------------------------------------------------------------------------------------


@triton.jit
def _quantize_blockwise_kernel(x_ptr, q_ptr, s_ptr, n, nb, block, qmax, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    row = pid // nb
    i = tl.arange(0, BLOCK)
    col = (pid % nb) * block + i
    mask = (i < block) & (col < n)
    offs = row * n + col
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.div_rn(tl.max(tl.abs(x), axis=0), qmax)
    safe = tl.where(scale > 0, scale, 1.0)
    y = tl.div_rn(x, safe)
    # torch.round's half-to-even from floor and the exact fraction (floor(y + 0.5) would round
    # 0.49999997 up: y + 0.5 is not representable there)
    r = tl.floor(y)
    frac = y - r
    odd = r - 2.0 * tl.floor(r * 0.5) != 0.0
    r = tl.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)
    r = tl.minimum(tl.maximum(r, -qmax), qmax)
    tl.store(q_ptr + offs, r.to(tl.int8), mask=mask)
    tl.store(s_ptr + pid, scale)


@triton.jit
def _dequantize_blockwise_kernel(q_ptr, s_ptr, out_ptr, n, nb, block, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    row = pid // nb
    i = tl.arange(0, BLOCK)
    col = (pid % nb) * block + i
    mask = (i < block) & (col < n)
    offs = row * n + col
    q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float32)
    scale = tl.load(s_ptr + pid)
    tl.store(out_ptr + offs, (q * scale).to(out_ptr.dtype.element_ty), mask=mask)


def quantize_blockwise(x: torch.Tensor, bits: int = 8, block: int = 256):
    """Same contract as ``reference.quantize_blockwise`` (bit for bit: IEEE division, half-to-even)."""
    check_quant_args(bits, block)
    if x.dtype not in _ROW_DTYPES:
        raise ValueError(f"quantize_blockwise takes float32, bfloat16 or float16, got {x.dtype}")
    _check_device(x)
    x2d, n = as_rows(x)
    x2d = x2d.contiguous()
    nb = -(-n // block)
    q = torch.empty(x2d.shape, dtype=torch.int8, device=x.device)
    scales = torch.empty(x2d.shape[0], nb, dtype=torch.float32, device=x.device)
    if q.numel():
        _quantize_blockwise_kernel[(x2d.shape[0] * nb,)](
            x2d, q, scales, n, nb, block, float(2 ** (bits - 1) - 1), BLOCK=triton.next_power_of_2(block)
        )
    return q.reshape(x.shape), scales.reshape(tuple(x.shape[:-1]) + (nb,))


def dequantize_blockwise(q: torch.Tensor, scales: torch.Tensor, block: int = 256, dtype=torch.float32):
    """Same contract as ``reference.dequantize_blockwise``."""
    check_quant_args(8, block)
    if q.dtype != torch.int8:
        raise ValueError(f"q must be int8, got {q.dtype}")
    if dtype not in _ROW_DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    _check_device(q, scales)
    q2d, n = as_rows(q)
    q2d = q2d.contiguous()
    nb = -(-n // block)
    want = tuple(q.shape[:-1]) + (nb,)
    if tuple(scales.shape) != want:
        raise ValueError(
            f"scales has shape {tuple(scales.shape)}; q of shape {tuple(q.shape)} in blocks of {block} needs {want}"
        )
    s = scales.reshape(-1).to(torch.float32).contiguous()
    out = torch.empty(q2d.shape, dtype=dtype, device=q.device)
    if out.numel():
        _dequantize_blockwise_kernel[(q2d.shape[0] * nb,)](
            q2d, s, out, n, nb, block, BLOCK=triton.next_power_of_2(block)
        )
    return out.reshape(q.shape)
