"""Triton kernels for token routing and the optimizer step.

Shapes follow the project's legend (docs/design.md): T tokens, K routing slots per token, D model
dim, E experts, S rows in expert order, A = T * K flat assignments, N elements of a flat optimizer
buffer, U blocks of assignments (the programs of a launch, NU of them).

Each op has three layers: a private ``@triton.jit`` kernel, a launcher (``_*_launch``)
that validates shapes and dtypes, makes inputs contiguous and picks block sizes, and the public
function with the signature of its torch reference in ``reference.py`` (autograd-aware where the op
has a backward). ``dispatch.py`` imports this module lazily, so ``import triton`` only happens once
a Triton path is actually taken.

All row moves are one program per tile of [BLOCK_T tokens, BLOCK_D columns]; a token's K
destinations are read from ``dest_TK``, so every op runs in token order and needs no inverse index
and no atomics (``dest_TK`` is a bijection from kept assignments onto the rows [0, S)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import as_rows, check_quant_args

# ---------------------------------------------------------------------------------------------
# compiled or interpreted; loop bounds from runtime arguments
# ---------------------------------------------------------------------------------------------


@triton.jit
def _loop_bound(n):
    return n


# kernels decorated while TRITON_INTERPRET=1 run on CPU tensors; tests check this flag
INTERPRETED = type(_loop_bound).__name__ == "InterpretedFunction"

if INTERPRETED:
    # Every range() over a runtime int argument takes its bound through _loop_bound: compiled, it is
    # the identity above (the kernels' sm_90 SASS is the same as with the bare argument). Interpreted,
    # that argument is a 1-element array, and Triton <= 3.6 takes a range() bound with int() of it,
    # which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars";
    # triton-lang/triton#9171, fixed in 3.7), so here the Python int is read out of the array.
    @triton.jit
    def _loop_bound(n):
        return n.handle.data.item()


# ---------------------------------------------------------------------------------------------
# routing metadata: histogram per block -> scan over blocks per expert -> destination rows
# ---------------------------------------------------------------------------------------------


@triton.jit
def _block_histogram_kernel(ids_ptr, rank_ptr, counts_EU_ptr, A, E, NU, BLOCK_A: tl.constexpr, E_PAD: tl.constexpr):
    b = tl.program_id(0)
    a = b * BLOCK_A + tl.arange(0, BLOCK_A)
    in_range = a < A
    e = tl.load(ids_ptr + a, mask=in_range, other=-1).to(tl.int32)
    # ids >= E break the contract; treating them as dropped keeps every later access in bounds
    kept = (e >= 0) & (e < E)
    cols = tl.arange(0, E_PAD)
    # experts on the rows, assignments along the last axis, so the scan runs along the last axis
    onehot_EA = (cols[:, None] == e[None, :]) & kept[None, :]
    onehot_i = onehot_EA.to(tl.int32)
    tl.store(counts_EU_ptr + cols * NU + b, tl.sum(onehot_i, axis=1), mask=cols < E)
    # stable rank within the block: how many earlier assignments of this block chose the same expert
    before = tl.cumsum(onehot_i, axis=1) - onehot_i
    rank = tl.sum(tl.where(onehot_EA, before, 0), axis=0)
    tl.store(rank_ptr + a, tl.where(kept, rank, -1).to(tl.int64), mask=in_range)


@triton.jit
def _expert_scan_kernel(counts_EU_ptr, counts_E_ptr, NU, BLOCK_U: tl.constexpr):
    # one program per expert: exclusive scan of its per-block counts, in place, and its total
    e = tl.program_id(0)
    row_ptr = counts_EU_ptr + e.to(tl.int64) * NU
    carry = tl.sum(tl.zeros([BLOCK_U], dtype=tl.int32), axis=0)
    for start in range(0, _loop_bound(NU), BLOCK_U):
        bb = start + tl.arange(0, BLOCK_U)
        m = bb < NU
        c = tl.load(row_ptr + bb, mask=m, other=0)
        tl.store(row_ptr + bb, carry + tl.cumsum(c, axis=0) - c, mask=m)
        carry += tl.sum(c, axis=0)
    tl.store(counts_E_ptr + e, carry.to(tl.int64))


@triton.jit
def _dest_kernel(
    ids_ptr, dest_ptr, base_EU_ptr, counts_E_ptr, offsets_E1_ptr, A, E, NU, BLOCK_A: tl.constexpr, E_PAD: tl.constexpr
):
    b = tl.program_id(0)
    cols = tl.arange(0, E_PAD)
    cm = cols < E
    counts = tl.load(counts_E_ptr + cols, mask=cm, other=0)
    ends = tl.cumsum(counts, axis=0)
    if b == 0:
        # offsets_E1 = [0, ends...]
        tl.store(offsets_E1_ptr + 1 + cols, ends, mask=cm)
        tl.store(offsets_E1_ptr + cols, tl.zeros([E_PAD], dtype=tl.int64), mask=cols == 0)
    # first row of this block's share of each expert's segment
    start_E = (ends - counts) + tl.load(base_EU_ptr + cols * NU + b, mask=cm, other=0).to(tl.int64)
    a = b * BLOCK_A + tl.arange(0, BLOCK_A)
    in_range = a < A
    e = tl.load(ids_ptr + a, mask=in_range, other=-1).to(tl.int32)
    kept = (e >= 0) & (e < E)
    start = tl.sum(tl.where(cols[:, None] == e[None, :], start_E[:, None], 0), axis=0)
    rank = tl.load(dest_ptr + a, mask=in_range, other=0)
    tl.store(dest_ptr + a, tl.where(kept, start + rank, -1), mask=in_range)


def _routing_metadata_launch(expert_ids_TK: torch.Tensor, num_experts: int, block_a=None, block_b=None):
    if expert_ids_TK.dim() != 2:
        raise ValueError(f"expert_ids_TK must be [T, K], got shape {tuple(expert_ids_TK.shape)}")
    if expert_ids_TK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_ids_TK must be int32 or int64, got {expert_ids_TK.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    _check_device(expert_ids_TK)
    T, K = expert_ids_TK.shape
    A = T * K
    ids_A = expert_ids_TK.contiguous().view(-1)
    dev = ids_A.device
    E = num_experts
    E_PAD = triton.next_power_of_2(E)
    # the one-hot tile is E_PAD x BLOCK_A; 4k int32 lanes (32 per thread) stay in registers
    # (16k spilled on sm_90), and more blocks only lengthen the cheap per-expert scan
    BLOCK_A = block_a or max(16, min(1024, 4096 // E_PAD))
    NU = max(1, triton.cdiv(A, BLOCK_A))
    BLOCK_U = block_b or min(1024, triton.next_power_of_2(NU))
    dest_A = torch.empty(A, dtype=torch.int64, device=dev)
    counts_EU = torch.empty(E, NU, dtype=torch.int32, device=dev)
    counts_E = torch.empty(E, dtype=torch.int64, device=dev)
    offsets_E1 = torch.empty(E + 1, dtype=torch.int64, device=dev)
    _block_histogram_kernel[(NU,)](ids_A, dest_A, counts_EU, A, E, NU, BLOCK_A=BLOCK_A, E_PAD=E_PAD)
    _expert_scan_kernel[(E,)](counts_EU, counts_E, NU, BLOCK_U=BLOCK_U)
    _dest_kernel[(NU,)](ids_A, dest_A, counts_EU, counts_E, offsets_E1, A, E, NU, BLOCK_A=BLOCK_A, E_PAD=E_PAD)
    return counts_E, offsets_E1, dest_A.view(T, K)


def routing_metadata(expert_ids_TK: torch.Tensor, num_experts: int):
    """Same contract as ``reference.routing_metadata``; bit-identical output."""
    return _routing_metadata_launch(expert_ids_TK, num_experts)


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


_ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _row_blocks(T: int, D: int, elem_bytes: int, block_t=None, block_d=None):
    # a tile row of 16 bytes per thread over 4 warps (1024 bf16 / 512 fp32 columns) keeps loads
    # vectorised; a few tokens per tile give each program ~8-16 KB in flight
    if block_d is None:
        block_d = min(triton.next_power_of_2(max(D, 1)), 2048 // elem_bytes)
    if block_t is None:
        block_t = max(1, min(triton.next_power_of_2(max(T, 1)), 4096 // block_d))
    return block_t, block_d


def _check_device(*tensors):
    dev = tensors[0].device
    for t in tensors:
        if t.device != dev:
            raise ValueError(f"all inputs must be on one device, got {t.device} and {dev}")
    if dev.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            f"Triton kernels got {dev.type} tensors; they need CUDA tensors, or TRITON_INTERPRET=1 set "
            "before routing_kernels.triton_ops is first imported"
        )


def _check_dest(dest_TK: torch.Tensor, T: int):
    if dest_TK.dim() != 2 or dest_TK.shape[0] != T:
        raise ValueError(f"dest_TK must be [T={T}, K], got shape {tuple(dest_TK.shape)}")
    if dest_TK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"dest_TK must be int32 or int64, got {dest_TK.dtype}")


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
