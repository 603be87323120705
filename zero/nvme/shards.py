"""Stage 3's parameter shards in the offload files: ``ShardPool``, the few buffers a unit's shard
is read into before its all-gather.

Under ``stage=3, offload="nvme"`` no flat keeps its compute-dtype shard (``FlatGroup.shard_C``) in
memory. The shard of flat ``f`` is its optimizer range in the files' layout (``zero.nvme.pieces``:
one segment per param group, each at a multiple of 4096 elements), in the master file itself when
the compute dtype is fp32 (the compute weights then equal the masters) and else in a ``compute``
file of that dtype beside it. The optimizer step writes it: each sub-group's new compute weights are
copied into a buffer of the step's own buffer set and written back with the master and the state
(``NvmeOffload._update``), so no copy of the weights ever sits in RAM.

Reading: ``_SLOTS`` slots, each one aligned host buffer as large as the largest flat's extent in the
file and one tensor of the largest shard's size on the device (the gather's input). ``read_ahead``
starts reading a unit's flats into free slots (the I/O threads of the offload, O_DIRECT where it is
on); the gather hooks call it for the unit about to be gathered and the two after it, in forward
order before a block's forward and in reverse order before its backward (``zero.gather``), so the
reads of the next blocks overlap the current block's gather and compute. ``acquire(f)`` (in
``FlatGroup.start_gather``) waits for the read (or reads now, if it was not ahead), lays the
segments end to end into the slot's shard with zero padding, and returns it; ``release(f)`` frees
the slot once the all-gather that read it is complete. A slot is taken only between a gather's
start and its wait. Where no slot is free, a read-ahead nobody has taken yet is dropped, and if
every slot is taken, the oldest gather in flight is completed first. So the process holds
``_SLOTS`` shards of the largest flat, whatever the model's size.

Staleness: a step or a checkpoint load changes the files, so both drop every read-ahead first
(``invalidate``), and a stage-3 step frees every gathered block anyway.
"""

from __future__ import annotations

import torch

from .files import ALIGN, _aligned
from .pieces import _round_up

_SLOTS = 4  # the unit being gathered, the one prefetched after it, and one read ahead of both


class _Slot:
    def __init__(self, nbytes: int, shard_elems: int, dtype, device, pin: bool):
        self.raw = _aligned(nbytes, pin)
        self.shard = torch.empty(shard_elems, dtype=dtype, device=device)
        self.flat = None  # whose shard is (being) read into it
        self.taken = False  # a gather reads it
        self.assembled = False
        self.pending: list = []
        self.event = None  # a CUDA copy out of raw

    def wait_io(self) -> None:
        for fut in self.pending:
            fut.result()
        self.pending = []

    def clear(self) -> None:
        self.wait_io()
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        self.flat, self.taken, self.assembled = None, False, False


class ShardPool:
    """The stage-3 shards of ``flats`` read from ``offload``'s files (see the module docstring)."""

    def __init__(self, offload, flats, device, slots: int | None = None):
        self.offload = offload
        self.slot = offload.compute_slot
        self.dtype = offload.slots[self.slot][1]
        self.isz = self.dtype.itemsize
        self.device = torch.device(device)
        # per flat: its segments as (shard offset, file offset, elements) and its file extent
        self.layout: dict[int, tuple[list, int, int]] = {}
        for f in flats:
            lo = f.opt_range[0]
            segs = [(s.a - lo, s.off, s.b - s.a) for s in offload.plan.segments if s.flat is f]
            start = segs[0][1] if segs else 0
            end = segs[-1][1] + segs[-1][2] if segs else 0
            self.layout[id(f)] = (segs, start, end)
        nbytes = max([_round_up((e - s) * self.isz, ALIGN) for _, s, e in self.layout.values()] + [0])
        elems = max([f.shard_numel for f in flats] + [0])
        pin = self.device.type == "cuda"
        self.slots = [_Slot(nbytes, elems, self.dtype, self.device, pin) for _ in range(slots or _SLOTS)]
        self.stats = {"reads": 0, "read_aheads": 0, "dropped": 0, "waited_gathers": 0}

    def _slot_of(self, f) -> _Slot | None:
        return next((s for s in self.slots if s.flat is f), None)

    def _submit(self, s: _Slot, f) -> None:
        segs, start, end = self.layout[id(f)]
        if s.event is not None:  # the last shard's copy to the device read these bytes
            s.event.synchronize()
            s.event = None
        s.flat, s.taken, s.assembled = f, False, False
        if end > start:
            n = _round_up((end - start) * self.isz, ALIGN)
            s.pending = self.offload._io(False, self.slot, s.raw[:n], start * self.isz)
        self.stats["reads"] += 1

    def _free_slot(self, evict: bool) -> _Slot | None:
        """A slot with nothing in it; with ``evict``, one freed (a read-ahead dropped, else the
        oldest gather in flight completed) when none is."""
        free = next((s for s in self.slots if s.flat is None), None)
        if free is not None or not evict:
            return free
        ahead = next((s for s in self.slots if not s.taken), None)
        if ahead is not None:
            ahead.clear()
            self.stats["dropped"] += 1
            return ahead
        oldest = self.slots[0]  # every slot is read by a gather in flight: complete the oldest
        self.stats["waited_gathers"] += 1
        oldest.flat.wait_gather()  # its completion releases the slot
        if oldest.flat is not None:
            raise RuntimeError("zero.nvme.shards: a completed gather did not release its shard's slot")
        return oldest

    def read_ahead(self, flats) -> None:
        """Start reading each flat's shard (in order) into a free slot, while there is one."""
        for f in flats:
            if id(f) not in self.layout or f.is_gathered() or f.gather_handle is not None or self._slot_of(f):
                continue
            s = self._free_slot(evict=False)
            if s is None:
                return
            self._submit(s, f)
            self.stats["read_aheads"] += 1

    def acquire(self, f) -> torch.Tensor:
        """Flat ``f``'s shard (``f.shard_numel`` elements of the compute dtype on the device), read
        from the files; held until ``release(f)``."""
        s = self._slot_of(f)
        if s is None:
            s = self._free_slot(evict=True)
            self._submit(s, f)
        s.taken = True
        # the slot moves to the end: the first taken slot is the oldest gather in flight
        self.slots.remove(s)
        self.slots.append(s)
        out = s.shard[: f.shard_numel]
        if not s.assembled:
            s.wait_io()
            segs, start, _ = self.layout[id(f)]
            raw = s.raw.view(self.dtype)
            covered = 0
            for a, off, n in segs:
                if a > covered:
                    out[covered:a].zero_()
                out[a : a + n].copy_(raw[off - start : off - start + n], non_blocking=True)
                covered = a + n
            out[covered:].zero_()  # the padding: zero, as in memory
            if out.is_cuda:
                s.event = torch.cuda.Event()
                s.event.record()
            s.assembled = True
        return out

    def release(self, f) -> None:
        """The gather that read ``f``'s shard is complete: its slot is free again."""
        s = self._slot_of(f)
        if s is not None:
            s.clear()

    def invalidate(self) -> None:
        """Drop every shard read so far (the files are about to change)."""
        for s in self.slots:
            if s.taken:
                s.flat.wait_gather()
            s.clear()
