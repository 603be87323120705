"""The slot files of ``zero.nvme``: opened nameless and reserved at start-up (a full or read-only
directory named with the bytes), O_DIRECT probed, raw aligned reads and writes through a thread
pool, frozen snapshots for an async checkpoint."""

from __future__ import annotations

import concurrent.futures
import copy
import errno
import os
import shutil
import threading
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from .pieces import _round_up

ALIGN = 4096  # bytes: O_DIRECT's buffer, offset and length alignment on the filesystems here
_IO_CHUNK = 8 << 20  # bytes per preadv/pwritev: several in flight per request
_IO_THREADS = 4


def _aligned(nbytes: int, pin: bool) -> torch.Tensor:
    """A uint8 buffer of ``nbytes`` whose address is a multiple of ALIGN (pinned: page-aligned)."""
    if pin:
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)[:nbytes]
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start : start + nbytes]


class OffloadFiles:
    """The files and raw I/O of an ``NvmeOffload`` (``zero.nvme.offload``), which sets ``directory``,
    ``plan``, ``slots`` (name, dtype per file), ``need``, ``fds``, ``direct``, ``pool``, ``stats``,
    ``_lock`` and ``_finalizer``."""

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

    def close(self) -> None:
        """Close the files (their space is freed) and stop the I/O threads."""
        self._finalizer()

    def snapshot(self) -> OffloadFiles | None:
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
