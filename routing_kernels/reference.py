"""Pure-torch references for the routing kernels.

These are the CPU path and the test oracle of the Triton kernels; a Triton kernel must keep the
same signature as its reference here.

Shapes follow the project's legend (docs/design.md): T tokens, K routing slots per token (top-k),
D model dim, F expert hidden dim, E experts, X experts held here, S rows in expert order (kept
assignments), A assignments (T * K).

An assignment (t, k) is *dropped* when its expert id is negative; every op skips it, and its
destination row is -1.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as nnf


def routing_metadata(expert_ids_TK: torch.Tensor, num_experts: int):
    """Counts, segment offsets and destination rows of a routing decision.

    Returns ``(counts_E, offsets_E1, dest_TK)``: assignments sent to each expert, the start row of
    each expert's segment (``E + 1`` entries, the last one the number of kept rows S), and for each
    assignment its row in expert-contiguous order. Rows within an expert keep token order (stable),
    so capacity by position and the All-to-All regrouping see tokens in their global order.

    Everything stays on the device and every shape is known from the input's: the counts are a
    scatter-add into E + 1 bins (``bincount``'s output size depends on the data, which
    ``torch.compile`` cannot trace), the rows a stable sort and its inverse permutation (a second
    sort).
    """
    T, K = expert_ids_TK.shape
    flat_A = expert_ids_TK.reshape(-1).long()
    valid_A = flat_A >= 0
    # dropped assignments sort behind every expert
    key_A = torch.where(valid_A, flat_A, torch.full_like(flat_A, num_experts))
    counts_E = torch.zeros(num_experts + 1, dtype=torch.long, device=flat_A.device)
    counts_E = counts_E.scatter_add_(0, key_A, torch.ones_like(key_A))[:num_experts]
    offsets_E1 = torch.cat([counts_E.new_zeros(1), torch.cumsum(counts_E, 0)])
    order_A = torch.argsort(key_A, stable=True)
    # each assignment's row, the inverse permutation of order_A: a second sort rather than a write
    # into an empty tensor (dest_A[order_A] = arange), which Inductor ran after a read of dest_A in
    # an inference graph (eval mode), so the experts got rows that no assignment fills
    dest_A = torch.argsort(order_A)
    dest_A = torch.where(valid_A, dest_A, torch.full_like(dest_A, -1))
    return counts_E, offsets_E1, dest_A.view(T, K)


def source_tokens(dest_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """For each row in expert order, the token it came from (the inverse of ``dest_TK``).

    ``num_rows`` may exceed the kept rows (a static bound, e.g. under capacity, so shapes do not
    depend on the routing): a row no assignment lands on gets T, one past the last token, which the
    callers clamp when reading and use as a discarded bin when scattering back."""
    T, K = dest_TK.shape
    flat = dest_TK.reshape(-1)
    token_A = torch.arange(T * K, device=flat.device) // K
    # dropped slots write to a spare last entry, cut off below: no boolean-mask indexing (its
    # output size depends on the data)
    index_A = torch.where(flat >= 0, flat, torch.full_like(flat, num_rows))
    src_S = torch.full((num_rows + 1,), T, dtype=torch.long, device=flat.device)
    return src_S.scatter_(0, index_A, token_A)[:num_rows]


def row_weights(dest_TK: torch.Tensor, weights_TK: torch.Tensor, num_rows: int, dtype) -> torch.Tensor:
    """Each row's combine weight in expert order (0 on rows no assignment lands on)."""
    flat = dest_TK.reshape(-1)
    index_A = torch.where(flat >= 0, flat, torch.full_like(flat, num_rows))
    w_S = torch.zeros(num_rows + 1, dtype=dtype, device=flat.device)
    return w_S.scatter_(0, index_A, weights_TK.reshape(-1).to(dtype))[:num_rows]


class _Permute(torch.autograd.Function):
    # forward is a gather of token rows; its backward is the inverse permutation, a scatter-add
    # of each token's K rows back into token order
    @staticmethod
    def forward(ctx, x_TD, dest_TK, num_rows):
        T = x_TD.shape[0]
        src_S = source_tokens(dest_TK, num_rows)
        ctx.save_for_backward(src_S)
        ctx.num_tokens = T
        # a row beyond the kept ones (src T) reads the last token; its gradient goes to a
        # discarded bin below
        return x_TD.index_select(0, src_S.clamp(max=max(T - 1, 0)))

    @staticmethod
    def backward(ctx, grad_SD):
        (src_S,) = ctx.saved_tensors
        grad_TD = grad_SD.new_zeros(ctx.num_tokens + 1, grad_SD.shape[1])
        grad_TD.index_add_(0, src_S, grad_SD)
        return grad_TD[: ctx.num_tokens], None, None


def permute(x_TD: torch.Tensor, dest_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Rows of ``x_TD`` in expert order: ``out[dest[t, k]] = x[t]`` for every kept (t, k).

    ``num_rows`` is at least the number of kept assignments; rows past them hold unspecified
    values and take no gradient back to ``x_TD``."""
    return _Permute.apply(x_TD, dest_TK, num_rows)


# tokens per block of the combine: the [block, K, D] gather stays in cache instead of a [T, K, D]
# temporary (100 MB at T=8192, K=6, D=512) whose fresh pages alone cost as much as the combine
_COMBINE_BLOCK_T = 256


def _combine_rows(y_SD, index_TK, w_TK, out_TD):
    """``out[t] = sum_k w[t, k] * y[index[t, k]]``, block by block over tokens."""
    T, K = index_TK.shape
    D = y_SD.shape[1]
    for t0 in range(0, T, _COMBINE_BLOCK_T):
        t1 = min(t0 + _COMBINE_BLOCK_T, T)
        rows_TKD = y_SD.index_select(0, index_TK[t0:t1].reshape(-1)).view(t1 - t0, K, D)
        # [T,1,K] @ [T,K,D] over the chunk: one batched pass instead of K weighted adds
        torch.bmm(w_TK[t0:t1].unsqueeze(1), rows_TKD, out=out_TD[t0:t1].unsqueeze(1))
    return out_TD


class _UnpermuteCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_SD, dest_TK, weights_TK):
        T, K = dest_TK.shape
        valid_TK = dest_TK >= 0
        # a dropped slot reads row 0 with weight 0 (rows from the experts are finite)
        w_TK = torch.where(valid_TK, weights_TK, torch.zeros_like(weights_TK)).to(y_SD.dtype)
        index_TK = dest_TK.clamp(min=0).long()
        ctx.save_for_backward(y_SD, dest_TK, w_TK)
        ctx.weights_dtype = weights_TK.dtype
        out_TD = y_SD.new_empty(T, y_SD.shape[1])
        if y_SD.shape[0] == 0:  # nothing kept (or no tokens): every token gets zeros
            return out_TD.zero_()
        return _combine_rows(y_SD, index_TK, w_TK, out_TD)

    @staticmethod
    def backward(ctx, grad_TD):
        y_SD, dest_TK, w_TK = ctx.saved_tensors
        T, K = dest_TK.shape
        S = y_SD.shape[0]
        # each kept row has exactly one source (t, k), so the scatter is a gather; a row past the
        # kept ones (source T) reads a clamped token and gets weight 0, hence a zero gradient
        src_S = source_tokens(dest_TK, S)
        grad_SD = grad_TD.contiguous().index_select(0, src_S.clamp(max=max(T - 1, 0)))  # dL/d(w * y), row by row
        grad_y = grad_w = None
        if ctx.needs_input_grad[2]:
            # dL/dw[t,k] = <y[dest[t,k]], grad[t]>, taken in expert order before grad_SD is scaled
            dot_S = torch.bmm(y_SD.unsqueeze(1), grad_SD.unsqueeze(2)).view(S)
            valid = dest_TK >= 0
            grad_w = torch.where(
                valid,
                dot_S[dest_TK.clamp(min=0)] if S else dest_TK.new_zeros(dest_TK.shape, dtype=dot_S.dtype),
                torch.zeros((), dtype=dot_S.dtype, device=dot_S.device),
            ).to(ctx.weights_dtype)
        if ctx.needs_input_grad[0]:
            w_S = row_weights(dest_TK, w_TK, S, w_TK.dtype)
            grad_y = grad_SD.mul_(w_S.unsqueeze(1))  # in place: no second [S, D] buffer
        return grad_y, None, grad_w


def unpermute_combine(y_SD: torch.Tensor, dest_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """Back to token order, each token's K rows summed with its routing weights.

    ``out[t] = sum_k weights[t, k] * y[dest[t, k]]`` over kept (t, k); a token with no kept
    assignment gets zeros (the residual stream carries it).
    """
    return _UnpermuteCombine.apply(y_SD, dest_TK, weights_TK)


def expert_ffn(
    x_SD: torch.Tensor, counts: list[int], w1_XDF: torch.Tensor, w3_XDF: torch.Tensor | None, w2_XFD: torch.Tensor
) -> torch.Tensor:
    """Each expert's FFN over its contiguous segment of rows (``counts[e]`` rows for expert e), one
    expert at a time, differentiated by autograd: SwiGLU ``(silu(x w1) * (x w3)) w2``, or GELU
    ``gelu(x w1) w2`` when ``w3`` is None.

    The segments and experts are taken with ``split`` and ``unbind``, whose backward assembles all
    pieces in one pass; indexing ``x[a:b]`` and ``w1[e]`` instead would give every expert a
    full-size zero gradient to add into (measured on an H200 at 64 experts: 5x slower).

    Rows past ``sum(counts)`` (``x_SD`` sized by a bound) belong to no expert: they come out as
    zeros and take no gradient.
    """
    counts = list(counts)
    tail = x_SD.shape[0] - sum(counts)
    xs = x_SD.split(counts + [tail])
    w3s = w3_XDF.unbind(0) if w3_XDF is not None else [None] * len(counts)
    out = []
    for x, w1, w3, w2 in zip(xs, w1_XDF.unbind(0), w3s, w2_XFD.unbind(0)):
        h = x @ w1
        act = nnf.silu(h) * (x @ w3) if w3 is not None else nnf.gelu(h)
        out.append(act @ w2)
    if tail:
        out.append((out[0] if out else x_SD).new_zeros(tail, w2_XFD.shape[2]))
    if not out:
        return x_SD.new_zeros(0, w2_XFD.shape[2])
    return torch.cat(out)


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
    """One AdamW step in place over flat fp32 buffers, as ``torch.optim.AdamW`` computes it.

    ``grad`` may be fp32 or bf16 and is multiplied by ``grad_scale`` first (clipping or loss
    scaling). ``param_copy``, when given (e.g. bf16 compute weights), receives the updated weights.
    """
    g = grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    param.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    bias1 = 1.0 - beta1**step
    bias2 = 1.0 - beta2**step
    denom = (exp_avg_sq.sqrt() / (bias2**0.5)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias1)
    if param_copy is not None:
        param_copy.copy_(param)


# --- block-wise quantization (ZeRO++'s qwZ and qgZ) ---------------------------------------------

QUANT_BITS = (4, 8)


def check_quant_args(bits, block) -> None:
    """Raise ValueError naming the value unless ``bits`` is 4 or 8 and ``block`` a positive int."""
    if isinstance(bits, bool) or bits not in QUANT_BITS:
        raise ValueError(f"bits={bits!r} is not supported: valid bit widths are {QUANT_BITS} (int4 or int8)")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block={block!r} must be a positive integer (elements sharing one scale)")


def as_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` as ``[rows, n]`` over its last dimension (a 0-d tensor is one row of one)."""
    n = x.shape[-1] if x.dim() else 1
    return x.reshape(math.prod(x.shape[:-1]), n), n


def quantize_blockwise(x: torch.Tensor, bits: int = 8, block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantization in blocks of ``block`` consecutive elements of the last
    dimension (the last block of each row may be shorter). Returns ``(q, scales)``: ``q`` int8 of
    ``x``'s shape with values in ``[-qmax, qmax]``, ``qmax = 2**(bits - 1) - 1`` (127 or 7; int4 values
    are held one per int8, ``pack_int4`` puts two in a byte), and ``scales`` fp32 of shape
    ``x.shape[:-1] + (ceil(x.shape[-1] / block),)``, ``scale = absmax(block) / qmax``.

    ``dequantize_blockwise(q, scales, block)`` is ``q * scale``; ``q = round(x / scale)`` (half to
    even), so per element ``|x - deq| <= scale / 2 = absmax / (2 * qmax)`` in exact arithmetic; in
    fp32 the division and the product add at most ``2 * 2**-24 * qmax * scale`` to that, so the bound
    tests check is ``scale / 2 * (1 + 2**-14)``. An all-zero block has scale 0 and dequantizes to
    zeros exactly. A non-finite element makes its block's scale non-finite, so every element of the
    block dequantizes to NaN: a NaN or inf gradient stays visible to the step's finiteness check."""
    check_quant_args(bits, block)
    if not x.is_floating_point():
        raise ValueError(f"quantize_blockwise takes a floating-point tensor, got {x.dtype}")
    qmax = 2 ** (bits - 1) - 1
    x2d, n = as_rows(x)
    nb = -(-n // block)
    xf = x2d.float()
    if nb * block != n:
        xf = nnf.pad(xf, (0, nb * block - n))
    xb = xf.view(x2d.shape[0], nb, block)
    scale = xb.abs().amax(dim=-1) / qmax if nb else xb.new_zeros(x2d.shape[0], 0)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: q = 0, no 0/0
    q = torch.round(xb / safe.unsqueeze(-1)).clamp_(-qmax, qmax).to(torch.int8)
    q = q.view(x2d.shape[0], nb * block)[:, :n].reshape(x.shape)
    return q, scale.reshape(tuple(x.shape[:-1]) + (nb,))


def dequantize_blockwise(
    q: torch.Tensor, scales: torch.Tensor, block: int = 256, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q * scale`` (in fp32, then cast to ``dtype``) for ``quantize_blockwise``'s output."""
    check_quant_args(8, block)
    q2d, n = as_rows(q)
    nb = -(-n // block)
    want = tuple(q.shape[:-1]) + (nb,)
    if tuple(scales.shape) != want:
        raise ValueError(
            f"scales has shape {tuple(scales.shape)}; q of shape {tuple(q.shape)} in blocks of {block} needs {want}"
        )
    qf = q2d.float()
    if nb * block != n:
        qf = nnf.pad(qf, (0, nb * block - n))
    out = qf.view(q2d.shape[0], nb, block) * scales.reshape(q2d.shape[0], nb, 1).float()
    return out.view(q2d.shape[0], nb * block)[:, :n].reshape(q.shape).to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int4 values (int8 in ``[-8, 7]``) two to a byte along the last dimension: element ``2i`` in
    the low nibble, ``2i + 1`` in the high one (two's complement); an odd last dimension is padded
    with a zero. Returns uint8 of shape ``q.shape[:-1] + (ceil(q.shape[-1] / 2),)``."""
    if q.dtype != torch.int8:
        raise ValueError(f"pack_int4 takes int8 values, got {q.dtype}")
    if q.shape[-1] % 2:
        q = torch.cat([q, q.new_zeros(tuple(q.shape[:-1]) + (1,))], dim=-1)
    u = q.view(torch.uint8) & 0xF
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """``pack_int4``'s inverse: the first ``n`` int4 values of each row, as int8."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_int4 takes uint8 bytes, got {packed.dtype}")
    if not 2 * packed.shape[-1] - 1 <= n <= 2 * packed.shape[-1] and not (n == 0 and packed.shape[-1] == 0):
        raise ValueError(f"{packed.shape[-1]} bytes per row hold {2 * packed.shape[-1]} int4 values, not n={n}")
    # sign-extend each nibble: shifting it into the top of an int8 and back (arithmetic shift)
    lo = (packed << 4).view(torch.int8) >> 4
    hi = packed.view(torch.int8) >> 4
    out = torch.stack([lo, hi], dim=-1).reshape(tuple(packed.shape[:-1]) + (2 * packed.shape[-1],))
    return out[..., :n]
