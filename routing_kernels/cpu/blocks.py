"""The expert FFN on the CPU: row blocks of each expert run in parallel lanes, with buffers kept
from step to step. A backend of ``routing_kernels.expert_ffn``; nothing outside this package calls it.

Shapes follow the project's legend (docs/design.md): T tokens, K routing slots, D model dim, F expert
hidden dim, X experts held here, S rows in expert order.

The forward and backward are written by hand, one row block of one expert at a time: matmuls write
straight into slices of the output buffers, the elementwise work (activation, its gradient, via
aten's fused ``silu_backward``/``gelu_backward``) runs on a small scratch buffer that is still in
cache, and only the pre-activations are saved. A fresh [rows, F] temporary per elementwise step
would cost a pass over memory plus, above glibc's 32 MB mmap threshold, a page fault per 4 KB.

Two entry points, one implementation (``_ExpertBlocks``): ``expert_ffn(x_SD, counts, ...)`` on rows
already in expert order (expert parallelism, between the All-to-All exchanges), and
``routed_expert_ffn``, which folds the permutation and the weighted combine into the same block loop
(the local layer): the inputs in expert order never exist as an [S, D] buffer. The blocks run in
parallel "lanes" (worker threads taking blocks from a shared queue) and the large buffers stay in a
pool per expert weight (``_BufferPool``); both are explained where they are defined.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..reference import row_weights, source_tokens

# rows per block of an expert's segment: the [block, F] elementwise work (activation, its
# gradient) stays in L2/L3 between the matmuls that produce and consume it, while the matmuls stay
# large enough for the BLAS to run at its full rate
_ROW_BLOCK = 1024


def _starts(counts: list[int]) -> list[int]:
    """First row of each expert's segment."""
    return [0, *itertools.accumulate(counts)][:-1]


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


# below this a buffer comes straight from the heap: glibc reuses small freed blocks without faults,
# and pooling them only takes memory the step's other temporaries would have reused (measured:
# pooling 1 MB saved blocks at S2 raised faults per step from 25k to 37k; 4 MB ones at S1 cut 58k to 25k)
_POOL_MIN_BYTES = 1 << 20
_HAS_USE_COUNT = hasattr(torch._C, "_storage_Use_Count")


class _BufferPool:
    """The CPU path's large buffers (``_ExpertBlocks``), kept from step to step: a small caching
    allocator.

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
        self._slots: dict[
            str, list[tuple[torch.Tensor, int]]
        ] = {}  # slot -> [(buffer, use count when only we hold it)]

    @staticmethod
    def _use_count(t: torch.Tensor) -> int:
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata)

    def empty(self, slot: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape`` and ``like``'s dtype and device."""
        shape = torch.Size(shape)
        # a buffer made under inference mode is an inference tensor, which a later training step
        # could neither write in place nor save for backward: inference mode does not pool
        if (
            not _HAS_USE_COUNT
            or torch.is_inference_mode_enabled()
            or shape.numel() * like.element_size() < _POOL_MIN_BYTES
        ):
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
# row blocks instead ("lanes", one intra-op thread each) keeps both cores busy without a barrier per
# op. Measured on the 2-core benchmark machine, matmuls alone in the layer's order: 0.81 -> 0.88 of
# the 2048^3 rate at S1 and 0.74 -> 0.99 at S2.
#
# Lanes take blocks from a shared queue as they come free (``_BlockQueue``) rather than from a fixed
# plan: the two vCPUs here drift 5-30% apart in speed from one moment to the next, and with a fixed
# plan (balanced rows) one lane sat idle for 13% of a step on average at S1 (1-29%, 10 steps).
# Nothing a lane computes depends on which lane runs a block: each block writes its own rows of an
# expert-ordered buffer, the rows are summed into token order afterwards with the slots in a fixed
# order (``_rows_to_tokens``), and an expert's weight gradients add up block by block in block order.

# below this much work per matmul (rows per expert, at most a block, x D x F multiply-adds; ~0.5 ms
# on one core) a call stays on the calling thread: the lanes' Python between ops then contends for
# the GIL. Measured, lanes against one thread on every op, 20-30 alternating steps: S1 -3%,
# S2 -4%, but a 2048-token D=64, F=256, E=8 layer (8M per matmul) +32%
_LANE_MIN_MACS = 1 << 25
_MAX_LANES = 8  # each lane holds its own block buffers
_LANE_WAIT_S = 600.0  # a lane waiting for another lane's block longer than this raises
_lane_pool: tuple[int, int, int, ThreadPoolExecutor] | None = None  # (pid, lanes, threads per lane, executor)


def _lane_count(counts: list[int], x: torch.Tensor, d_ff: int) -> int:
    """Lanes for a call: the most (at most ``_MAX_LANES``) that share the intra-op threads evenly,
    each running ``threads / lanes`` of them (2 threads: 2 lanes of 1; 16: 8 of 2; 12: 6 of 2); or
    1 (this thread, all intra-op threads on each op) when the work is small or with one thread."""
    busy = sum(1 for c in counts if c)
    threads = torch.get_num_threads()
    lanes = max(n for n in range(1, min(threads, _MAX_LANES) + 1) if threads % n == 0)
    if lanes < 2 or busy == 0 or min(sum(counts) / busy, _ROW_BLOCK) * x.shape[1] * d_ff < _LANE_MIN_MACS:
        return 1
    return lanes


class _LaneFailed(RuntimeError):
    """A lane stopped because another lane failed; ``_run_lanes`` raises the other lane's error."""


class _BlockQueue:
    """Row blocks ``(expert, first row, end row, index within the expert)`` handed out in a fixed
    order, first blocks of every expert (largest first), then second blocks, and so on; the small
    ones come last, so the lanes finish close together, and the blocks of one expert lie far apart.

    An expert's weight gradients add up block by block in block order whichever lanes run them:
    a lane calls ``wait_turn`` before it adds block i's share (returns once block i - 1's is in) and
    ``end_turn`` after. Blocks are taken in queue order, so the earliest unfinished block never
    waits: no deadlock. A lane that fails calls ``fail``, which wakes and stops every other lane.
    """

    def __init__(self, counts: list[int], block: int, lanes: int = 1):
        units = []
        for e, (n, start) in enumerate(zip(counts, _starts(counts))):
            parts = -(-n // block)
            units += [(e, start + n * i // parts, start + n * (i + 1) // parts, i) for i in range(parts)]
        units.sort(key=lambda u: (u[3], u[1] - u[2]))
        if lanes > 1 and len(units) > lanes:
            units = self._halve_tail(units, lanes)
        self.units = units
        self._next = 0
        self._turn = [0] * len(counts)
        self._failed = False
        self._cond = threading.Condition()

    @staticmethod
    def _halve_tail(units, lanes: int):
        """The last ``lanes`` blocks cut in halves, first halves then second halves: the step ends
        when the slowest lane's last block does, and the others idle for up to one block meanwhile,
        now half of one. Measured at S1 (16 blocks of 1024 rows): one lane idled 2-9% of a pass with
        whole blocks. A block is cut only if no other tail block is of its expert, so every block's
        predecessor in its expert stays ahead of it in the queue; blocks are renumbered in row order."""
        head, tail = units[:-lanes], units[-lanes:]
        experts = [u[0] for u in tail]
        cut = [b - a >= 2 and experts.count(e) == 1 for e, a, b, _ in tail]
        firsts = [(e, a, (a + b) // 2 if c else b) for (e, a, b, _), c in zip(tail, cut)]
        seconds = [(e, (a + b) // 2, b) for (e, a, b, _), c in zip(tail, cut) if c]
        units = [u[:3] for u in head] + firsts + seconds
        seen, turn = collections.Counter(), {}
        for e, a, _ in sorted(units):
            turn[e, a] = seen[e]
            seen[e] += 1
        return [(e, a, b, turn[e, a]) for e, a, b in units]

    def take(self):
        with self._cond:
            if self._failed or self._next == len(self.units):
                return None
            self._next += 1
            return self.units[self._next - 1]

    def wait_turn(self, e: int, i: int) -> None:
        if self._turn[e] == i:
            return
        with self._cond:
            if not self._cond.wait_for(lambda: self._turn[e] == i or self._failed, _LANE_WAIT_S):
                raise TimeoutError(f"a lane waited {_LANE_WAIT_S} s for block {i - 1} of expert {e}")
            if self._failed:
                raise _LaneFailed("another lane failed")

    def end_turn(self, e: int) -> None:
        with self._cond:
            self._turn[e] += 1
            self._cond.notify_all()

    def fail(self) -> None:
        with self._cond:
            self._failed = True
            self._cond.notify_all()


def _init_lane_thread(threads: int) -> None:
    torch.set_num_threads(threads)
    # a thread adopts the process-wide default lazily, on its first parallel op: latch ours now,
    # while it is the default (_run_lanes restores the default once every lane thread has started)
    torch.get_num_threads()


def _lane_call(fn, i: int, queue: _BlockQueue | None) -> None:
    with torch.no_grad():  # grad mode is per thread; the lanes only fill buffers
        try:
            fn(i)
        except BaseException:
            if queue is not None:
                queue.fail()
            raise


def _run_lanes(fn, lanes: int, queue: _BlockQueue | None = None) -> None:
    """``fn(0)``, ..., ``fn(lanes - 1)``: on this thread for one lane, else in parallel on worker threads
    that each run ``threads / lanes`` intra-op threads. Waits for every lane, then raises the first
    failure (a lane stopped because another failed raises last)."""
    if lanes == 1:
        fn(0)
        return
    global _lane_pool
    pid = os.getpid()
    previous = torch.get_num_threads()
    per_lane = max(1, previous // lanes)
    if _lane_pool is None or _lane_pool[:3] != (pid, lanes, per_lane):  # new after a fork too
        if _lane_pool is not None and _lane_pool[0] == pid:
            _lane_pool[3].shutdown(wait=False)
        # torch.set_num_threads in a lane thread also sets the default every thread started later
        # adopts: start all lane threads, then give the default back
        executor = ThreadPoolExecutor(
            lanes, thread_name_prefix="moe-lane", initializer=_init_lane_thread, initargs=(per_lane,)
        )
        started = threading.Barrier(lanes)
        for f in [executor.submit(started.wait, 60.0) for _ in range(lanes)]:
            f.result()
        torch.set_num_threads(previous)
        _lane_pool = (pid, lanes, per_lane, executor)
    futures = [_lane_pool[3].submit(_lane_call, fn, i, queue) for i in range(lanes)]
    concurrent.futures.wait(futures)
    errors = [err for err in (f.exception() for f in futures) if err is not None]
    if errors:
        raise min(errors, key=lambda err: isinstance(err, _LaneFailed))


# tokens per step of the combine: its [block, K, D] gather stays in cache
_COMBINE_BLOCK_T = 256


def _rows_to_tokens(
    rows_SD: torch.Tensor, dest_TK: torch.Tensor, src_S: torch.Tensor, out_TD: torch.Tensor, lanes: int
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

    def part(i: int) -> None:
        for t0 in range(i * step, min(T, (i + 1) * step), _COMBINE_BLOCK_T):
            t1 = min(t0 + _COMBINE_BLOCK_T, (i + 1) * step, T)
            if K == 1:
                torch.index_select(rows_SD, 0, index_TK[t0:t1, 0], out=out_TD[t0:t1])
            else:
                torch.sum(
                    rows_SD.index_select(0, index_TK[t0:t1].reshape(-1)).view(t1 - t0, K, D), dim=1, out=out_TD[t0:t1]
                )

    _run_lanes(part, lanes)
    return out_TD


def _blocks_forward(x, weights_TK, w1, w3, w2, dest_TK, counts: list[int], num_rows: int, pool: _BufferPool):
    """The forward of ``_ExpertBlocks`` (its docstring): returns the output and what the backward
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
    lanes = _lane_count(counts, x, F)
    # tokens: the outputs' rows plus a zero row that dropped slots read (see _rows_to_tokens)
    y_SD = pool.empty("rows", (S + 1, D), x) if tokens else pool.empty("y", (num_rows, D), x)
    if tokens:
        y_SD[S].zero_()
    block = _ROW_BLOCK
    rows = min(S, block)
    # every buffer is taken here, on this thread: the pool is not shared with the lanes
    scratch = [
        (pool.block(f"x{i}", rows, D, x) if tokens else None, pool.block(f"act{i}", rows, F, x)) for i in range(lanes)
    ]
    queue = _BlockQueue(counts, block, lanes)

    def lane(i: int) -> None:
        x_BD, act_BF = scratch[i]
        while (unit := queue.take()) is not None:
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

    _run_lanes(lane, lanes, queue)
    if tokens:
        out = _rows_to_tokens(y_SD, dest_TK, src_S[:S], pool.empty("out", (x.shape[0], D), x), lanes)
    else:
        out = y_SD
        out[S:].zero_()  # rows past the kept ones (x sized by a bound) belong to no expert
    return out, h1_SF, h3_SF, src_S, w_S


def _blocks_backward(
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
    pool: _BufferPool,
):
    """The backward of ``_ExpertBlocks`` from what ``_blocks_forward`` returned: ``(dx, grad_weights,
    dw1, dw3, dw2)``, ``dx`` None unless ``need_x``, ``grad_weights`` (the combine weights', tokens
    mode) None unless ``need_w``."""
    swiglu = w3 is not None
    tokens = dest_TK is not None
    grad = grad.contiguous()
    S, F = sum(counts), h1_SF.shape[1]
    D = x.shape[1]
    need_w = tokens and need_w
    lanes = _lane_count(counts, x, F)
    dx_SD = None  # the input gradient's rows (tokens: + the zero row, like the forward's)
    if need_x:
        dx_SD = pool.empty("rows", (S + 1, D), x) if tokens else pool.empty("dx_rows", x.shape, x)
        if tokens:
            dx_SD[S].zero_()
    dw_S = x.new_empty(S) if need_w else None  # dL/d combine weight, row order
    # weight gradients: the view lent becomes p.grad itself (autograd adopts a gradient that
    # nothing else refers to), so its buffer is lent again once the training loop drops p.grad
    dw1, dw2 = pool.empty("dw1", w1.shape, w1), pool.empty("dw2", w2.shape, w2)
    dw3 = pool.empty("dw3", w3.shape, w3) if swiglu else None
    block = _ROW_BLOCK
    rows = min(S, block)
    scratch = [
        (
            *((pool.block(f"g{i}", rows, D, x), pool.block(f"x{i}", rows, D, x)) if tokens else (None, None)),
            *(pool.block(f"scratch{j}_{i}", rows, F, x) for j in range(4)),
        )
        for i in range(lanes)
    ]
    queue = _BlockQueue(counts, block, lanes)

    def lane(i: int) -> None:
        g_BD, x_BD, buf_a, buf_b, buf_c, buf_d = scratch[i]
        while (unit := queue.take()) is not None:
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
            # this expert's weight gradients, block after block in order (see _BlockQueue)
            queue.wait_turn(e, turn)
            _mm_into(dw2[e], act.t(), g, turn > 0)
            _mm_into(dw1[e], xe.t(), dh1, turn > 0)
            if swiglu:
                _mm_into(dw3[e], xe.t(), dh3, turn > 0)
            queue.end_turn(e)

    _run_lanes(lane, lanes, queue)
    dx = None
    if need_x:
        if tokens:
            dx = _rows_to_tokens(dx_SD, dest_TK, src_S[:S], pool.empty("dx", x.shape, x), lanes)
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


class _ExpertBlocks(torch.autograd.Function):
    """Every local expert's FFN over its rows, one row block at a time, in lanes (above).

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
        out, h1, h3, src, w = _blocks_forward(x, weights_TK, w1, w3, w2, dest_TK, counts, num_rows, pool)
        ctx.save_for_backward(x, w1, w3, w2, src, w, dest_TK, h1, h3)
        ctx.counts, ctx.pool = counts, pool
        ctx.weights_dtype = None if weights_TK is None else weights_TK.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        x, w1, w3, w2, src, w, dest_TK, h1, h3 = ctx.saved_tensors
        dx, grad_w, dw1, dw3, dw2 = _blocks_backward(
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
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            ctx.pool,
        )
        return dx, grad_w, dw1, dw3, dw2, None, None, None, None


# one pool per set of expert weights (keyed by w1, the Parameter object, which outlives ZeRO's
# ``p.data`` swaps): a layer's buffers are lent again to the same layer, step after step
_pools: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _pool_for(w1: torch.Tensor) -> _BufferPool:
    pool = _pools.get(w1)
    if pool is None:
        pool = _pools[w1] = _BufferPool()
    return pool


def _check(x, counts, w1):
    if x.device.type != "cpu":
        raise ValueError(f"the CPU expert path got a tensor on {x.device}")
    if len(counts) != w1.shape[0]:
        raise ValueError(f"got {len(counts)} segment counts for {w1.shape[0]} experts")


def _host_counts(counts) -> list[int]:
    return counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)


# --- the op as torch.compile sees it ------------------------------------------------------------
#
# The block path reads the counts on the host (to cut blocks) and runs lanes on worker threads:
# nothing dynamo can trace. Under torch.compile it is therefore one opaque custom op, forward and
# backward, with fake implementations that give the output shapes from the input shapes alone
# (the saved rows are sized by the static bound ``num_rows``). Eager calls keep the autograd.Function
# above (the same two functions run inside); ``torch.compiler.is_compiling()`` picks the op. Absent
# tensors (h3 for GELU, the token maps in rows mode, gradients not asked for) are empty tensors,
# since a custom op returns tensors only.


def _or_empty(t, like):
    return like.new_empty(0) if t is None else t


# schemas written out rather than inferred from the annotations (older torch versions cannot read
# ``X | None`` annotations under ``from __future__ import annotations``)
@torch.library.custom_op(
    "switchyard::cpu_expert_blocks",
    mutates_args=(),
    schema=(
        "(Tensor x, Tensor counts_X, Tensor w1, Tensor? w3, Tensor w2, Tensor? dest_TK, Tensor? weights_TK, SymInt num_rows)"
        " -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
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
    out, h1, h3, src, w = _blocks_forward(
        x, weights_TK, w1, w3, w2, dest_TK, counts_X.tolist(), num_rows, _pool_for(w1)
    )
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
        "(Tensor grad, Tensor x, Tensor counts_X, Tensor w1, Tensor? w3, Tensor w2, Tensor? dest_TK, Tensor? weights_TK,"
        " Tensor h1, Tensor h3, Tensor src, Tensor w, bool need_x, bool need_w) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
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
    dx, grad_w, dw1, dw3, dw2 = _blocks_backward(
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
        _pool_for(w1),
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
    return _ExpertBlocks.apply(x, weights_TK, w1, w3, w2, dest_TK, counts, num_rows, _pool_for(w1))


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
