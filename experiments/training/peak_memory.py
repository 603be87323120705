"""Each rank's measured peak of tensor memory, for ``summary.json`` beside the planner's prediction.

On CUDA: ``torch.cuda.max_memory_allocated`` of the rank's device, its peak statistics reset when
the meter starts (before the model is built).

On the CPU, torch keeps no allocator statistics, and the process's RSS also counts the Python
heap, the libraries and pages the allocator has not returned, so the meter asks the allocator
itself through the profiler: ``torch.profiler`` with ``profile_memory=True`` makes torch's CPU
allocator (``c10::ProfiledCPUMemoryReporter``) report every allocation and free, with its size,
from the start of the window. The peak is the high-water mark of the running sum of those sizes,
in time order: the bytes of every CPU block allocated since the meter started and still alive,
whether a tensor's storage, a view's base or a storage ``resize_`` (ZeRO-3 frees its gathered
blocks that way). Blocks allocated before the start (the corpus, whatever the caller built) are
not counted, nor are their frees. Threads the profiler does not follow (not the training thread or
autograd's) are not seen, and their frees matter: gloo's worker thread now and then drops the last
reference to a collective's buffer (an All-to-All's send rows) after the training thread has let it
go, so the free is never reported and the block would count as alive to the end (measured: one
832 KB block of four per MoE layer at ``model=small`` ep2, the peak 1-4 MB high, differently each
run). Each event carries the block's address, so a block never seen freed whose address a later
allocation takes was freed by then: the meter frees it there (``paired_high_water``). A copy the
collective library made of its input (gloo's reduce-scatter clones it) is freed, if unseen, by the
end of the engine's wait for its reductions (``_allocations``). Any other block freed unseen whose
address is never taken again still counts. The profiler records every operator too,
so the window is short: the build and the first ``train.memory_steps`` optimizer steps (the first
step allocates the optimizer state; the next ones run with it); a later step whose routing sends
more rows to this rank's experts than any of those is not seen. While the window lasts, steps run a few percent slower.
"""

from __future__ import annotations

import bisect
import contextlib
import os

import torch

from zero.reduction import WAIT_RANGE

CPU_METHOD = (
    "torch.profiler(profile_memory=True): CPU allocator's allocations and frees paired by address, "
    "high-water of their sum"
)
CUDA_METHOD = "torch.cuda.max_memory_allocated"


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's start and stop print kineto's trace lines straight to fd 2: dropped."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def paired_high_water(events) -> int:
    """The largest running sum of ``(time, address, nbytes)`` allocation (+) and free (-) events,
    in time order, each free taking its allocation's bytes (a free of a block allocated before the
    events began counts nothing), and an allocation at the address of a block still counted
    first freeing that block: its free happened where no event was recorded. An event may carry a
    fourth field, the allocation it belongs to (its index among the events): such a free (one the
    meter infers, ``_allocations``) takes that allocation only, if it is still counted, and not a
    later block at the same address."""
    return _high_water(events)[0]


def _high_water(events, stop: int | None = None) -> tuple[int, int, dict]:
    """``paired_high_water``'s walk: the peak, the position in time order where it was reached,
    and the blocks counted (address -> (bytes, allocation index)) after position ``stop``."""
    live: dict[int, tuple[int, int]] = {}
    cur = peak = at = 0
    for pos, (k, e) in enumerate(sorted(enumerate(events), key=lambda ie: ie[1][0])):
        _, ptr, n = e[:3]
        if n > 0:
            cur += n - live.get(ptr, (0, -1))[0]
            live[ptr] = (n, k)
            if cur > peak:
                peak, at = cur, pos
        elif n < 0 and not (len(e) > 3 and live.get(ptr, (0, -1))[1] != e[3]):  # else: freed already
            cur -= live.pop(ptr, (0, -1))[0]
        if pos == stop:
            break
    return peak, at, live


def _library_copy(node) -> bool:
    """An ``aten::clone`` run by a collective op itself: gloo's copy of a reduce-scatter's input."""
    clone = node.parent
    while clone is not None and clone.name != "aten::clone":
        clone = clone.parent if clone.name.startswith("aten::empty") else None
    return clone is not None and clone.parent is not None and clone.parent.name.startswith("c10d::")


def _allocations(prof) -> list[tuple]:
    return _allocation_events(prof.profiler.kineto_results.experimental_event_tree())


def census_at_peak(roots) -> list[tuple[int, tuple[str, ...]]]:
    """The blocks alive at the high-water mark of the profiler's event tree ``roots``, paired as
    the meter pairs them: each as ``(nbytes, chain)``, ``chain`` the names of the operators and
    ranges that allocated it, the innermost first (a pipeline's actions appear as
    ``PP:<stage><F|I|W|B><micro-batch>``). What the planner's parts are checked against when a
    layout's peak misses (``python -m experiments.bench.plan --part c``)."""
    nodes: list = []
    events = _allocation_events(roots, nodes)
    _, at, _ = _high_water(events)
    _, _, live = _high_water(events, stop=at)
    return [(n, _chain(nodes[k])) for n, k in live.values()]


def _chain(node) -> tuple[str, ...]:
    """The names of the operators and ranges around a profiler event, the innermost first."""
    chain, p = [], node.parent
    while p is not None:
        chain.append(p.name)
        p = p.parent
    return tuple(chain)


def _allocation_events(roots, nodes: list | None = None) -> list[tuple]:
    """``(time, address, nbytes)`` of every allocation and free the profiler recorded, and an
    inferred free for each copy a collective library made of its input: gloo's reduce-scatter
    clones its input, and the clone's last reference goes with the collective's work, on gloo's
    worker thread when that finishes last, a free the profiler does not see. Unseen, the copy
    counted to the end of the window unless a later block took its address, so a layout's peak
    came out one gradient flat high on some runs and not on others (measured: 1.57 MB on one rank
    of two identical ranks, `model=small` under ZeRO-1/2). Such a copy is gone once the engine's
    wait for its reductions returns (the ``zero.wait_reductions`` range): freed there, unless its
    free was seen before. ``nodes``, when given, receives each recorded event's profiler node, in
    the order of the events it belongs to (the inferred frees come after them all)."""
    allocs, waits = [], []
    stack = list(roots)
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        f = node.extra_fields
        if type(f).__name__ == "_ExtraFields_Allocation":
            allocs.append((node.start_time_ns, f.ptr, f.alloc_size, f.alloc_size > 0 and _library_copy(node)))
            if nodes is not None:
                nodes.append(node)
        elif node.name == WAIT_RANGE:
            waits.append(node.end_time_ns)
    waits.sort()
    events = [(t, ptr, n) for t, ptr, n, _ in allocs]
    for k, (t, ptr, n, copy) in enumerate(allocs):
        i = bisect.bisect_right(waits, t)
        if copy and i < len(waits):
            events.append((waits[i], ptr, -n, k))
    return events


class PeakMemory:
    """The meter of one rank: ``start()``, ``step_done()`` after each optimizer step, ``peak()``."""

    def __init__(self, device: torch.device, steps: int = 3):
        self.device, self.steps = device, int(steps)
        self.cuda = device.type == "cuda"
        self.method = CUDA_METHOD if self.cuda else (CPU_METHOD if self.steps > 0 else None)
        self._prof = None
        self._peak: int | None = None
        self._seen = 0

    def start(self) -> PeakMemory:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.steps > 0:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            with _quiet_stderr():
                self._prof.start()
        return self

    def step_done(self) -> None:
        self._seen += 1
        if self._prof is not None and self._seen >= self.steps:
            self._finish()

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        with _quiet_stderr():
            prof.stop()
        self._peak = paired_high_water(_allocations(prof))
        self.window_steps = self._seen

    def peak(self) -> int | None:
        """Bytes: the device's peak since ``start``; None when nothing was measured
        (``train.memory_steps=0`` on the CPU)."""
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        if self._prof is not None:
            self._finish()
        return self._peak

    def close(self) -> None:
        """Stop a window still open (a run that failed or stopped early); nothing is reported."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            with _quiet_stderr():
                prof.stop()
