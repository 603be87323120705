"""``NvmeOffload``: one engine's optimizer step streamed through three host buffer sets, sub-group
by sub-group, with the reads ahead and the writes behind in flight (the package docstring), and
``FileEntries``, the checkpoint's view of the files."""

from __future__ import annotations

import concurrent.futures
import copy
import os
import threading
import time
import weakref
from pathlib import Path

import torch

from .files import _IO_THREADS, OffloadFiles, _aligned, _close
from .pieces import _ALIGN_ELEMS, Plan, SubGroup, _poison

_SETS = 3  # buffer sets: one read ahead, one updated, one written back


def _per_element(value, t: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == t.numel()


class _BufferSet:
    """One sub-group's worth of host memory: a buffer per slot and one for the gradient."""

    def __init__(self, slots, elems: int, pin: bool):
        self.raw = [_aligned(elems * dt.itemsize, pin) for _, dt in slots]
        self.views = [r.view(dt) for r, (_, dt) in zip(self.raw, slots)]
        self.grad = _aligned(elems * 4, pin).view(torch.float32)
        self.pending: list = []  # I/O futures on these buffers
        self.event = None  # a CUDA copy out of these buffers

    def wait(self) -> None:
        for fut in self.pending:
            fut.result()
        self.pending = []
        if self.event is not None:
            self.event.synchronize()
            self.event = None


class NvmeOffload(OffloadFiles):
    """The files, buffers and I/O threads of one engine's NVMe offload (see the module docstring).

    Built after the optimizer (over ``plan``'s pieces) and before the engine's first collective:
    it learns the optimizer's per-element state (its keys and dtypes) from a probe step on a
    4096-element tensor, opens and reserves the files, and agrees with every rank of ``groups``
    (one all-reduce of a flag on ``device``) that each could, raising on all of them if not."""

    def __init__(self, plan: Plan, optimizer, directory: Path, *, device, groups, fused: bool, shard_dtype=None):
        """``shard_dtype``: stage 3's compute dtype, whose parameter shards live in the files too
        (``zero.nvme.shards``): in the master file itself when fp32, else in a ``compute`` file
        beside it; None (stages 0-2): the compute weights stay in memory."""
        self.plan = plan
        self.optimizer = optimizer
        self.directory = Path(directory)
        self.fused = fused
        self.state_in_files = False  # the per-element state exists (after the first step)
        state_slots = self._state_slots()
        self.n_state = len(state_slots)  # slots 1..n_state: the optimizer's per-element state
        self.slots = [("master", torch.float32)] + state_slots
        # the slot stage 3's compute-dtype shards are read from (the gathers) and written to (the step)
        self.compute_slot = None
        if shard_dtype is not None:
            self.compute_slot = 0 if shard_dtype == torch.float32 else len(self.slots)
            if self.compute_slot:
                self.slots.append(("compute", shard_dtype))
        self.shards = None  # stage 3: the ShardPool the gathers read through (set by the engine)
        self.need = sum(plan.total * dt.itemsize for _, dt in self.slots)
        self.fds: list[int] = []
        self.direct = False
        problem = self._open()
        try:
            self._agree(problem, device, groups)
        except BaseException:
            for fd in self.fds:
                os.close(fd)
            raise
        pin = torch.cuda.is_available()
        elems = min(plan.sub_group_elems, max(plan.total, _ALIGN_ELEMS))
        self.sets = [_BufferSet(self.slots, elems, pin) for _ in range(_SETS)]
        self.pool = concurrent.futures.ThreadPoolExecutor(_IO_THREADS, thread_name_prefix="zero-nvme")
        # totals since start-up: bytes moved, seconds in the streaming loops, waiting on I/O, updating
        self.stats = {"read_bytes": 0, "write_bytes": 0, "step_s": 0.0, "io_wait_s": 0.0, "update_s": 0.0}
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _close, list(self.fds), self.pool)
        if self._eager_state():
            self._spill_eager_state()

    # ----- set-up -----------------------------------------------------------------------------
    def _state_slots(self) -> list[tuple[str, torch.dtype]]:
        """The optimizer's per-element state keys and dtypes: from the state it built eagerly
        (Adagrad's ``sum``), else from one step on a probe tensor (other optimizers build their
        state in their first step), the optimizer's groups restored afterwards."""
        opt = self.optimizer
        for t in (p.tensor for sg in self.plan.subgroups for p in sg.pieces):
            st = opt.state.get(t)
            if st:
                return [(k, v.dtype) for k, v in st.items() if _per_element(v, t)]
        probe = torch.zeros(_ALIGN_ELEMS)
        probe.grad = torch.zeros_like(probe)
        saved = [(g["params"], {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}) for g in opt.param_groups]
        try:
            for i, g in enumerate(opt.param_groups):
                g["params"] = [probe] if i == 0 else []
            opt.step(grad_scale=1.0) if self.fused else opt.step()
            st = opt.state.pop(probe, {})
        except Exception as e:
            raise ValueError(
                f"offload='nvme': the optimizer {type(opt).__name__} failed a probe step on a 1-D fp32 "
                f"tensor ({type(e).__name__}: {e}); the offload needs to know its per-element state"
            ) from e
        finally:
            for g, (params, options) in zip(opt.param_groups, saved):
                g.clear()
                g.update(options, params=params)
        return [(k, v.dtype) for k, v in st.items() if _per_element(v, probe)]

    def _eager_state(self) -> bool:
        return any(self.optimizer.state.get(p.tensor) for sg in self.plan.subgroups for p in sg.pieces)

    def _spill_eager_state(self) -> None:
        """An optimizer that built its state at construction (Adagrad): into the files, out of RAM."""
        for sg in self.plan.subgroups:
            for p in sg.pieces:
                st = self.optimizer.state.get(p.tensor, {})
                for k, (key, _) in self.state_slots():
                    value = st.pop(key)
                    self.write_range(k, p.off, value.reshape(-1))
        self.state_in_files = True

    def state_slots(self) -> list[tuple[int, tuple[str, torch.dtype]]]:
        """``(slot, (key, dtype))`` of each per-element state tensor of the optimizer."""
        return list(enumerate(self.slots[1 : 1 + self.n_state], 1))

    def segment_of(self, f, a: int, b: int) -> int:
        """The file offset of flat ``f``'s coordinates ``[a, b)``, which lie inside one segment."""
        for seg in self.plan.segments:
            if seg.flat is f and seg.a <= a and b <= seg.b:
                return seg.off + (a - seg.a)
        raise KeyError(f"flat range [{a}, {b}) lies in no single segment of the offload files")

    def write_master(self, f, values: torch.Tensor) -> None:
        """Flat ``f``'s master weights (its optimizer range, ``values``) into the files."""
        lo = f.opt_range[0]
        for seg in self.plan.segments:
            if seg.flat is f:
                self.write_range(0, seg.off, values[seg.a - lo : seg.b - lo])
                if self.compute_slot:  # stage 3's compute shard, as in memory: the weights in the compute dtype
                    part = values[seg.a - lo : seg.b - lo].to(self.slots[self.compute_slot][1])
                    self.write_range(self.compute_slot, seg.off, part)

    def read_master(self, f) -> torch.Tensor:
        """Flat ``f``'s master weights over its optimizer range (zero in the padding), in RAM."""
        lo, hi = f.opt_range
        out = torch.zeros(hi - lo, dtype=torch.float32)
        for seg in self.plan.segments:
            if seg.flat is f:
                out[seg.a - lo : seg.b - lo] = self.read_range(0, seg.off, seg.b - seg.a)
        return out

    # ----- streaming --------------------------------------------------------------------------
    def _read(self, sg: SubGroup, bs: _BufferSet, slots) -> None:
        bs.wait()
        for k in slots:
            isz = self.slots[k][1].itemsize
            bs.pending += self._io(False, k, bs.raw[k][: (sg.hi - sg.lo) * isz], sg.lo * isz)

    def _write(self, sg: SubGroup, bs: _BufferSet, slots) -> None:
        for k in slots:
            isz = self.slots[k][1].itemsize
            bs.pending += self._io(True, k, bs.raw[k][: (sg.hi - sg.lo) * isz], sg.lo * isz)

    def _stream(self, read_slots, fn, write_slots=()) -> None:
        """For each sub-group: its slots read into a buffer set (the next one's read in flight
        meanwhile), ``fn(sub_group, buffer_set)``, its slots written back (in flight meanwhile)."""
        subs = self.plan.subgroups
        if not subs:
            return
        t0 = time.perf_counter()
        self._read(subs[0], self.sets[0], read_slots)
        for j, sg in enumerate(subs):
            bs = self.sets[j % _SETS]
            if j + 1 < len(subs):  # the set sub-group j - 2 was written from: its write must be done
                self._read(subs[j + 1], self.sets[(j + 1) % _SETS], read_slots)
            w0 = time.perf_counter()
            bs.wait()
            self.stats["io_wait_s"] += time.perf_counter() - w0
            u0 = time.perf_counter()
            fn(sg, bs)
            self.stats["update_s"] += time.perf_counter() - u0
            self._write(sg, bs, write_slots)
        w0 = time.perf_counter()
        for bs in self.sets:
            bs.wait()
        self.stats["io_wait_s"] += time.perf_counter() - w0
        self.stats["step_s"] += time.perf_counter() - t0

    def step(self, grad_scale: float, *, zero_grads: bool = False) -> None:
        """The optimizer over every sub-group (see the module docstring). ``zero_grads``: step with
        zero gradients and without touching the compute weights (the checkpoint's way of creating
        the optimizer's state at lr 0)."""
        if self.shards is not None:  # a shard read ahead before this step would be stale after it
            self.shards.invalidate()
        reads = list(range(1 + self.n_state)) if self.state_in_files else [0]
        writes = list(range(1 + self.n_state))
        if self.compute_slot and not zero_grads:  # the new compute shards, from the step's own buffers
            writes.append(self.compute_slot)
        self._stream(reads, lambda sg, bs: self._update(sg, bs, grad_scale, zero_grads), write_slots=writes)
        self.state_in_files = True

    def _update(self, sg: SubGroup, bs: _BufferSet, grad_scale: float, zero_grads: bool) -> None:
        opt = self.optimizer
        by_group = [[] for _ in opt.param_groups]
        copies, copy_after = {}, []
        for p in sg.pieces:
            o, n, t, f = p.off - sg.lo, p.n, p.tensor, p.flat
            t.data = bs.views[0][o : o + n]
            if self.state_in_files:
                st = opt.state[t]
                for k, (key, _) in self.state_slots():
                    st[key] = bs.views[k][o : o + n]
            opt_lo = f.opt_range[0]
            if zero_grads:
                g = bs.grad[o : o + n].zero_()
            else:
                src = f.reduced_grad()[p.a - opt_lo : p.b - opt_lo]
                if src.device.type == "cpu" and src.dtype == torch.float32:
                    g = src  # the reduced gradient is consumed by this step: scaled in place, as in memory
                else:
                    g = bs.grad[o : o + n]
                    g.copy_(src)
                if not self.fused and grad_scale != 1.0:
                    g.mul_(grad_scale)
                if f.own_compute is not None:
                    own = f.own_compute[p.a - opt_lo : p.b - opt_lo]
                elif self.compute_slot:  # stage 3: the compute shard into its slot, written back with the rest
                    own = bs.views[self.compute_slot][o : o + n]
                else:
                    own = None  # stage 3 in fp32: the compute shard is the master in the files
                if own is not None and self.fused and own.device.type == "cpu":
                    copies[t] = own  # the kernel writes the compute weights in the same pass
                elif own is not None:
                    copy_after.append((own, t))
            t.grad = g
            by_group[p.group].append(t)
        saved = [g["params"] for g in opt.param_groups]
        try:
            for g, params in zip(opt.param_groups, by_group):
                g["params"] = params
            if self.fused:
                opt.step(grad_scale=grad_scale, param_copies=copies)
            else:
                opt.step()
        finally:
            for g, params in zip(opt.param_groups, saved):
                g["params"] = params
        cuda = False
        for own, t in copy_after:
            own.copy_(t.data, non_blocking=True)
            cuda |= own.is_cuda
        if cuda:  # the buffers are read again three sub-groups on: the copy must be done by then
            bs.event = torch.cuda.Event()
            bs.event.record()
        for p in sg.pieces:
            o, n, t = p.off - sg.lo, p.n, p.tensor
            st = opt.state[t]
            for k, (key, _) in self.state_slots():
                value = st.pop(key, None)
                if value is None:
                    raise RuntimeError(
                        f"offload='nvme': optimizer {type(opt).__name__} has no state {key!r} after its step, "
                        f"which its probe step created"
                    )
                dst = bs.views[k][o : o + n]
                if value.data_ptr() != dst.data_ptr():  # created by this (first) step
                    dst.copy_(value.reshape(-1))
            extra = [key for key, v in st.items() if _per_element(v, t)]
            if extra:
                raise RuntimeError(
                    f"offload='nvme': optimizer {type(opt).__name__} created per-element state {extra} that "
                    f"its probe step did not; it cannot be offloaded"
                )
            t.grad = None
            t.data = _poison(n)

    def refresh_compute(self) -> None:
        """The compute weights from the master weights in the files (after a checkpoint load): in
        memory, or stage 3's compute shards in their file (streamed; nothing to do in fp32, where
        the master is the shard)."""
        if self.shards is not None:
            self.shards.invalidate()
        c = self.compute_slot

        def copy_out(sg, bs):
            for p in sg.pieces:
                o, lo = p.off - sg.lo, p.flat.opt_range[0]
                if p.flat.own_compute is not None:
                    p.flat.own_compute[p.a - lo : p.b - lo].copy_(bs.views[0][o : o + p.n])
                elif c:
                    bs.views[c][o : o + p.n].copy_(bs.views[0][o : o + p.n])

        if c != 0:
            self._stream([0], copy_out, write_slots=[c] if c else [])

    def nonfinite_count(self) -> int:
        """How many master weights are NaN or infinite."""
        bad = [0]

        def count(sg, bs):
            for p in sg.pieces:
                o = p.off - sg.lo
                bad[0] += int((~torch.isfinite(bs.views[0][o : o + p.n])).sum())

        self._stream([0], count)
        return bad[0]


class FileEntries:
    """Checkpoint entries whose values are in an engine's offload files (``zero.checkpoint``): each
    is a meta tensor of the right size in the DCP state dict, read from the files per item when DCP
    writes it and written to them per item when DCP loads it, so a save or a load holds one item
    (one parameter's slice) in memory at a time, never a second copy of the state."""

    def __init__(self, offload: NvmeOffload):
        self.offload = offload
        self.where: dict[str, tuple[int, int, int]] = {}  # key -> (slot, file offset, elements)

    def add(self, key: str, slot: int, f, a: int, b: int) -> torch.Tensor:
        """The entry ``key``: slot ``slot`` of flat ``f``'s coordinates ``[a, b)``."""
        self.where[key] = (slot, self.offload.segment_of(f, a, b), b - a)
        return torch.empty(b - a, dtype=self.offload.slots[slot][1], device="meta")

    def __contains__(self, key) -> bool:
        return key in self.where

    def dtype(self, key: str) -> torch.dtype:
        return self.offload.slots[self.where[key][0]][1]

    def read(self, key: str) -> torch.Tensor:
        slot, off, n = self.where[key]
        return self.offload.read_range(slot, off, n)

    def write(self, key: str, start: int, values: torch.Tensor) -> None:
        """``values`` into the entry ``key`` from its element ``start``."""
        slot, off, n = self.where[key]
        if start < 0 or start + values.numel() > n:
            raise ValueError(f"{key}: elements [{start}, {start + values.numel()}) outside its {n}")
        self.offload.write_range(slot, off + start, values)
