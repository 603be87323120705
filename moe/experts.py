"""Grouped experts: every local expert's FFN over its contiguous segment of rows, as one computation.

Legend: S rows in expert order, D model dim, F expert hidden dim, E local experts.

Parameter layout (ARCHITECTURE.md contract 2): ``w1 [E, D, F]`` gate, ``w3 [E, D, F]`` up,
``w2 [E, F, D]`` down; SwiGLU is ``(silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]``, GELU is
``gelu(x @ w1[e]) @ w2[e]``.

The forward and backward are written by hand, one row block of one expert at a time: matmuls write
straight into slices of the output buffers, the elementwise work (activation, its gradient, via
aten's fused ``silu_backward``/``gelu_backward``) runs on a small scratch buffer that is still in
cache, and only the pre-activations are saved. A fresh [rows, F] temporary per elementwise step
would cost a pass over memory plus, above glibc's 32 MB mmap threshold, a page fault per 4 KB.

On a Hopper GPU in bf16, ``forward`` runs the experts as one ``torch._grouped_mm`` per weight instead
(``GroupedExperts.use_grouped_mm``); the block loop is the CPU path and the fallback elsewhere.

Two entry points: ``GroupedExperts.forward(x_SD, counts)`` on rows already in expert order (CUDA
and expert parallelism, between ``routing_kernels.permute`` and ``unpermute_combine``), and
``forward_tokens``, which folds the permutation and the weighted combine into the same block loop
(the local CPU path, ``LocalDispatcher``). The CPU path runs groups of experts in parallel "lanes"
(one worker thread with one intra-op thread each) and keeps its large buffers in a pool from step to
step (``_BufferPool``); both are explained where they are defined.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn as nn
import torch.nn.functional as F

import routing_kernels as rk


# rows per block of an expert's segment: the [block, F] elementwise work (activation, its
# gradient) stays in L2/L3 between the matmuls that produce and consume it, while the matmuls stay
# large enough for the BLAS to run at its full rate
_ROW_BLOCK = 1024


def _row_block(t: torch.Tensor) -> int:
    # CPU: blocks that keep the elementwise work in cache. GPU: one matmul per expert segment, since
    # each launch costs microseconds and a GPU matmul needs many rows to fill the machine
    return _ROW_BLOCK if t.device.type == "cpu" else 1 << 62


def _starts(counts: list[int]) -> list[int]:
    """First row of each expert's segment."""
    return [0, *itertools.accumulate(counts)][:-1]


def _blocks(counts: list[int], block: int, experts=None, starts=None):
    """``(expert, first row, end row, first block of this expert?)`` over non-empty segments, of
    every expert or of ``experts`` (with ``starts``, the first row of each segment).

    A segment longer than ``block`` is cut into equal parts of at most ``block`` rows (2100 rows
    with blocks of 2048: 1050 + 1050, not 2048 + 52, whose thin matmuls would run far slower)."""
    if starts is None:
        starts = _starts(counts)
    for e in range(len(counts)) if experts is None else experts:
        n, start = counts[e], starts[e]
        parts = -(-n // block)
        for i in range(parts):
            yield e, start + n * i // parts, start + n * (i + 1) // parts, i == 0


def _mm_into(out, a, b, accumulate: bool):
    # weight gradients of an expert split over several row blocks add up in place
    if accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


def _zero_empty(grad_E, counts: list[int]):
    # an expert with no rows gets an exact zero gradient (its slice was never written)
    for e, n in enumerate(counts):
        if n == 0:
            grad_E[e].zero_()
    return grad_E


_silu_out = torch.ops.aten.silu.out
_silu_backward_out = torch.ops.aten.silu_backward.grad_input  # grad * dsilu(h) in one pass
_gelu_out = torch.ops.aten.gelu.out
_gelu_backward_out = torch.ops.aten.gelu_backward.grad_input


class _SwiGLUExperts(torch.autograd.Function):
    """Per block: h1 = x w1, h3 = x w3 (both saved), act = silu(h1) * h3 in a scratch buffer,
    y = act w2. The backward recomputes act block by block from h1, h3 instead of saving it."""

    @staticmethod
    def forward(ctx, x_SD, w1, w3, w2, counts, pool):
        S, Fdim = x_SD.shape[0], w1.shape[2]
        h1_SF = x_SD.new_empty(S, Fdim)
        h3_SF = x_SD.new_empty(S, Fdim)
        y_SD = x_SD.new_empty(S, w2.shape[2])
        block = _row_block(x_SD)
        act_BF = x_SD.new_empty(min(S, block), Fdim)
        for e, a, b, _ in _blocks(counts, block):
            x = x_SD[a:b]
            h1, h3, act = h1_SF[a:b], h3_SF[a:b], act_BF[: b - a]
            torch.mm(x, w1[e], out=h1)
            torch.mm(x, w3[e], out=h3)
            _silu_out(h1, out=act)
            act.mul_(h3)
            torch.mm(act, w2[e], out=y_SD[a:b])
        ctx.save_for_backward(x_SD, w1, w3, w2, h1_SF, h3_SF)
        ctx.counts = counts
        ctx.pool = pool
        return y_SD

    @staticmethod
    def backward(ctx, g_SD):
        x_SD, w1, w3, w2, h1_SF, h3_SF = ctx.saved_tensors
        counts = ctx.counts
        g_SD = g_SD.contiguous()
        S, Fdim = h1_SF.shape
        # weight gradients from the pool (fixed shapes); rows in expert order change with every step
        dw1, dw3, dw2 = (ctx.pool.empty(f"dw{i}", w.shape, w) for i, w in ((1, w1), (3, w3), (2, w2)))
        need_dx = ctx.needs_input_grad[0]
        dx_SD = torch.empty_like(x_SD) if need_dx else None
        # three [block, F] scratch buffers, reused by every block
        block = _row_block(x_SD)
        rows = min(S, block)
        buf_a, buf_b, buf_c = (h1_SF.new_empty(rows, Fdim) for _ in range(3))
        for e, a, b, first in _blocks(counts, block):
            n = b - a
            x, g, h1, h3 = x_SD[a:b], g_SD[a:b], h1_SF[a:b], h3_SF[a:b]
            dact, silu, tmp = buf_a[:n], buf_b[:n], buf_c[:n]
            torch.mm(g, w2[e].t(), out=dact)  # dL/d act
            _silu_out(h1, out=silu)
            torch.mul(silu, h3, out=tmp)  # act
            _mm_into(dw2[e], tmp.t(), g, not first)
            torch.mul(dact, silu, out=tmp)  # dh3 = dact * silu(h1)
            dact.mul_(h3)
            _silu_backward_out(dact, h1, grad_input=silu)  # dh1 = dact * h3 * silu'(h1)
            dh1, dh3 = silu, tmp
            _mm_into(dw1[e], x.t(), dh1, not first)
            _mm_into(dw3[e], x.t(), dh3, not first)
            if need_dx:
                dx = dx_SD[a:b]
                torch.mm(dh1, w1[e].t(), out=dx)
                dx.addmm_(dh3, w3[e].t())
        for grad in (dw1, dw3, dw2):
            _zero_empty(grad, counts)
        return dx_SD, dw1, dw3, dw2, None, None


class _GeluExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_SD, w1, w2, counts, pool):
        S, Fdim = x_SD.shape[0], w1.shape[2]
        h_SF = x_SD.new_empty(S, Fdim)
        y_SD = x_SD.new_empty(S, w2.shape[2])
        block = _row_block(x_SD)
        act_BF = x_SD.new_empty(min(S, block), Fdim)
        for e, a, b, _ in _blocks(counts, block):
            h, act = h_SF[a:b], act_BF[: b - a]
            torch.mm(x_SD[a:b], w1[e], out=h)
            _gelu_out(h, out=act)
            torch.mm(act, w2[e], out=y_SD[a:b])
        ctx.save_for_backward(x_SD, w1, w2, h_SF)
        ctx.counts = counts
        ctx.pool = pool
        return y_SD

    @staticmethod
    def backward(ctx, g_SD):
        x_SD, w1, w2, h_SF = ctx.saved_tensors
        counts = ctx.counts
        g_SD = g_SD.contiguous()
        S, Fdim = h_SF.shape
        dw1, dw2 = ctx.pool.empty("dw1", w1.shape, w1), ctx.pool.empty("dw2", w2.shape, w2)
        need_dx = ctx.needs_input_grad[0]
        dx_SD = torch.empty_like(x_SD) if need_dx else None
        block = _row_block(x_SD)
        rows = min(S, block)
        buf_a, buf_b = (h_SF.new_empty(rows, Fdim) for _ in range(2))
        for e, a, b, first in _blocks(counts, block):
            n = b - a
            x, g, h = x_SD[a:b], g_SD[a:b], h_SF[a:b]
            dact, act = buf_a[:n], buf_b[:n]
            _gelu_out(h, out=act)
            _mm_into(dw2[e], act.t(), g, not first)
            torch.mm(g, w2[e].t(), out=dact)
            _gelu_backward_out(dact, h, grad_input=act)  # dh, over act's buffer
            _mm_into(dw1[e], x.t(), act, not first)
            if need_dx:
                torch.mm(act, w1[e].t(), out=dx_SD[a:b])
        for grad in (dw1, dw2):
            _zero_empty(grad, counts)
        return dx_SD, dw1, dw2, None, None


# below this a buffer comes straight from the heap: glibc reuses small freed blocks without faults,
# and pooling them only takes memory the step's other temporaries would have reused (measured:
# pooling 1 MB saved blocks at S2 raised faults per step from 25k to 37k; 4 MB ones at S1 cut 58k to 25k)
_POOL_MIN_BYTES = 1 << 20
_HAS_USE_COUNT = hasattr(torch._C, "_storage_Use_Count")


class _BufferPool:
    """The fused CPU path's large buffers, kept from step to step: a small caching allocator.

    Fresh memory costs a page fault per 4 KB on first touch (2.2 us each here), every step: glibc
    maps blocks above its threshold (at most 32 MB) anew and returns freed heap to the OS. A step at
    S2 (E=64, D=512, F=256) touched 130 MB of fresh pages, ~30k faults, 5% of its time: weight
    gradients (dropped by ``zero_grad(set_to_none=True)``, torch's default), the output and input
    gradient, the saved pre-activations and the block scratch buffers. CUDA has its caching
    allocator; here each buffer of a named slot is lent as a view, and lent again only when nothing
    but the pool refers to its storage any more (autograd released what it saved, the training loop
    dropped ``p.grad``, the caller dropped the output). A kept graph (``retain_graph``) or a kept
    gradient keeps its buffers. A slot keeps as many buffers as were in use at once; one asked for
    a new shape drops its free buffers of other shapes, so a changing batch size does not pile up.
    """

    def __init__(self):
        self._slots: dict[str, list[tuple[torch.Tensor, int]]] = {}  # slot -> [(buffer, use count when only we hold it)]

    @staticmethod
    def _use_count(t: torch.Tensor) -> int:
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata)

    def empty(self, slot: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape`` and ``like``'s dtype and device."""
        shape = torch.Size(shape)
        if like.device.type != "cpu" or not _HAS_USE_COUNT or shape.numel() * like.element_size() < _POOL_MIN_BYTES:
            return like.new_empty(shape)
        held = self._slots.setdefault(slot, [])
        keep = []
        for buf, base in held:
            free = self._use_count(buf) == base
            if free and buf.shape == shape and buf.dtype == like.dtype:
                return buf.view(shape)
            if not free:
                keep.append((buf, base))
        buf = like.new_empty(shape)
        keep.append((buf, self._use_count(buf)))
        self._slots[slot] = keep
        return buf.view(shape)

    def block(self, slot: str, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        """``[rows, cols]`` with ``rows <= _ROW_BLOCK``: the first rows of a ``[_ROW_BLOCK, cols]`` buffer."""
        return self.empty(slot, (_ROW_BLOCK, cols), like)[:rows] if rows <= _ROW_BLOCK else like.new_empty(rows, cols)


# --- lanes: experts in parallel on the CPU ------------------------------------------------------
#
# With every intra-op thread on each matmul in turn, the GEMMs of one expert block are small for two
# cores' worth of BLAS threading and every elementwise op ends in a barrier; giving each thread whole
# experts instead ("lanes", one intra-op thread each) keeps both cores busy without a barrier per op.
# Measured on the 2-core benchmark machine, matmuls alone in the layer's order: 0.81 -> 0.88 of the
# 2048^3 rate at S1 and 0.74 -> 0.99 at S2; the whole layer gains less (3-4%, below), since the
# lanes wait for the slower core. Each lane adds into its own token-ordered output (lane 0 into the
# real one), summed in lane order afterwards, so results do not depend on thread timing.

# below this much work per matmul (rows per expert, at most a block, x D x F multiply-adds; ~0.5 ms
# on one core) a call stays on the calling thread: the lanes' Python between ops then contends for
# the GIL. Measured, lanes against one thread on every op, 20-30 alternating steps: S1 -3%,
# S2 -4%, but a 2048-token D=64, F=256, E=8 layer (8M per matmul) +32%
_LANE_MIN_MACS = 1 << 25
_MAX_LANES = 8  # each lane beyond the first holds a [T, D] output and its own block buffers
_LANE_MAX_IMBALANCE = 1.25  # rows of the busiest lane over the mean, beyond which one lane runs
_lane_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, workers, executor)


def _lane_plan(counts: list[int], x: torch.Tensor, d_ff: int) -> list[list[int]]:
    """Experts grouped into lanes (one per intra-op thread) with balanced rows; a single lane (this
    thread, all intra-op threads on each op) when the work is small, on a GPU, with one thread, or
    when one hot expert would leave the other lanes idle."""
    everyone = [list(range(len(counts)))]
    busy = sum(1 for c in counts if c)
    lanes = min(torch.get_num_threads(), _MAX_LANES, busy)
    S = sum(counts)
    if x.device.type != "cpu" or lanes < 2 or min(S / busy, _ROW_BLOCK) * x.shape[1] * d_ff < _LANE_MIN_MACS:
        return everyone
    loads, plan = [0] * lanes, [[] for _ in range(lanes)]
    for e in sorted(range(len(counts)), key=lambda e: -counts[e]):  # largest first, to the lightest lane
        i = loads.index(min(loads))
        plan[i].append(e)
        loads[i] += counts[e]
    if max(loads) > _LANE_MAX_IMBALANCE * S / lanes:
        return everyone
    return [sorted(p) for p in plan]


def _init_lane_thread() -> None:
    torch.set_num_threads(1)
    # a thread adopts the process-wide default lazily, on its first parallel op: latch 1 now, while
    # the default is 1 (_run_lanes restores the default once every lane thread has started)
    torch.get_num_threads()


def _lane_call(fn, i: int) -> None:
    with torch.no_grad():  # grad mode is per thread; the lanes only fill buffers
        fn(i)


def _run_lanes(fn, lanes: int) -> None:
    """``fn(0)``, ..., ``fn(lanes - 1)``: on this thread for one lane, else in parallel on worker threads
    that each run one intra-op thread. Waits for every lane, then raises the first failure."""
    if lanes == 1:
        fn(0)
        return
    global _lane_pool
    pid = os.getpid()
    if _lane_pool is None or _lane_pool[0] != pid or _lane_pool[1] < lanes:  # new after a fork too
        if _lane_pool is not None and _lane_pool[0] == pid:
            _lane_pool[2].shutdown(wait=False)
        # torch.set_num_threads(1) in a lane thread also sets the default every thread started later
        # adopts: start all lane threads, then give the default back
        previous = torch.get_num_threads()
        executor = ThreadPoolExecutor(lanes, thread_name_prefix="moe-lane", initializer=_init_lane_thread)
        started = threading.Barrier(lanes)
        for f in [executor.submit(started.wait, 60.0) for _ in range(lanes)]:
            f.result()
        torch.set_num_threads(previous)
        _lane_pool = (pid, lanes, executor)
    futures = [_lane_pool[2].submit(_lane_call, fn, i) for i in range(lanes)]
    concurrent.futures.wait(futures)
    for f in futures:
        f.result()



class _FusedTokenExperts(torch.autograd.Function):
    """permute -> experts -> unpermute_combine as one pass per row block (the CPU path).

    Each block gathers its token rows into a scratch buffer, runs the expert, scales by the
    combine weights and adds into the token-ordered output; the backward gathers the output
    gradient the same way and adds the input gradient back by token. So no [S, D] buffer exists
    (rows in expert order, their outputs, their gradients): at S = 49152, D = 512 each would be
    100 MB of memory traffic each way. The combine-weight gradient ``<y_s, g_t>`` is taken as
    ``<act_s, g_t @ w2^T>``, both of which the backward has in cache, so y is never stored.
    Only h1 (and h3) are saved, as in ``_SwiGLUExperts``. Experts run in lanes (above): every buffer
    a lane writes is its own (block scratch, its output, its experts' rows and weight gradients).
    """

    @staticmethod
    def forward(ctx, x_TD, weights_TK, w1, w3, w2, dest_TK, counts, pool):
        T, D = x_TD.shape
        S, Fdim = sum(counts), w1.shape[2]
        swiglu = w3 is not None
        flat = dest_TK.reshape(-1)
        valid = flat >= 0
        kept = flat[valid]
        src_S = rk.source_tokens(dest_TK, S)
        w_S = torch.empty(S, dtype=x_TD.dtype, device=x_TD.device)  # combine weights in row order
        w_S[kept] = weights_TK.reshape(-1)[valid].to(x_TD.dtype)
        # h1 (and h3) are saved, in buffers the pool keeps from step to step (dropless: S = k*T,
        # the same shape every step)
        h1_SF = pool.empty("h1", (S, Fdim), x_TD)
        h3_SF = pool.empty("h3", (S, Fdim), x_TD) if swiglu else None
        plan = _lane_plan(counts, x_TD, Fdim)
        block = _row_block(x_TD)
        rows = min(S, block)
        # every buffer is taken here, on this thread: the pool is not shared with the lanes
        outs = [pool.empty("out" if i == 0 else f"out{i}", (T, D), x_TD) for i in range(len(plan))]
        scratch = [(pool.block(f"x{i}", rows, D, x_TD), pool.block(f"y{i}", rows, D, x_TD), pool.block(f"act{i}", rows, Fdim, x_TD))
                   for i in range(len(plan))]
        starts = _starts(counts)

        def lane(i: int) -> None:
            out_TD, (x_BD, y_BD, act_BF) = outs[i].zero_(), scratch[i]
            for e, a, b, _ in _blocks(counts, block, plan[i], starts):
                n = b - a
                src = src_S[a:b]
                x, y, act = x_BD[:n], y_BD[:n], act_BF[:n]
                h1 = h1_SF[a:b]
                torch.index_select(x_TD, 0, src, out=x)
                torch.mm(x, w1[e], out=h1)
                if swiglu:
                    h3 = h3_SF[a:b]
                    torch.mm(x, w3[e], out=h3)
                    _silu_out(h1, out=act)
                    act.mul_(h3)
                else:
                    _gelu_out(h1, out=act)
                torch.mm(act, w2[e], out=y)
                y.mul_(w_S[a:b].unsqueeze(1))
                # a token appears at most once per expert, so the rows of one block never collide
                out_TD.index_add_(0, src, y)

        _run_lanes(lane, len(plan))
        out_TD = outs[0]
        for other in outs[1:]:
            out_TD.add_(other)
        ctx.save_for_backward(x_TD, w1, w3, w2, src_S, w_S, dest_TK, h1_SF, h3_SF)
        ctx.counts = counts
        ctx.pool = pool
        ctx.weights_dtype = weights_TK.dtype
        return out_TD

    @staticmethod
    def backward(ctx, grad_TD):
        x_TD, w1, w3, w2, src_S, w_S, dest_TK, h1_SF, h3_SF = ctx.saved_tensors
        counts = ctx.counts
        swiglu = w3 is not None
        grad_TD = grad_TD.contiguous()
        T, D = x_TD.shape
        S, Fdim = src_S.shape[0], w1.shape[2]
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        pool = ctx.pool
        plan = _lane_plan(counts, x_TD, Fdim)
        dxs = [pool.empty("dx" if i == 0 else f"dx{i}", (T, D), x_TD) for i in range(len(plan))] if need_x else None
        dw_S = x_TD.new_empty(S) if need_w else None  # dL/d combine weight, row order
        # weight gradients: the view lent becomes p.grad itself (autograd adopts a gradient that
        # nothing else refers to), so its buffer is lent again once the training loop drops p.grad
        dw1, dw2 = pool.empty("dw1", w1.shape, w1), pool.empty("dw2", w2.shape, w2)
        dw3 = pool.empty("dw3", w3.shape, w3) if swiglu else None
        block = _row_block(x_TD)
        rows = min(S, block)
        scratch = [(pool.block(f"g{i}", rows, D, x_TD), pool.block(f"dx_block{i}", rows, D, x_TD),
                    *(pool.block(f"scratch{j}_{i}", rows, Fdim, x_TD) for j in range(4)))
                   for i in range(len(plan))]
        starts = _starts(counts)

        def lane(i: int) -> None:
            g_BD, dx_BD, buf_a, buf_b, buf_c, buf_d = scratch[i]
            dx_TD = dxs[i].zero_() if need_x else None
            for e, a, b, first in _blocks(counts, block, plan[i], starts):
                n = b - a
                src = src_S[a:b]
                g, h1 = g_BD[:n], h1_SF[a:b]
                dact, silu, act = buf_a[:n], buf_b[:n], buf_c[:n]
                torch.index_select(grad_TD, 0, src, out=g)  # dL/d(w * y) of each row
                torch.mm(g, w2[e].t(), out=dact)  # dL/d act, per unit weight
                if swiglu:
                    h3 = h3_SF[a:b]
                    _silu_out(h1, out=silu)
                    torch.mul(silu, h3, out=act)
                else:
                    _gelu_out(h1, out=act)
                if need_w:
                    # row-wise <act, dact>: a product and a row sum run 3x faster than a [1, F] x [F, 1] bmm
                    torch.sum(torch.mul(act, dact, out=buf_d[:n]), dim=1, out=dw_S[a:b])
                w = w_S[a:b].unsqueeze(1)
                g.mul_(w)
                dact.mul_(w)
                _mm_into(dw2[e], act.t(), g, not first)
                x = torch.index_select(x_TD, 0, src, out=g)  # g is spent: reuse it for the inputs
                if swiglu:
                    torch.mul(dact, silu, out=act)  # dh3
                    dact.mul_(h3)
                    _silu_backward_out(dact, h1, grad_input=silu)  # dh1
                    dh1, dh3 = silu, act
                else:
                    _gelu_backward_out(dact, h1, grad_input=act)
                    dh1 = act
                _mm_into(dw1[e], x.t(), dh1, not first)
                if swiglu:
                    _mm_into(dw3[e], x.t(), dh3, not first)
                if need_x:
                    dx = dx_BD[:n]
                    torch.mm(dh1, w1[e].t(), out=dx)
                    if swiglu:
                        dx.addmm_(dh3, w3[e].t())
                    dx_TD.index_add_(0, src, dx)

        _run_lanes(lane, len(plan))
        dx_TD = None
        if need_x:
            dx_TD = dxs[0]
            for other in dxs[1:]:
                dx_TD.add_(other)
        for grad in (dw1, dw3, dw2):
            if grad is not None:
                _zero_empty(grad, counts)
        grad_w = None
        if need_w:
            flat = dest_TK.reshape(-1)
            valid = flat >= 0
            grad_w = torch.zeros(flat.numel(), dtype=ctx.weights_dtype, device=x_TD.device)
            grad_w[valid] = dw_S[flat[valid]].to(ctx.weights_dtype)
            grad_w = grad_w.view(dest_TK.shape)
        return dx_TD, grad_w, dw1, dw3, dw2, None, None, None


class GroupedExperts(nn.Module):
    """``num_local`` experts; with expert parallelism this rank holds global experts
    ``[expert_offset, expert_offset + num_local)`` of ``num_global``."""

    def __init__(self, num_local: int, d_model: int, d_ff: int, activation: str = "swiglu", *, expert_offset: int = 0, num_global: int | None = None):
        super().__init__()
        self.num_local = num_local
        self.expert_offset = expert_offset
        self.num_global = num_local if num_global is None else num_global
        self.activation = activation
        self._pool = _BufferPool()  # not state: buffers reused by the fused CPU path
        self.grouped_mm: bool | None = None  # see use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_local, d_model, d_ff))
        if activation == "swiglu":
            self.w3 = nn.Parameter(torch.empty(num_local, d_model, d_ff))
        else:
            self.register_parameter("w3", None)
        self.w2 = nn.Parameter(torch.empty(num_local, d_ff, d_model))
        for p in self.parameters():
            p.expert_parallel = True  # read by gradient sync / ZeRO: shard and reduce over edp
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        # like nn.Linear's default: uniform in +-1/sqrt(fan_in). Each global expert draws from its
        # own generator, seeded from ONE draw of the global RNG: expert e gets the same weights
        # whichever rank holds it, and the global RNG advances the same on every layout, so every
        # module initialised after this one is identical too (same model on any ep).
        base = int(torch.randint(0, 2**62, (1,)).item())
        d_model, d_ff = self.w1.shape[1], self.w1.shape[2]
        for j, (w, fan_in) in enumerate(((self.w1, d_model), (self.w3, d_model), (self.w2, d_ff))):
            if w is None:
                continue
            bound = 1.0 / math.sqrt(fan_in)
            for e in range(self.num_local):
                g = torch.Generator().manual_seed(base + 3 * (self.expert_offset + e) + j)
                w[e].copy_(torch.rand(w.shape[1:], generator=g).mul_(2 * bound).sub_(bound))

    def use_grouped_mm(self, x_SD: torch.Tensor) -> bool:
        """Whether ``forward`` runs one ``torch._grouped_mm`` per weight instead of the block loop.

        ``self.grouped_mm`` decides when set (True/False); by default (None) only where it was
        measured to win and checked to agree: bf16 on a Hopper GPU (sm_90), where it runs the routed
        experts 2.6-32x faster than the per-expert loop at fine-grained shapes and on par at Mixtral's
        (``python -m experiments.bench_moe_layer --device cuda --grouped-mm``). The loop stays the CPU
        path: there the fused block loop is faster. Either way the operands must be 16-byte aligned
        (a ZeRO flat buffer could hand out an odd offset): if not, the loop runs.
        """
        use = self.grouped_mm
        if use is None:
            use = (x_SD.is_cuda and x_SD.dtype == torch.bfloat16 and self.w1.dtype == torch.bfloat16
                   and torch.cuda.get_device_capability(x_SD.device)[0] == 9)
        if not use or not hasattr(torch, "_grouped_mm") or x_SD.shape[0] == 0:
            return False
        weights = [w for w in (self.w1, self.w3, self.w2) if w is not None]
        return all(t.data_ptr() % 16 == 0 for t in (x_SD, *weights)) and x_SD.is_contiguous()

    def _grouped_forward(self, x_SD: torch.Tensor, counts: list[int]) -> torch.Tensor:
        # segment ends, as _grouped_mm takes them; autograd differentiates _grouped_mm itself
        ends = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32).to(x_SD.device, non_blocking=True)
        h1_SF = torch._grouped_mm(x_SD, self.w1, offs=ends)
        if self.activation == "swiglu":
            act_SF = F.silu(h1_SF) * torch._grouped_mm(x_SD, self.w3, offs=ends)
        else:
            act_SF = F.gelu(h1_SF)
        return torch._grouped_mm(act_SF, self.w2, offs=ends)

    def forward(self, x_SD: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if len(counts) != self.num_local:
            raise ValueError(f"got {len(counts)} segment counts for {self.num_local} local experts")
        if self.use_grouped_mm(x_SD):
            return self._grouped_forward(x_SD, counts)
        if self.activation == "swiglu":
            return _SwiGLUExperts.apply(x_SD, self.w1, self.w3, self.w2, counts, self._pool)
        return _GeluExperts.apply(x_SD, self.w1, self.w2, counts, self._pool)

    def forward_tokens(self, x_TD: torch.Tensor, dest_TK: torch.Tensor, weights_TK: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``unpermute_combine(self(permute(x_TD)), dest_TK, weights_TK)`` in one pass per row block,
        without the expert-ordered [S, D] buffers; ``dest_TK`` and ``counts`` as from
        ``routing_metadata``. The CPU path of the local dispatcher."""
        if len(counts) != self.num_local:
            raise ValueError(f"got {len(counts)} segment counts for {self.num_local} local experts")
        return _FusedTokenExperts.apply(x_TD.contiguous(), weights_TK, self.w1, self.w3, self.w2, dest_TK, counts, self._pool)


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
