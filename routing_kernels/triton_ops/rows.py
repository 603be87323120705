"""Row moves: permute tokens into expert order, and unpermute-and-combine them back (forward and
backward), one program per tile of [BLOCK_T tokens, BLOCK_D columns]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import _ROW_DTYPES, _check_dest, _check_device, _loop_bound, _row_blocks

# ---------------------------------------------------------------------------------------------
# permute: x_TD -> x_SD (scatter of each token row to its K destinations); backward gathers back
# ---------------------------------------------------------------------------------------------


@triton.jit
def _permute_kernel(x_ptr, dest_ptr, out_ptr, T, D, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tm = t < T
    dm = d < D
    t64 = t.to(tl.int64)
    # each token row is read once and written K times: the minimum traffic for this op
    x = tl.load(x_ptr + t64[:, None] * D + d[None, :], mask=tm[:, None] & dm[None, :])
    for k in tl.static_range(K):
        row = tl.load(dest_ptr + t64 * K + k, mask=tm, other=-1).to(tl.int64)
        tl.store(out_ptr + row[:, None] * D + d[None, :], x, mask=(row >= 0)[:, None] & dm[None, :])


@triton.jit
def _permute_bwd_kernel(
    grad_SD_ptr, dest_ptr, grad_TD_ptr, T, D, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tm = t < T
    dm = d < D
    t64 = t.to(tl.int64)
    # the inverse of the scatter: a gather-sum of the token's K rows (fp32 accumulation)
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(K):
        row = tl.load(dest_ptr + t64 * K + k, mask=tm, other=-1).to(tl.int64)
        g = tl.load(grad_SD_ptr + row[:, None] * D + d[None, :], mask=(row >= 0)[:, None] & dm[None, :], other=0.0)
        acc += g.to(tl.float32)
    tl.store(
        grad_TD_ptr + t64[:, None] * D + d[None, :],
        acc.to(grad_TD_ptr.dtype.element_ty),
        mask=tm[:, None] & dm[None, :],
    )


def _permute_launch(x_TD, dest_TK, num_rows: int, block_t=None, block_d=None, num_warps=4):
    if x_TD.dim() != 2:
        raise ValueError(f"x_TD must be [T, D], got shape {tuple(x_TD.shape)}")
    if x_TD.dtype not in _ROW_DTYPES:
        raise ValueError(f"x_TD dtype {x_TD.dtype} is not one of {_ROW_DTYPES}")
    T, D = x_TD.shape
    _check_dest(dest_TK, T)
    _check_device(x_TD, dest_TK)
    K = dest_TK.shape[1]
    out_SD = x_TD.new_empty(num_rows, D)
    if T == 0 or D == 0 or K == 0 or num_rows == 0:
        return out_SD
    x_TD = x_TD.contiguous()
    dest_TK = dest_TK.contiguous()
    BT, BD = _row_blocks(T, D, x_TD.element_size(), block_t, block_d)
    _permute_kernel[(triton.cdiv(T, BT), triton.cdiv(D, BD))](
        x_TD, dest_TK, out_SD, T, D, K=K, BLOCK_T=BT, BLOCK_D=BD, num_warps=num_warps
    )
    return out_SD


def _permute_bwd_launch(grad_SD, dest_TK, num_tokens: int, block_t=None, block_d=None, num_warps=4):
    S, D = grad_SD.shape
    K = dest_TK.shape[1]
    grad_TD = grad_SD.new_empty(num_tokens, D)
    if num_tokens == 0 or D == 0:
        return grad_TD
    if K == 0 or S == 0:
        return grad_TD.zero_()
    grad_SD = grad_SD.contiguous()
    dest_TK = dest_TK.contiguous()
    BT, BD = _row_blocks(num_tokens, D, grad_SD.element_size(), block_t, block_d)
    grid = (triton.cdiv(num_tokens, BT), triton.cdiv(D, BD))
    _permute_bwd_kernel[grid](
        grad_SD, dest_TK, grad_TD, num_tokens, D, K=K, BLOCK_T=BT, BLOCK_D=BD, num_warps=num_warps
    )
    return grad_TD


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, dest_TK, num_rows):
        ctx.save_for_backward(dest_TK)
        ctx.num_tokens = x_TD.shape[0]
        return _permute_launch(x_TD, dest_TK, num_rows)

    @staticmethod
    def backward(ctx, grad_SD):
        (dest_TK,) = ctx.saved_tensors
        return _permute_bwd_launch(grad_SD, dest_TK, ctx.num_tokens), None, None


def permute(x_TD: torch.Tensor, dest_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Same contract as ``reference.permute``: ``out[dest[t, k]] = x[t]`` for every kept (t, k)."""
    return _Permute.apply(x_TD, dest_TK, num_rows)


# ---------------------------------------------------------------------------------------------
# unpermute and combine: out[t] = sum_k w[t, k] * y[dest[t, k]]; backward for y and for w
# ---------------------------------------------------------------------------------------------


@triton.jit
def _unpermute_combine_kernel(
    y_ptr, dest_ptr, w_ptr, out_ptr, T, D, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tm = t < T
    dm = d < D
    t64 = t.to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(K):
        row = tl.load(dest_ptr + t64 * K + k, mask=tm, other=-1).to(tl.int64)
        kept = row >= 0
        # the reference rounds the weights to the rows' dtype before the product; so do we
        w = tl.load(w_ptr + t64 * K + k, mask=kept, other=0.0).to(y_ptr.dtype.element_ty).to(tl.float32)
        y = tl.load(y_ptr + row[:, None] * D + d[None, :], mask=kept[:, None] & dm[None, :], other=0.0)
        acc += w[:, None] * y.to(tl.float32)
    tl.store(out_ptr + t64[:, None] * D + d[None, :], acc.to(out_ptr.dtype.element_ty), mask=tm[:, None] & dm[None, :])


@triton.jit
def _unpermute_combine_bwd_kernel(
    grad_ptr,
    y_ptr,
    dest_ptr,
    w_ptr,
    grad_y_ptr,
    grad_w_ptr,
    T,
    D,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    NEED_GRAD_Y: tl.constexpr,
    NEED_GRAD_W: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # one program owns whole token rows: grad_w needs a dot product over all of D, and owning the
    # row makes that a register reduction instead of atomics across column tiles
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    t64 = t.to(tl.int64)
    kcols = tl.arange(0, K_PAD)
    dot_TK = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    for d0 in range(0, _loop_bound(D), BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < D
        # the upstream gradient is read once per column tile and reused for all K slots
        g = tl.load(grad_ptr + t64[:, None] * D + d[None, :], mask=tm[:, None] & dm[None, :], other=0.0).to(tl.float32)
        for k in tl.static_range(K):
            row = tl.load(dest_ptr + t64 * K + k, mask=tm, other=-1).to(tl.int64)
            kept = row >= 0
            rmask = kept[:, None] & dm[None, :]
            if NEED_GRAD_Y:
                w = tl.load(w_ptr + t64 * K + k, mask=kept, other=0.0).to(grad_y_ptr.dtype.element_ty).to(tl.float32)
                tl.store(
                    grad_y_ptr + row[:, None] * D + d[None, :],
                    (w[:, None] * g).to(grad_y_ptr.dtype.element_ty),
                    mask=rmask,
                )
            if NEED_GRAD_W:
                y = tl.load(y_ptr + row[:, None] * D + d[None, :], mask=rmask, other=0.0).to(tl.float32)
                dot_TK += tl.where(kcols[None, :] == k, tl.sum(g * y, axis=1)[:, None], 0.0)
    if NEED_GRAD_W:
        # dropped slots read y as zeros above, so their gradient is exactly 0
        tl.store(
            grad_w_ptr + t64[:, None] * K + kcols[None, :],
            dot_TK.to(grad_w_ptr.dtype.element_ty),
            mask=tm[:, None] & (kcols[None, :] < K),
        )


def _unpermute_combine_launch(y_SD, dest_TK, weights_TK, block_t=None, block_d=None, num_warps=4):
    if y_SD.dim() != 2:
        raise ValueError(f"y_SD must be [S, D], got shape {tuple(y_SD.shape)}")
    if y_SD.dtype not in _ROW_DTYPES:
        raise ValueError(f"y_SD dtype {y_SD.dtype} is not one of {_ROW_DTYPES}")
    T = dest_TK.shape[0] if dest_TK.dim() == 2 else -1
    _check_dest(dest_TK, T)
    if weights_TK.shape != dest_TK.shape:
        raise ValueError(
            f"weights_TK shape {tuple(weights_TK.shape)} differs from dest_TK shape {tuple(dest_TK.shape)}"
        )
    if not weights_TK.is_floating_point():
        raise ValueError(f"weights_TK must be floating point, got {weights_TK.dtype}")
    _check_device(y_SD, dest_TK, weights_TK)
    K = dest_TK.shape[1]
    D = y_SD.shape[1]
    out_TD = y_SD.new_empty(T, D)
    if T == 0 or D == 0:
        return out_TD
    if K == 0 or y_SD.shape[0] == 0:
        return out_TD.zero_()
    y_SD, dest_TK, weights_TK = y_SD.contiguous(), dest_TK.contiguous(), weights_TK.contiguous()
    BT, BD = _row_blocks(T, D, y_SD.element_size(), block_t, block_d)
    grid = (triton.cdiv(T, BT), triton.cdiv(D, BD))
    _unpermute_combine_kernel[grid](
        y_SD, dest_TK, weights_TK, out_TD, T, D, K=K, BLOCK_T=BT, BLOCK_D=BD, num_warps=num_warps
    )
    return out_TD


def _unpermute_combine_bwd_launch(
    grad_TD, y_SD, dest_TK, weights_TK, need_grad_y: bool, need_grad_w: bool, block_t=None, block_d=None, num_warps=4
):
    T, K = dest_TK.shape
    S, D = y_SD.shape
    grad_y = y_SD.new_empty(S, D) if need_grad_y else None
    grad_w = weights_TK.new_empty(T, K) if need_grad_w else None
    if T == 0 or K == 0 or D == 0 or S == 0 or not (need_grad_y or need_grad_w):
        # nothing to gather: every kept row (if any) and every weight sees a zero gradient
        return (grad_y.zero_() if grad_y is not None else None), (grad_w.zero_() if grad_w is not None else None)
    grad_TD, y_SD = grad_TD.contiguous(), y_SD.contiguous()
    dest_TK, weights_TK = dest_TK.contiguous(), weights_TK.contiguous()
    # each program loops over D; few tokens per program keep enough programs to fill the chip
    if block_d is None:
        block_d = min(triton.next_power_of_2(D), 1024 if y_SD.element_size() <= 2 else 512)
    if block_t is None:
        block_t = max(1, min(triton.next_power_of_2(T), 2048 // block_d))
    grid = (triton.cdiv(T, block_t),)
    _unpermute_combine_bwd_kernel[grid](
        grad_TD,
        y_SD,
        dest_TK,
        weights_TK,
        grad_y if grad_y is not None else y_SD,  # unused pointer when the flag is off
        grad_w if grad_w is not None else weights_TK,
        T,
        D,
        K=K,
        K_PAD=triton.next_power_of_2(K),
        NEED_GRAD_Y=need_grad_y,
        NEED_GRAD_W=need_grad_w,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
    return grad_y, grad_w


class _UnpermuteCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_SD, dest_TK, weights_TK):
        ctx.save_for_backward(y_SD, dest_TK, weights_TK)
        return _unpermute_combine_launch(y_SD, dest_TK, weights_TK)

    @staticmethod
    def backward(ctx, grad_TD):
        y_SD, dest_TK, weights_TK = ctx.saved_tensors
        grad_y, grad_w = _unpermute_combine_bwd_launch(
            grad_TD, y_SD, dest_TK, weights_TK, ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        )
        return grad_y, None, grad_w


def unpermute_combine(y_SD: torch.Tensor, dest_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """Same contract as ``reference.unpermute_combine``: ``out[t] = sum_k w[t, k] * y[dest[t, k]]``."""
    return _UnpermuteCombine.apply(y_SD, dest_TK, weights_TK)
