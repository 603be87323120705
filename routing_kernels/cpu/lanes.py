"""Lanes: the CPU block path's row blocks run in parallel worker threads, and the schedule that cuts
and hands them out.

With every intra-op thread on each matmul in turn, the GEMMs of one expert block are small for two
cores' worth of BLAS threading and every elementwise op ends in a barrier; giving each thread whole
row blocks instead ("lanes", one intra-op thread each) keeps both cores busy without a barrier per
op. Measured on the 2-core benchmark machine, matmuls alone in the layer's order: 0.81 -> 0.88 of
the 2048^3 rate at S1 and 0.74 -> 0.99 at S2.

Lanes take blocks from a shared queue as they come free (``BlockQueue``) rather than from a fixed
plan: the two vCPUs here drift 5-30% apart in speed from one moment to the next, and with a fixed
plan (balanced rows) one lane sat idle for 13% of a step on average at S1 (1-29%, 10 steps).
Nothing a lane computes depends on which lane runs a block: each block writes its own rows of an
expert-ordered buffer, the rows are summed into token order afterwards with the slots in a fixed
order, and an expert's weight gradients add up block by block in block order.

``forced_schedule`` fixes the schedule (lane count, block size, which lane takes which block) so
that tests can check that claim; ``lane_count`` is the policy it overrides.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import itertools
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

# rows per block of an expert's segment: the [block, F] elementwise work (activation, its
# gradient) stays in L2/L3 between the matmuls that produce and consume it, while the matmuls stay
# large enough for the BLAS to run at its full rate
ROW_BLOCK = 1024
# tokens per step of the combine: its [block, K, D] gather stays in cache
COMBINE_BLOCK_T = 256
# below this much work per matmul (rows per expert, at most a block, x D x F multiply-adds; ~0.5 ms
# on one core) a call stays on the calling thread: the lanes' Python between ops then contends for
# the GIL. Measured, lanes against one thread on every op, 20-30 alternating steps: S1 -3%,
# S2 -4%, but a 2048-token D=64, F=256, E=8 layer (8M per matmul) +32%
LANE_MIN_MACS = 1 << 25
MAX_LANES = 8  # each lane holds its own block buffers
LANE_WAIT_S = 600.0  # a lane waiting for another lane's block longer than this raises


def lane_count(
    counts: list[int], d_model: int, d_ff: int, *, block_rows: int = ROW_BLOCK, max_lanes: int = MAX_LANES
) -> int:
    """Lanes for a pass over experts with ``counts`` rows: the most (at most ``max_lanes``) that
    share the intra-op threads evenly, each running ``threads / lanes`` of them (2 threads: 2 lanes
    of 1; 16: 8 of 2; 12: 6 of 2); or 1 (the calling thread, all intra-op threads on each op) when
    the work is small or with one thread."""
    busy = sum(1 for c in counts if c)
    threads = torch.get_num_threads()
    lanes = max(n for n in range(1, min(threads, max_lanes) + 1) if threads % n == 0)
    if lanes < 2 or busy == 0 or min(sum(counts) / busy, block_rows) * d_model * d_ff < LANE_MIN_MACS:
        return 1
    return lanes


class Block(NamedTuple):
    """Rows ``[start, end)`` of expert ``expert``'s segment, its ``index``-th block in row order."""

    expert: int
    start: int
    end: int
    index: int


class LaneFailed(RuntimeError):
    """A lane stopped because another lane failed; ``run_lanes`` raises the other lane's error."""


@dataclasses.dataclass
class ScheduleLog:
    """What ran under a ``forced_schedule``: ``lanes``, the lane count of each pass (a forward, a
    backward); ``blocks``, lane -> the blocks it ran, in order; ``lane_threads``, the intra-op
    thread count of each lane worker thread, one entry per lane and pass run off the calling thread."""

    lanes: list[int] = dataclasses.field(default_factory=list)
    blocks: dict[int, list[Block]] = dataclasses.field(default_factory=dict)
    lane_threads: list[int] = dataclasses.field(default_factory=list)


class BlockQueue:
    """Row blocks handed out in a fixed order: first blocks of every expert (largest first), then
    second blocks, and so on; the small ones come last, so the lanes finish close together, and the
    blocks of one expert lie far apart (``blocks``, the order).

    An expert's weight gradients add up block by block in block order whichever lanes run them:
    a lane calls ``wait_turn`` before it adds block i's share (returns once block i - 1's is in) and
    ``end_turn`` after. Blocks are taken in queue order, so the earliest unfinished block never
    waits: no deadlock. A lane that fails calls ``fail``, which wakes and stops every other lane.
    ``wait_s``: how long a lane waits for a turn before it raises ``TimeoutError``.

    ``lane_of``, ``on_block``, ``log``: a forced schedule's (``forced_schedule``).
    """

    def __init__(
        self,
        counts: list[int],
        block: int,
        lanes: int = 1,
        *,
        wait_s: float = LANE_WAIT_S,
        lane_of: Callable[[int], int] | None = None,
        on_block: Callable[[int, Block], None] | None = None,
        log: ScheduleLog | None = None,
    ):
        blocks = []
        for e, (n, start) in enumerate(zip(counts, [0, *itertools.accumulate(counts)])):
            parts = -(-n // block)
            blocks += [Block(e, start + n * i // parts, start + n * (i + 1) // parts, i) for i in range(parts)]
        blocks.sort(key=lambda u: (u.index, u.start - u.end))
        if lanes > 1 and len(blocks) > lanes:
            blocks = self._halve_tail(blocks, lanes)
        self.blocks = blocks
        self.wait_s = wait_s
        self._lanes = lanes
        self._lane_of = lane_of if lanes > 1 else None
        self._on_block, self._log = on_block, log
        self._next = 0
        self._turn = [0] * len(counts)
        self._failed = False
        self._cond = threading.Condition()

    @staticmethod
    def _halve_tail(blocks: list[Block], lanes: int) -> list[Block]:
        """The last ``lanes`` blocks cut in halves, first halves then second halves: the step ends
        when the slowest lane's last block does, and the others idle for up to one block meanwhile,
        now half of one. Measured at S1 (16 blocks of 1024 rows): one lane idled 2-9% of a pass with
        whole blocks. A block is cut only if no other tail block is of its expert, so every block's
        predecessor in its expert stays ahead of it in the queue; blocks are renumbered in row order."""
        head, tail = blocks[:-lanes], blocks[-lanes:]
        experts = [u.expert for u in tail]
        cut = [u.end - u.start >= 2 and experts.count(u.expert) == 1 for u in tail]
        firsts = [(e, a, (a + b) // 2 if c else b) for (e, a, b, _), c in zip(tail, cut)]
        seconds = [(e, (a + b) // 2, b) for (e, a, b, _), c in zip(tail, cut) if c]
        spans = [u[:3] for u in head] + firsts + seconds
        seen, turn = collections.Counter(), {}
        for e, a, _ in sorted(spans):
            turn[e, a] = seen[e]
            seen[e] += 1
        return [Block(e, a, b, turn[e, a]) for e, a, b in spans]

    def _done(self) -> bool:
        return self._failed or self._next == len(self.blocks)

    def take(self, lane: int = 0) -> Block | None:
        """The next block for ``lane`` to run, or None when there are none left (or a lane failed)."""
        with self._cond:
            if self._lane_of is not None:
                mine = lambda: self._done() or self._lane_of(self._next) % self._lanes == lane
                if not self._cond.wait_for(mine, self.wait_s):
                    raise TimeoutError(f"lane {lane} waited {self.wait_s} s for block {self._next}, forced its own")
            if self._done():
                return None
            block = self.blocks[self._next]
            self._next += 1
            if self._lane_of is not None:
                self._cond.notify_all()
            if self._log is not None:
                self._log.blocks.setdefault(lane, []).append(block)
        if self._on_block is not None:
            self._on_block(lane, block)
        return block

    def wait_turn(self, e: int, i: int) -> None:
        if self._turn[e] == i:
            return
        with self._cond:
            if not self._cond.wait_for(lambda: self._turn[e] == i or self._failed, self.wait_s):
                raise TimeoutError(f"a lane waited {self.wait_s} s for block {i - 1} of expert {e}")
            if self._failed:
                raise LaneFailed("another lane failed")

    def end_turn(self, e: int) -> None:
        with self._cond:
            self._turn[e] += 1
            self._cond.notify_all()

    def fail(self) -> None:
        with self._cond:
            self._failed = True
            self._cond.notify_all()


# --- the schedule ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How a pass cuts and hands out its work: ``lanes`` None lets ``lane_count`` decide."""

    lanes: int | None = None
    block_rows: int = ROW_BLOCK
    combine_tokens: int = COMBINE_BLOCK_T
    lane_of: Callable[[int], int] | None = None
    on_block: Callable[[int, Block], None] | None = None
    log: ScheduleLog | None = None

    def lanes_for(self, counts: list[int], d_model: int, d_ff: int) -> int:
        lanes = self.lanes or lane_count(counts, d_model, d_ff, block_rows=self.block_rows)
        if self.log is not None:
            self.log.lanes.append(lanes)
        return lanes

    def queue(self, counts: list[int], lanes: int) -> BlockQueue:
        return BlockQueue(counts, self.block_rows, lanes, lane_of=self.lane_of, on_block=self.on_block, log=self.log)


_schedule = Schedule()


def current_schedule() -> Schedule:
    """The schedule a pass starting now follows (the default one outside ``forced_schedule``)."""
    return _schedule


@contextlib.contextmanager
def forced_schedule(
    *,
    lanes: int | None = None,
    block_rows: int | None = None,
    combine_tokens: int | None = None,
    lane_of: Callable[[int], int] | None = None,
    on_block: Callable[[int, Block], None] | None = None,
) -> Iterator[ScheduleLog]:
    """Fix how the CPU block path (the ``cpu_blocks`` expert backend) cuts and hands out its work,
    process-wide, inside the ``with``; yields a ``ScheduleLog`` of what ran. For tests: no schedule
    may change a result by one bit, which they can only check with the schedule in their hands.

    ``lanes``: every pass (a forward, a backward) runs in exactly this many lanes, whatever its size
    (by default ``lane_count`` decides: one, the calling thread, for small work). Each lane runs
    ``max(1, torch.get_num_threads() // lanes)`` intra-op threads. ``block_rows``: rows per block of
    an expert's segment (default ``ROW_BLOCK``); tiny blocks make every segment span many blocks.
    ``combine_tokens``: tokens per step of the combine back into token order (default
    ``COMBINE_BLOCK_T``). ``lane_of``: the n-th block handed out goes to lane ``lane_of(n) % lanes``,
    and a lane whose block is not next waits for it (by default lanes take blocks as they come free);
    no deadlock, since blocks still go out in queue order. ``on_block(lane, block)``: called in the
    lane before it runs each block; what it raises fails that lane as an error in the block would.

    Arguments left None keep the enclosing ``forced_schedule``'s; the log is this one's own."""
    global _schedule
    for name, value in (("lanes", lanes), ("block_rows", block_rows), ("combine_tokens", combine_tokens)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"forced_schedule: {name}={value!r}, expected an int >= 1")
    given = dict(lanes=lanes, block_rows=block_rows, combine_tokens=combine_tokens, lane_of=lane_of, on_block=on_block)
    log = ScheduleLog()
    previous = _schedule
    _schedule = dataclasses.replace(previous, **{k: v for k, v in given.items() if v is not None}, log=log)
    try:
        yield log
    finally:
        _schedule = previous


# --- the lane threads ---------------------------------------------------------------------------

_lane_pool: tuple[int, int, int, ThreadPoolExecutor] | None = None  # (pid, lanes, threads per lane, executor)


def _init_lane_thread(threads: int) -> None:
    torch.set_num_threads(threads)
    # a thread adopts the process-wide default lazily, on its first parallel op: latch ours now,
    # while it is the default (run_lanes restores the default once every lane thread has started)
    torch.get_num_threads()


def _lane_call(fn, i: int, queue: BlockQueue | None, log: ScheduleLog | None) -> None:
    if log is not None:
        log.lane_threads.append(torch.get_num_threads())
    with torch.no_grad():  # grad mode is per thread; the lanes only fill buffers
        try:
            fn(i)
        except BaseException:
            if queue is not None:
                queue.fail()
            raise


def run_lanes(fn, lanes: int, queue: BlockQueue | None = None, log: ScheduleLog | None = None) -> None:
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
    futures = [_lane_pool[3].submit(_lane_call, fn, i, queue, log) for i in range(lanes)]
    concurrent.futures.wait(futures)
    errors = [err for err in (f.exception() for f in futures) if err is not None]
    if errors:
        raise min(errors, key=lambda err: isinstance(err, LaneFailed))


def release_lanes() -> None:
    """Stop the lane worker threads (waiting for any pass in them to end); the next pass in lanes
    starts new ones, with the thread settings of that moment."""
    global _lane_pool
    pool, _lane_pool = _lane_pool, None
    if pool is not None and pool[0] == os.getpid():
        pool[3].shutdown(wait=True)
