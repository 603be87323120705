"""Fused AdamW over flat buffers: torch.optim.AdamW's single-tensor step in one kernel, with an
optional low-precision copy of the updated weights."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import _check_device

# ---------------------------------------------------------------------------------------------
# fused AdamW over flat buffers
# ---------------------------------------------------------------------------------------------


@triton.jit
def _fused_adamw_kernel(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    copy_ptr,
    N,
    decay,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    neg_step_size,
    bias2_sqrt,
    eps,
    grad_scale,
    LERP_FROM_END: tl.constexpr,
    HAS_COPY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32) * grad_scale
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    # the same operations in the same order as torch.optim.AdamW's single-tensor step, with
    # round-to-nearest sqrt and division (Triton's defaults are approximate on the GPU)
    p = p * decay
    if LERP_FROM_END:  # torch.lerp switches formula at weight 0.5 for accuracy
        m = g - (g - m) * (1.0 - one_minus_beta1)
    else:
        m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps
    p = p + tl.div_rn(neg_step_size * m, denom)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_COPY:
        tl.store(copy_ptr + offs, p.to(copy_ptr.dtype.element_ty), mask=mask)


def _fused_adamw_launch(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    *,
    step,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    grad_scale,
    param_copy,
    block=None,
    num_warps=4,
):
    for name, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 (master weights and moments), got {t.dtype}")
        if not t.is_contiguous():
            # updated in place, so a silent .contiguous() copy would drop the update
            raise ValueError(f"{name} must be contiguous: it is updated in place")
    if grad.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"grad must be float32 or bfloat16, got {grad.dtype}")
    N = param.numel()
    tensors = [param, grad, exp_avg, exp_avg_sq]
    if param_copy is not None:
        if not param_copy.is_contiguous():
            raise ValueError("param_copy must be contiguous: it is written in place")
        if param_copy.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"param_copy must be float32, bfloat16 or float16, got {param_copy.dtype}")
        tensors.append(param_copy)
    for name, t in zip(("grad", "exp_avg", "exp_avg_sq", "param_copy"), tensors[1:]):
        if t.numel() != N:
            raise ValueError(f"{name} has {t.numel()} elements, param has {N}")
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    _check_device(*tensors)
    if N == 0:
        return
    grad = grad.contiguous()
    if block is None:
        block = 1024 if N >= 1024 else triton.next_power_of_2(N)
    # bias corrections in float64 on the host, as torch computes them from a Python float step
    bias1 = 1.0 - beta1**step
    bias2 = 1.0 - beta2**step
    _fused_adamw_kernel[(triton.cdiv(N, block),)](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        param_copy if param_copy is not None else param,
        N,
        1.0 - lr * weight_decay,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        -lr / bias1,
        bias2**0.5,
        eps,
        grad_scale,
        LERP_FROM_END=not abs(1.0 - beta1) < 0.5,
        HAS_COPY=param_copy is not None,
        BLOCK=block,
        num_warps=num_warps,
    )


def fused_adamw(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    grad_scale: float = 1.0,
    param_copy: torch.Tensor | None = None,
) -> None:
    """Same contract as ``reference.fused_adamw``: one in-place AdamW step over flat buffers."""
    _fused_adamw_launch(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        step=step,
        lr=float(lr),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(eps),
        weight_decay=float(weight_decay),
        grad_scale=float(grad_scale),
        param_copy=param_copy,
    )
