"""The expert FFN on the CPU, written by hand one row block of one expert at a time: the forward
and backward that the lanes run (``routing_kernels.cpu.lanes``), on buffers from the pool
(``routing_kernels.cpu.pool``).

Shapes follow the project's legend (docs/design.md): T tokens, K routing slots, D model dim, F expert
hidden dim, X experts held here, S rows in expert order.

Matmuls write straight into slices of the output buffers, the elementwise work (activation, its
gradient, via aten's fused ``silu_backward``/``gelu_backward``) runs on a small scratch buffer that
is still in cache, and only the pre-activations are saved. A fresh [rows, F] temporary per
elementwise step would cost a pass over memory plus, above glibc's 32 MB mmap threshold, a page
fault per 4 KB.
"""

from __future__ import annotations

import torch

from ..reference import row_weights, source_tokens
from .lanes import Schedule, current_schedule, run_lanes
from .pool import BufferPool


def _mm_into(out, a, b, accumulate: bool):
    # weight gradients of an expert split over several row blocks add up in place
    if accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


def _zero_empty(grad_X, counts: list[int]):
    # an expert with no rows gets an exact zero gradient (its slice was never written)
    for e, n in enumerate(counts):
        if n == 0:
            grad_X[e].zero_()
    return grad_X


_silu_out = torch.ops.aten.silu.out
_silu_backward_out = torch.ops.aten.silu_backward.grad_input  # grad * dsilu(h) in one pass
_gelu_out = torch.ops.aten.gelu.out
_gelu_backward_out = torch.ops.aten.gelu_backward.grad_input


def _rows_to_tokens(
    rows_SD: torch.Tensor,
    dest_TK: torch.Tensor,
    src_S: torch.Tensor,
    out_TD: torch.Tensor,
    lanes: int,
    schedule: Schedule,
) -> torch.Tensor:
    """``out[t] = sum_k rows[dest[t, k]]`` over the kept slots, in slot order: the expert-ordered
    rows back into token order. Unlike ``routing_kernels.unpermute_combine`` the rows come already
    scaled by their combine weights, and the tokens are split between the lanes. ``rows_SD`` has one
    row more than there are kept rows, a zero row that the dropped slots read.

    When most slots are empty (expert choice: E slots, about k kept) reading every slot would cost
    E rows a token; the rows are then added by ``index_add_`` in row order instead, on this thread.
    Either way the order of the additions is fixed, so the result is too."""
    T, K = dest_TK.shape
    S = rows_SD.shape[0] - 1
    if T * K > 2 * S:
        out_TD.zero_().index_add_(0, src_S, rows_SD[:S])
        return out_TD
    index_TK = torch.where(dest_TK >= 0, dest_TK, S)
    D = rows_SD.shape[1]
    step = -(-T // lanes)
    chunk = schedule.combine_tokens

    def part(i: int) -> None:
        for t0 in range(i * step, min(T, (i + 1) * step), chunk):
            t1 = min(t0 + chunk, (i + 1) * step, T)
            if K == 1:
                torch.index_select(rows_SD, 0, index_TK[t0:t1, 0], out=out_TD[t0:t1])
            else:
                torch.sum(
                    rows_SD.index_select(0, index_TK[t0:t1].reshape(-1)).view(t1 - t0, K, D), dim=1, out=out_TD[t0:t1]
                )

    run_lanes(part, lanes, log=schedule.log)
    return out_TD


def blocks_forward(x, weights_TK, w1, w3, w2, dest_TK, counts: list[int], num_rows: int, pool: BufferPool):
    """The forward of ``ExpertBlocks`` (its docstring): returns the output and what the backward
    needs, ``(out, h1_RF, h3_RF, src_R, w_R)``. ``num_rows`` (R) bounds the kept rows S =
    sum(counts) and sizes the saved buffers, so their shapes do not depend on the routing; rows
    past S are never read. ``h3_RF`` is None for GELU; ``src_R``, ``w_R`` (each row's token and
    combine weight) are None in rows mode."""
    S, D, F = sum(counts), x.shape[1], w1.shape[2]
    if S > num_rows:
        raise ValueError(f"the counts add up to {S} rows, more than the bound num_rows={num_rows}")
    swiglu = w3 is not None
    tokens = dest_TK is not None
    src_S = w_S = None
    if tokens:
        src_S = source_tokens(dest_TK, num_rows)
        w_S = row_weights(dest_TK, weights_TK, num_rows, x.dtype)  # combine weights in row order
    # h1 (and h3) are saved, in buffers the pool keeps from step to step (sized by the bound: the
    # same shape every step)
    h1_SF = pool.empty("h1", (num_rows, F), x)
    h3_SF = pool.empty("h3", (num_rows, F), x) if swiglu else None
    schedule = current_schedule()
    lanes = schedule.lanes_for(counts, D, F)
    # tokens: the outputs' rows plus a zero row that dropped slots read (see _rows_to_tokens)
    y_SD = pool.empty("rows", (S + 1, D), x) if tokens else pool.empty("y", (num_rows, D), x)
    if tokens:
        y_SD[S].zero_()
    block = schedule.block_rows
    rows = min(S, block)
    # every buffer is taken here, on this thread: the pool is not shared with the lanes
    scratch = [
        (pool.block(f"x{i}", rows, D, x, block) if tokens else None, pool.block(f"act{i}", rows, F, x, block))
        for i in range(lanes)
    ]
    queue = schedule.queue(counts, lanes)

    def lane(i: int) -> None:
        x_BD, act_BF = scratch[i]
        while (unit := queue.take(i)) is not None:
            e, a, b, _ = unit
            act, h1 = act_BF[: b - a], h1_SF[a:b]
            if tokens:
                xe = torch.index_select(x, 0, src_S[a:b], out=x_BD[: b - a])
            else:
                xe = x[a:b]
            torch.mm(xe, w1[e], out=h1)
            if swiglu:
                h3 = h3_SF[a:b]
                torch.mm(xe, w3[e], out=h3)
                _silu_out(h1, out=act)
                act.mul_(h3)
            else:
                _gelu_out(h1, out=act)
            y = y_SD[a:b]
            torch.mm(act, w2[e], out=y)
            if tokens:
                y.mul_(w_S[a:b].unsqueeze(1))

    run_lanes(lane, lanes, queue, schedule.log)
    if tokens:
        out = _rows_to_tokens(y_SD, dest_TK, src_S[:S], pool.empty("out", (x.shape[0], D), x), lanes, schedule)
    else:
        out = y_SD
        out[S:].zero_()  # rows past the kept ones (x sized by a bound) belong to no expert
    return out, h1_SF, h3_SF, src_S, w_S


def blocks_backward(
    grad,
    x,
    w1,
    w3,
    w2,
    dest_TK,
    weights_dtype,
    counts: list[int],
    h1_SF,
    h3_SF,
    src_S,
    w_S,
    need_x: bool,
    need_w: bool,
    pool: BufferPool,
    need_params: bool = True,
):
    """The backward of ``ExpertBlocks`` from what ``blocks_forward`` returned: ``(dx, grad_weights,
    dw1, dw3, dw2)``, ``dx`` None unless ``need_x``, ``grad_weights`` (the combine weights', tokens
    mode) None unless ``need_w``, the expert weights' gradients None unless ``need_params``. A
    split backward (the zero-bubble schedules' input pass, then their weight pass: torch runs this
    node's backward once for each) asks for the inputs' gradients first and the weights' after."""
    swiglu = w3 is not None
    tokens = dest_TK is not None
    grad = grad.contiguous()
    S, F = sum(counts), h1_SF.shape[1]
    D = x.shape[1]
    need_w = tokens and need_w
    schedule = current_schedule()
    lanes = schedule.lanes_for(counts, D, F)
    dx_SD = None  # the input gradient's rows (tokens: + the zero row, like the forward's)
    if need_x:
        dx_SD = pool.empty("rows", (S + 1, D), x) if tokens else pool.empty("dx_rows", x.shape, x)
        if tokens:
            dx_SD[S].zero_()
    dw_S = x.new_empty(S) if need_w else None  # dL/d combine weight, row order
    # weight gradients: the view lent becomes p.grad itself (autograd adopts a gradient that
    # nothing else refers to), so its buffer is lent again once the training loop drops p.grad
    dw1 = dw2 = dw3 = None
    if need_params:
        dw1, dw2 = pool.empty("dw1", w1.shape, w1), pool.empty("dw2", w2.shape, w2)
        dw3 = pool.empty("dw3", w3.shape, w3) if swiglu else None
    block = schedule.block_rows
    rows = min(S, block)
    scratch = [
        (
            *(
                (pool.block(f"g{i}", rows, D, x, block), pool.block(f"x{i}", rows, D, x, block))
                if tokens
                else (None, None)
            ),
            *(pool.block(f"scratch{j}_{i}", rows, F, x, block) for j in range(4)),
        )
        for i in range(lanes)
    ]
    queue = schedule.queue(counts, lanes)

    def lane(i: int) -> None:
        g_BD, x_BD, buf_a, buf_b, buf_c, buf_d = scratch[i]
        while (unit := queue.take(i)) is not None:
            e, a, b, turn = unit
            n = b - a
            h1 = h1_SF[a:b]
            dact, silu, act, tmp = buf_a[:n], buf_b[:n], buf_c[:n], buf_d[:n]
            if tokens:
                g = torch.index_select(grad, 0, src_S[a:b], out=g_BD[:n])  # dL/d(w * y) of each row
            else:
                g = grad[a:b]
            torch.mm(g, w2[e].t(), out=dact)  # dL/d act (tokens: per unit weight)
            if swiglu:
                h3 = h3_SF[a:b]
                _silu_out(h1, out=silu)
                torch.mul(silu, h3, out=act)
            else:
                _gelu_out(h1, out=act)
            if need_w:
                # row-wise <act, dact>: a product and a row sum run 3x faster than a [1, F] x [F, 1] bmm
                torch.sum(torch.mul(act, dact, out=tmp), dim=1, out=dw_S[a:b])
            if tokens:
                w = w_S[a:b].unsqueeze(1)
                g.mul_(w)
                dact.mul_(w)
                xe = torch.index_select(x, 0, src_S[a:b], out=x_BD[:n])
            else:
                xe = x[a:b]
            if swiglu:
                torch.mul(dact, silu, out=tmp)  # dh3
                dact.mul_(h3)
                _silu_backward_out(dact, h1, grad_input=silu)  # dh1
                dh1, dh3 = silu, tmp
            else:
                _gelu_backward_out(dact, h1, grad_input=silu)
                dh1 = silu
            if need_x:
                dx = dx_SD[a:b]
                torch.mm(dh1, w1[e].t(), out=dx)
                if swiglu:
                    dx.addmm_(dh3, w3[e].t())
            if not need_params:
                continue
            # this expert's weight gradients, block after block in order (see BlockQueue)
            queue.wait_turn(e, turn)
            _mm_into(dw2[e], act.t(), g, turn > 0)
            _mm_into(dw1[e], xe.t(), dh1, turn > 0)
            if swiglu:
                _mm_into(dw3[e], xe.t(), dh3, turn > 0)
            queue.end_turn(e)

    run_lanes(lane, lanes, queue, schedule.log)
    dx = None
    if need_x:
        if tokens:
            dx = _rows_to_tokens(dx_SD, dest_TK, src_S[:S], pool.empty("dx", x.shape, x), lanes, schedule)
        else:
            dx = dx_SD
            dx[S:].zero_()  # rows past the kept ones took no part
    for dw in (dw1, dw3, dw2):
        if dw is not None:
            _zero_empty(dw, counts)
    grad_w = None
    if need_w:
        valid = dest_TK >= 0
        grad_w = torch.where(
            valid,
            dw_S[dest_TK.clamp(min=0)] if S else torch.zeros_like(dest_TK, dtype=dw_S.dtype),
            torch.zeros((), dtype=dw_S.dtype),
        ).to(weights_dtype)
    return dx, grad_w, dw1, dw3, dw2


def _engine_needs(ctx, i: int) -> bool:
    """Whether the backward running now wants the gradient of the node's input ``i``.
    ``ctx.needs_input_grad`` says only whether it requires one at all; a split backward (torch's
    pipelining: ``autograd.grad`` for the stage's inputs, then again for its weights) asks for
    some inputs per pass. Where the engine cannot tell (``autograd.grad`` asked for that leaf
    itself, or an older torch), the gradient is wanted."""
    if not ctx.needs_input_grad[i]:
        return False
    try:
        node = ctx.next_functions[ctx.edge_of[i]][0]  # the edges skip the inputs that are no tensor
        return node is None or torch._C._will_engine_execute_node(node)
    except (AttributeError, RuntimeError):
        return True


class ExpertBlocks(torch.autograd.Function):
    """Every local expert's FFN over its rows, one row block at a time, in lanes (``routing_kernels.cpu.lanes``).

    Two modes. Rows (``dest_TK`` is None): ``x`` holds rows already in expert order, ``[S, D]``,
    and so does the result (expert parallelism, between the All-to-All exchanges). Tokens: ``x`` is ``[T, D]`` in token
    order and the op folds the permutation and the weighted combine in, the local CPU path: each
    block gathers its token rows into a scratch buffer, and its outputs, scaled by the combine
    weights, go to an expert-ordered buffer that ``_rows_to_tokens`` sums into token order. The inputs
    in expert order never exist as an [S, D] buffer (at S = 49152, D = 512 that would be 100 MB
    written and read again), nor do the unscaled outputs.

    Per block: h1 = x w1, h3 = x w3 (both saved), act = silu(h1) * h3 in a scratch buffer (GELU:
    act = gelu(h1)), y = act w2. The backward recomputes act from h1, h3 instead of saving it, and
    writes the input gradient's rows like the forward's outputs. The combine-weight gradient
    ``<y_s, g_t>`` is taken as ``<act_s, g_t @ w2^T>``, both of which the backward has in cache, so y
    is never stored. Every buffer a lane writes is its own block scratch or its blocks' rows.
    """

    @staticmethod
    def forward(ctx, x, weights_TK, w1, w3, w2, dest_TK, counts, num_rows, pool):
        out, h1, h3, src, w = blocks_forward(x, weights_TK, w1, w3, w2, dest_TK, counts, num_rows, pool)
        ctx.save_for_backward(x, w1, w3, w2, src, w, dest_TK, h1, h3)
        ctx.counts, ctx.pool = counts, pool
        ctx.weights_dtype = None if weights_TK is None else weights_TK.dtype
        # the node's edges are its tensor inputs' only: input i's edge, for _engine_needs
        tensors = [i for i, a in enumerate((x, weights_TK, w1, w3, w2, dest_TK)) if isinstance(a, torch.Tensor)]
        ctx.edge_of = {i: n for n, i in enumerate(tensors)}
        return out

    @staticmethod
    def backward(ctx, grad):
        x, w1, w3, w2, src, w, dest_TK, h1, h3 = ctx.saved_tensors
        dx, grad_w, dw1, dw3, dw2 = blocks_backward(
            grad,
            x,
            w1,
            w3,
            w2,
            dest_TK,
            ctx.weights_dtype,
            ctx.counts,
            h1,
            h3,
            src,
            w,
            _engine_needs(ctx, 0),
            _engine_needs(ctx, 1),
            ctx.pool,
            any(_engine_needs(ctx, i) for i in (2, 3, 4)),
        )
        return dx, grad_w, dw1, dw3, dw2, None, None, None, None
