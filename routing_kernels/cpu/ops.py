"""The CPU block path's entry points, ``expert_ffn`` and ``routed_expert_ffn``, and how autograd and
torch.compile see it: the ``ExpertBlocks`` autograd.Function in eager mode, the opaque custom ops
``switchyard::cpu_expert_blocks`` (and its backward) under torch.compile.

The block path reads the counts on the host (to cut blocks) and runs lanes on worker threads:
nothing dynamo can trace. Under torch.compile it is therefore one opaque custom op, forward and
backward, with fake implementations that give the output shapes from the input shapes alone (the
saved rows are sized by the static bound ``num_rows``). Eager calls keep the autograd.Function (the
same two functions run inside); ``torch.compiler.is_compiling()`` picks the op. Absent tensors (h3
for GELU, the token maps in rows mode, gradients not asked for) are empty tensors, since a custom op
returns tensors only.
"""

from __future__ import annotations

import torch

from .blocks import ExpertBlocks, blocks_backward, blocks_forward
from .pool import pool_for


def _check(x, counts, w1):
    if x.device.type != "cpu":
        raise ValueError(f"the CPU expert path got a tensor on {x.device}")
    if len(counts) != w1.shape[0]:
        raise ValueError(f"got {len(counts)} segment counts for {w1.shape[0]} experts")


def _host_counts(counts) -> list[int]:
    return counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)


def _or_empty(t, like):
    return like.new_empty(0) if t is None else t


# schemas written out rather than inferred from the annotations (older torch versions cannot read
# ``X | None`` annotations under ``from __future__ import annotations``)
@torch.library.custom_op(
    "switchyard::cpu_expert_blocks",
    mutates_args=(),
    schema=(
        "(Tensor x, Tensor counts_X, Tensor w1, Tensor? w3, Tensor w2, Tensor? dest_TK, Tensor? weights_TK,"
        " SymInt num_rows) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
)
def _op_forward(
    x: torch.Tensor,
    counts_X: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor | None,
    w2: torch.Tensor,
    dest_TK: torch.Tensor | None,
    weights_TK: torch.Tensor | None,
    num_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    out, h1, h3, src, w = blocks_forward(x, weights_TK, w1, w3, w2, dest_TK, counts_X.tolist(), num_rows, pool_for(w1))
    # an output may not be a view that another output or an input shares: the rows-mode output is
    # its own buffer, h1/h3 theirs
    return out, h1, _or_empty(h3, x), _or_empty(src, counts_X), _or_empty(w, x)


@_op_forward.register_fake
def _(x, counts_X, w1, w3, w2, dest_TK, weights_TK, num_rows):
    F, D = w1.shape[2], w2.shape[2]
    tokens = dest_TK is not None
    return (
        x.new_empty(x.shape[0], D),
        x.new_empty(num_rows, F),
        x.new_empty(num_rows if w3 is not None else 0, F),
        counts_X.new_empty(num_rows if tokens else 0),
        x.new_empty(num_rows if tokens else 0),
    )


@torch.library.custom_op(
    "switchyard::cpu_expert_blocks_backward",
    mutates_args=(),
    schema=(
        "(Tensor grad, Tensor x, Tensor counts_X, Tensor w1, Tensor? w3, Tensor w2, Tensor? dest_TK,"
        " Tensor? weights_TK, Tensor h1, Tensor h3, Tensor src, Tensor w, bool need_x, bool need_w)"
        " -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
)
def _op_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    counts_X: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor | None,
    w2: torch.Tensor,
    dest_TK: torch.Tensor | None,
    weights_TK: torch.Tensor | None,
    h1: torch.Tensor,
    h3: torch.Tensor,
    src: torch.Tensor,
    w: torch.Tensor,
    need_x: bool,
    need_w: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    weights_dtype = None if weights_TK is None else weights_TK.dtype
    dx, grad_w, dw1, dw3, dw2 = blocks_backward(
        grad,
        x,
        w1,
        w3,
        w2,
        dest_TK,
        weights_dtype,
        counts_X.tolist(),
        h1,
        h3 if w3 is not None else None,
        src,
        w,
        need_x,
        need_w,
        pool_for(w1),
    )
    return _or_empty(dx, x), _or_empty(grad_w, x), dw1, _or_empty(dw3, w1), dw2


@_op_backward.register_fake
def _(grad, x, counts_X, w1, w3, w2, dest_TK, weights_TK, h1, h3, src, w, need_x, need_w):
    need_w = need_w and dest_TK is not None
    return (
        x.new_empty(x.shape) if need_x else x.new_empty(0),
        weights_TK.new_empty(dest_TK.shape) if need_w else x.new_empty(0),
        w1.new_empty(w1.shape),
        w3.new_empty(w3.shape) if w3 is not None else w1.new_empty(0),
        w2.new_empty(w2.shape),
    )


def _op_setup_context(ctx, inputs, output):
    x, counts_X, w1, w3, w2, dest_TK, weights_TK, _ = inputs
    _, h1, h3, src, w = output
    ctx.save_for_backward(x, counts_X, w1, w3, w2, dest_TK, weights_TK, h1, h3, src, w)
    ctx.mark_non_differentiable(h1, h3, src, w)


def _op_autograd(ctx, grad, *_unused):
    x, counts_X, w1, w3, w2, dest_TK, weights_TK, h1, h3, src, w = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], dest_TK is not None and ctx.needs_input_grad[6]
    dx, grad_w, dw1, dw3, dw2 = _op_backward(
        grad, x, counts_X, w1, w3, w2, dest_TK, weights_TK, h1, h3, src, w, need_x, need_w
    )
    return (
        dx if need_x else None,
        None,
        dw1,
        dw3 if w3 is not None else None,
        dw2,
        None,
        grad_w if need_w else None,
        None,
    )


_op_forward.register_autograd(_op_autograd, setup_context=_op_setup_context)


def _run(x, weights_TK, w1, w3, w2, dest_TK, counts, num_rows: int):
    if torch.compiler.is_compiling():
        counts_X = counts if isinstance(counts, torch.Tensor) else torch.tensor(list(counts), dtype=torch.long)
        return _op_forward(x, counts_X, w1, w3, w2, dest_TK, weights_TK, num_rows)[0]
    counts = _host_counts(counts)
    _check(x, counts, w1)
    return ExpertBlocks.apply(x, weights_TK, w1, w3, w2, dest_TK, counts, num_rows, pool_for(w1))


def expert_ffn(x_SD, counts, w1, w3, w2):
    """Each expert's FFN over its contiguous segment of ``x_SD``'s rows (``counts[e]`` rows each, a
    list or a tensor; rows past their sum come out as zeros)."""
    return _run(x_SD.contiguous(), None, w1, w3, w2, None, counts, x_SD.shape[0])


def routed_expert_ffn(x_TD, dest_TK, weights_TK, counts, w1, w3, w2, num_rows: int | None = None):
    """``unpermute_combine(expert_ffn(permute(x_TD)), dest_TK, weights_TK)`` in one pass per row
    block, without the expert-ordered [S, D] buffers. ``num_rows`` bounds the kept rows (default
    every assignment, T * K)."""
    return _run(
        x_TD.contiguous(), weights_TK, w1, w3, w2, dest_TK, counts, dest_TK.numel() if num_rows is None else num_rows
    )
