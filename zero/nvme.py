"""NVMe offload (ZeRO-Infinity): the fp32 master weights and the optimizer's per-element state of
a ``ZeroEngine`` live in files, and each step streams them through a few host buffers.

    engine = ZeroEngine(model, layout, stage=3, offload="nvme", offload_dir="/local_nvme/offload",
                        offload_sub_group_elems=1 << 22)

What lives where (per rank): the compute weights and gradients stay where the stage keeps them
(stage 3: the rank's weight shard in the compute dtype on the device; stages 0-2 the full
weights). The master weights of the rank's optimizer range and every per-element state tensor of
the optimizer (AdamW's ``exp_avg``/``exp_avg_sq``, SGD's ``momentum_buffer``, ...) are files in
``offload_dir``, one per kind (``slots``: ``master`` first, then the state's keys); per-tensor
scalars (``step``) stay in ``optimizer.state``. Between steps ``optimizer.state[t]`` holds only
those scalars, and each shard tensor ``t`` reads as NaN and refuses writes (a stride-0 view of one
NaN): the values are in the files, read them through ``engine.full_parameters()`` or
``zero.checkpoint``.

Layout of the files: the rank's optimizer range, flat by flat, param group by param group (one
``segment`` per (flat, param group) range), each segment at a multiple of 4096 elements, so every
read and write of a sub-group is aligned for O_DIRECT. The optimizer's tensors are the segments cut
at multiples of ``sub_group_elems`` in file order (``pieces``); a sub-group is the pieces inside
one ``[k * S, (k + 1) * S)`` window of the file. ``engine.optimizer`` is built over the pieces
(more, shorter tensors than in memory; ``shard_metadata()`` lists them): an elementwise optimizer
updates each element alike however its tensor is cut (bit for bit: measured for torch's AdamW,
SGD and routing_kernels.FusedAdamW, one and two threads).

One step (``NvmeOffload.step``), for sub-groups 0, 1, ...: the read of sub-group j + 1 (master and
state into buffer set (j + 1) % 3) and the write of sub-group j - 1 (from set (j - 1) % 3) run in
I/O threads while the optimizer updates sub-group j in set j % 3: its pieces' ``.data`` and state
point into the buffers, ``optimizer.param_groups`` holds only them for that call, and the updated
master is copied into the compute weights. So the process's memory for the state is three buffer
sets (``3 * (1 + slots + 1) * S`` elements: master, state, a gradient slot), whatever the model's
size: nothing is mapped into memory (no mmap, whose touched pages would all stay resident), and
with O_DIRECT nothing passes through the page cache either. The step returns once every write is
done, so the files hold the new state before anyone reads them.

I/O: ``os.preadv``/``os.pwritev`` in a thread pool (the calls release the GIL), each request cut
into ``_IO_CHUNK`` pieces so several are in flight (queue depth = threads). io_uring was
considered: the ``liburing`` registry package installs (a Cython binding), and io_uring works in
this container, but it buys fewer syscalls per byte, which matters for many small requests; here
every request is megabytes, a thread pool reaches the device's sequential bandwidth
(experiments/bench/nvme.py), and io_uring is blocked by the default seccomp profile of many
container runtimes, where a thread pool always works. O_DIRECT where the filesystem takes it
(probed on an aligned write and read at start-up; buffers aligned to 4096 bytes, pinned on CUDA):
it keeps gigabytes of state out of the page cache and skips a copy; elsewhere (tmpfs, some network
filesystems) buffered I/O with ``posix_fadvise(DONTNEED)`` after each request, so the cache does
not fill with pages read once per step. ``NvmeOffload.direct`` says which was chosen.

Reliability: the files are scratch, not a checkpoint. They are opened with O_TMPFILE (else created
and unlinked at once), so they have no name and the kernel frees them when the process ends, even
on kill -9, and a checkpoint never reads them after a restart. The space is reserved at start-up
(``posix_fallocate``), so a full disk is met before the first step: a missing parent, a read-only or
full ``offload_dir`` stops every rank of the engine (one all-reduce of a flag agrees) with a message
naming the directory, the bytes this rank needs and the bytes free.

Not offloaded: stage 3's parameter shards (the compute-dtype slice each rank gathers from) stay on
the device; they are 1/W of the weights, and the gathers (zero/gather.py) read them every
micro-batch.
"""

from __future__ import annotations

import concurrent.futures
import copy
import errno
import os
import shutil
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

MODES = ("none", "cpu", "nvme")
ALIGN = 4096  # bytes: O_DIRECT's buffer, offset and length alignment on the filesystems here
_ALIGN_ELEMS = 4096  # every segment starts at a multiple of this many elements (>= ALIGN bytes)
DEFAULT_SUB_GROUP = 1 << 22  # elements: 16 MiB of fp32 per slot and buffer set
_IO_CHUNK = 8 << 20  # bytes per preadv/pwritev: several in flight per request
_IO_THREADS = 4
_SETS = 3  # buffer sets: one read ahead, one updated, one written back
_POISON = torch.full((1,), float("nan"))  # what shard tensors read between steps


def offload_mode(offload) -> str:
    """``"none"``, ``"cpu"`` or ``"nvme"`` from the engine's ``offload`` argument (False/True mean
    none/cpu), or a ValueError naming the bad value."""
    if offload is False or offload is None:
        return "none"
    if offload is True:
        return "cpu"
    if isinstance(offload, str) and offload in MODES:
        return offload
    raise ValueError(f"offload={offload!r} must be one of {MODES} (or False/True for 'none'/'cpu')")


def check_arguments(mode: str, offload_dir, sub_group_elems) -> tuple[Path | None, int]:
    """``(offload_dir, sub_group_elems)`` checked against ``mode`` (before any collective)."""
    if mode != "nvme":
        if offload_dir is not None:
            raise ValueError(f"offload_dir={offload_dir!r} only applies to offload='nvme', got offload={mode!r}")
        if sub_group_elems is not None:
            raise ValueError(
                f"offload_sub_group_elems={sub_group_elems!r} only applies to offload='nvme', got offload={mode!r}"
            )
        return None, 0
    if offload_dir is None or not isinstance(offload_dir, (str, os.PathLike)) or not str(offload_dir):
        raise ValueError(
            f"offload='nvme' needs offload_dir=<a directory on a local fast disk>, got offload_dir={offload_dir!r}"
        )
    s = DEFAULT_SUB_GROUP if sub_group_elems is None else sub_group_elems
    if isinstance(s, bool) or not isinstance(s, int) or s <= 0 or s % _ALIGN_ELEMS:
        raise ValueError(
            f"offload_sub_group_elems={sub_group_elems!r} must be a positive multiple of {_ALIGN_ELEMS} "
            f"(elements per sub-group; default {DEFAULT_SUB_GROUP})"
        )
    return Path(offload_dir), s


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _poison(n: int) -> torch.Tensor:
    """``n`` elements that read as NaN and, for n > 1, refuse in-place writes, in 4 bytes (one
    element has nothing to overlap: it gets a NaN of its own, so a write cannot reach the others)."""
    return _POISON.expand(n) if n > 1 else torch.full((n,), float("nan"))


def _placeholder(n: int) -> torch.Tensor:
    """A leaf tensor of ``n`` elements whose data is ``_poison(n)``: a shard tensor between steps."""
    t = torch.empty(0)
    t.data = _poison(n)
    return t


@dataclass
class Segment:
    """One (flat, param group) range ``[a, b)`` of flat coordinates at ``off`` elements in the files."""

    flat: object
    group: int
    a: int
    b: int
    off: int


@dataclass
class Piece:
    """One optimizer tensor: flat coordinates ``[a, b)`` of ``flat`` at ``off`` in the files."""

    flat: object
    group: int
    a: int
    b: int
    off: int
    tensor: torch.Tensor

    @property
    def n(self) -> int:
        return self.b - self.a


@dataclass
class SubGroup:
    lo: int  # file elements [lo, hi), aligned
    hi: int
    pieces: list = field(default_factory=list)


@dataclass
class Plan:
    segments: list
    subgroups: list
    total: int  # elements per slot file
    sub_group_elems: int


def cut_pieces(flats, sub_group_elems: int) -> Plan:
    """Lay every flat's optimizer range into the files and cut it into the optimizer's tensors:
    ``f.shards`` becomes ``(param group, a, b, tensor)`` of each piece (placeholders between steps)."""
    segments, off = [], 0
    for f in flats:
        for g, a, b in f.shard_ranges(f.group_bounds):
            segments.append(Segment(f, g, a, b, off))
            off += _round_up(b - a, _ALIGN_ELEMS)
    total, S = off, sub_group_elems
    subgroups: dict[int, SubGroup] = {}
    shards: dict[int, list] = {id(f): [] for f in flats}
    for seg in segments:
        x = seg.off
        end = seg.off + (seg.b - seg.a)
        while x < end:
            y = min(end, (x // S + 1) * S)  # a piece never crosses a sub-group's window
            a = seg.a + (x - seg.off)
            piece = Piece(seg.flat, seg.group, a, a + (y - x), x, _placeholder(y - x))
            k = x // S
            subgroups.setdefault(k, SubGroup(k * S, min((k + 1) * S, total))).pieces.append(piece)
            shards[id(seg.flat)].append((seg.group, piece.a, piece.b, piece.tensor))
            x = y
    for f in flats:
        f.shards = shards[id(f)]
    return Plan(segments, [subgroups[k] for k in sorted(subgroups)], total, S)


def _per_element(value, t: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == t.numel()


def _aligned(nbytes: int, pin: bool) -> torch.Tensor:
    """A uint8 buffer of ``nbytes`` whose address is a multiple of ALIGN (pinned: page-aligned)."""
    if pin:
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)[:nbytes]
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start : start + nbytes]


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


class NvmeOffload:
    """The files, buffers and I/O threads of one engine's NVMe offload (see the module docstring).

    Built after the optimizer (over ``plan``'s pieces) and before the engine's first collective:
    it learns the optimizer's per-element state (its keys and dtypes) from a probe step on a
    4096-element tensor, opens and reserves the files, and agrees with every rank of ``groups``
    (one all-reduce of a flag on ``device``) that each could, raising on all of them if not."""

    def __init__(self, plan: Plan, optimizer, directory: Path, *, device, groups, fused: bool):
        self.plan = plan
        self.optimizer = optimizer
        self.directory = Path(directory)
        self.fused = fused
        self.state_in_files = False  # the per-element state exists (after the first step)
        state_slots = self._state_slots()
        self.slots = [("master", torch.float32)] + state_slots
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

    def _open(self) -> str | None:
        """Open and reserve one file per slot; what is wrong (naming the directory, the bytes this
        rank needs and the bytes free) or None."""
        d = self.directory
        need = f"this rank needs {self.need} bytes ({len(self.slots)} files of {self.plan.total} elements)"
        try:
            if not d.exists():
                if not d.parent.is_dir():
                    return (
                        f"offload_dir={d} cannot be created: its parent {d.parent} does not exist; {need}; "
                        f"give an existing directory (or one whose parent exists) on a local disk"
                    )
                d.mkdir(exist_ok=True)
            if not d.is_dir():
                return f"offload_dir={d} is not a directory; {need}"
            for name, dt in self.slots:
                fd = self._open_one(name)
                self.fds.append(fd)
                size = self.plan.total * dt.itemsize
                if size:
                    try:
                        os.posix_fallocate(fd, 0, size)
                    except OSError as e:
                        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", -1)):
                            raise
                        os.ftruncate(fd, size)  # no reservation on this filesystem: check the room instead
                        if shutil.disk_usage(d).free < size:
                            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from None
            self.direct = self._probe_direct()
        except OSError as e:
            for fd in self.fds:
                os.close(fd)
            self.fds = []
            free = _free(d)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                why = "is full"
            elif e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                why = "is not writable"
            else:
                why = "cannot hold the files"
            return (
                f"offload_dir={d} {why} ({os.strerror(e.errno) if e.errno else e}); {need}, "
                f"{free} bytes are free there; give a writable directory on a disk with room"
            )
        return None

    def _open_one(self, name: str) -> int:
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
        direct = getattr(os, "O_DIRECT", 0)
        tmpfile = getattr(os, "O_TMPFILE", 0)
        for extra in (direct, 0):
            if tmpfile:
                try:
                    return os.open(self.directory, flags | tmpfile | extra, 0o600)
                except OSError as e:
                    # EINVAL: O_DIRECT or O_TMPFILE refused; EOPNOTSUPP/EISDIR: no O_TMPFILE here
                    if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.EISDIR):
                        raise
            path = self.directory / f".zero-nvme-{os.getpid()}-{id(self):x}-{name}"
            try:
                fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | extra, 0o600)
            except OSError as e:
                if e.errno != errno.EINVAL or not extra:
                    raise
                continue
            os.unlink(path)  # nameless from here on: freed when the process ends, however it ends
            return fd
        raise OSError(errno.EINVAL, f"cannot open a file in {self.directory}")

    def _probe_direct(self) -> bool:
        """Whether the files were opened with O_DIRECT and take an aligned write and read; if not,
        O_DIRECT is turned off (buffered I/O with fadvise) on every file."""
        import fcntl

        direct = getattr(os, "O_DIRECT", 0)
        if not direct or not self.fds or not (fcntl.fcntl(self.fds[0], fcntl.F_GETFL) & direct):
            return False
        buf = _aligned(ALIGN, False)
        try:
            mv = memoryview(buf.numpy())
            for fd in self.fds:
                if os.fstat(fd).st_size >= ALIGN:
                    os.preadv(fd, [mv], 0)
                    os.pwritev(fd, [mv], 0)
            return True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            for fd in self.fds:
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~direct)
            return False

    @staticmethod
    def _agree(problem: str | None, device, groups) -> None:
        """Every rank of the engine raises if any cannot offload (one all-reduce per group)."""
        bad = problem is not None
        groups = [g for g in groups if g is not None]
        if groups and dist.is_initialized():
            flag = torch.tensor([int(bad)], dtype=torch.int32, device=device)
            for g in groups:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=g)
            bad = bool(flag.item())
        if bad:
            raise ValueError(
                problem or "offload='nvme': another rank's offload_dir cannot hold its optimizer state (see its error)"
            )

    def _eager_state(self) -> bool:
        return any(self.optimizer.state.get(p.tensor) for sg in self.plan.subgroups for p in sg.pieces)

    def _spill_eager_state(self) -> None:
        """An optimizer that built its state at construction (Adagrad): into the files, out of RAM."""
        for sg in self.plan.subgroups:
            for p in sg.pieces:
                st = self.optimizer.state.get(p.tensor, {})
                for k, (key, _) in enumerate(self.slots[1:], 1):
                    value = st.pop(key)
                    self.write_range(k, p.off, value.reshape(-1))
        self.state_in_files = True

    def close(self) -> None:
        """Close the files (their space is freed) and stop the I/O threads."""
        self._finalizer()

    def snapshot(self) -> NvmeOffload | None:
        """A frozen copy of the files, for an async checkpoint to read while training goes on: new
        nameless files beside these (their space reserved first), filled by the kernel
        (``copy_file_range``: a reflink where the filesystem has them) or, where it refuses, through
        a bounce buffer; an ``NvmeOffload`` over them that reads (``read_range``) and is closed by
        ``close()``. None when ``offload_dir`` has no room for a second copy (or it cannot be made)."""
        fds: list[int] = []
        try:
            for k, (name, dt) in enumerate(self.slots):
                fd = self._open_one(f"{name}-snapshot")
                fds.append(fd)
                size = self.plan.total * dt.itemsize
                if size:
                    os.posix_fallocate(fd, 0, size)
                    self._copy_file(self.fds[k], fd, size)
        except OSError:
            for fd in fds:
                os.close(fd)
            return None
        snap = copy.copy(self)
        snap.fds = fds
        snap.pool = concurrent.futures.ThreadPoolExecutor(_IO_THREADS, thread_name_prefix="zero-nvme-snapshot")
        snap.stats = dict.fromkeys(self.stats, 0)
        snap._lock = threading.Lock()
        snap._finalizer = weakref.finalize(snap, _close, list(fds), snap.pool)
        return snap

    def _copy_file(self, src: int, dst: int, size: int) -> None:
        done = 0
        try:
            while done < size:
                n = os.copy_file_range(src, dst, size - done, done, done)
                if n <= 0:
                    break
                done += n
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EXDEV, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
        buf = _aligned(min(size, 8 * _IO_CHUNK), False)
        mv = memoryview(buf.numpy())
        while done < size:  # what the kernel would not copy (O_DIRECT files on some filesystems)
            start = done // ALIGN * ALIGN
            n = min(len(mv), size - start)
            _pread(src, mv[:n], start, not self.direct)
            _pwrite(dst, mv[:n], start, not self.direct)
            done = start + n

    # ----- raw I/O ----------------------------------------------------------------------------
    def _io(self, write: bool, slot: int, buf_u8: torch.Tensor, off_bytes: int) -> list:
        """Submit the transfer of ``buf_u8`` to (or from) slot file ``slot`` at ``off_bytes``."""
        fd = self.fds[slot]
        mv = memoryview(buf_u8.numpy())
        futs = []
        for start in range(0, len(mv), _IO_CHUNK):
            part = mv[start : start + _IO_CHUNK]
            futs.append(self.pool.submit(_pwrite if write else _pread, fd, part, off_bytes + start, not self.direct))
        with self._lock:
            self.stats["write_bytes" if write else "read_bytes"] += len(mv)
        return futs

    def read_range(self, slot: int, off: int, n: int) -> torch.Tensor:
        """Elements ``[off, off + n)`` of slot file ``slot``, as a fresh tensor (aligned bounce buffer)."""
        dt = self.slots[slot][1]
        lo, hi = off * dt.itemsize, (off + n) * dt.itemsize
        alo, ahi = lo // ALIGN * ALIGN, _round_up(hi, ALIGN)
        buf = _aligned(ahi - alo, False)
        for fut in self._io(False, slot, buf, alo):
            fut.result()
        return buf[lo - alo : hi - alo].view(dt).clone()

    def write_range(self, slot: int, off: int, values: torch.Tensor) -> None:
        """``values`` into slot file ``slot`` at element ``off`` (read, modify, write whole blocks)."""
        dt = self.slots[slot][1]
        values = values.detach().reshape(-1).to("cpu", dt)
        lo, hi = off * dt.itemsize, (off + values.numel()) * dt.itemsize
        alo, ahi = lo // ALIGN * ALIGN, _round_up(hi, ALIGN)
        buf = _aligned(ahi - alo, False)
        if (alo, ahi) != (lo, hi):
            for fut in self._io(False, slot, buf, alo):
                fut.result()
        buf[lo - alo : hi - alo].view(dt).copy_(values)
        for fut in self._io(True, slot, buf, alo):
            fut.result()

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
        every = list(range(len(self.slots)))
        reads = every if self.state_in_files else [0]
        self._stream(reads, lambda sg, bs: self._update(sg, bs, grad_scale, zero_grads), write_slots=every)
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
                for k, (key, _) in enumerate(self.slots[1:], 1):
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
                own = f.own_compute[p.a - opt_lo : p.b - opt_lo]
                if self.fused and own.device.type == "cpu":
                    copies[t] = own  # the kernel writes the compute weights in the same pass
                else:
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
            for k, (key, _) in enumerate(self.slots[1:], 1):
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
        """The compute weights from the master weights in the files (after a checkpoint load)."""

        def copy_out(sg, bs):
            for p in sg.pieces:
                o, lo = p.off - sg.lo, p.flat.opt_range[0]
                p.flat.own_compute[p.a - lo : p.b - lo].copy_(bs.views[0][o : o + p.n])

        self._stream([0], copy_out)

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


def _pread(fd: int, mv: memoryview, off: int, advise: bool) -> None:
    done = 0
    while done < len(mv):
        got = os.preadv(fd, [mv[done:]], off + done)
        if got <= 0:  # the files are reserved to their full size: no end inside a request
            raise OSError(errno.EIO, f"offload file ended at byte {off + done}")
        done += got
    if advise:
        os.posix_fadvise(fd, off, len(mv), os.POSIX_FADV_DONTNEED)


def _pwrite(fd: int, mv: memoryview, off: int, advise: bool) -> None:
    done = 0
    while done < len(mv):
        done += os.pwritev(fd, [mv[done:]], off + done)
    if advise:
        os.posix_fadvise(fd, off, len(mv), os.POSIX_FADV_DONTNEED)


def _free(d: Path) -> int:
    for p in (d, *d.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return 0


def _close(fds, pool) -> None:
    pool.shutdown(wait=True)
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
