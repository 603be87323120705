"""NVMe offload (ZeRO-Infinity): the fp32 master weights and the optimizer's per-element state of
a ``ZeroEngine`` live in files, and each step streams them through a few host buffers.

    engine = ZeroEngine(model, layout, stage=3, offload="nvme", offload_dir="/local_nvme/offload",
                        offload_sub_group_elems=1 << 22)

What lives where (per rank): the gradients stay where the stage keeps them, and so do the
compute weights of stages 0-2 (the full weights); stage 3's compute-dtype weight shards are in the
files too (``shards``, below). The master weights of the rank's optimizer range and every per-element state tensor of
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
sets (``3 * (1 + slots + 1) * S`` elements: master, state, a gradient slot; stage 3 in bf16 one
compute slot more), plus at stage 3 the shard pool's slots, whatever the model's size: nothing is
mapped into memory (no mmap, whose touched pages would all stay resident), and with O_DIRECT
nothing passes through the page cache either. The step returns once every write is done, so the
files hold the new state before anyone reads them.

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

Stage 3's parameter shards (``shards``): no flat keeps its compute-dtype shard in memory (on one
rank too: the whole flat is its shard, "gathered" by a read). In fp32 the shard is the master
weights' own range in the master file; in bf16 it is a ``compute`` file (a slot after the state's,
same layout) that the step fills from its own buffer sets: each sub-group's new compute weights are
copied into a buffer of the set being updated (by the fused kernel, or a copy after the update) and
written back with the master and the state, so no copy of the weights sits in RAM. Before a block's
gather the shards of its flats are read into a ``ShardPool`` of ``_SLOTS`` slots (one aligned host
buffer of the largest flat's extent, one shard-sized tensor on the device each): the gather hooks
read ahead the block about to be gathered and the two expected after it (forward order before a
forward, reverse order before a backward), so the next blocks' reads overlap the current block's
gather and compute; a slot is held from its gather's start to the gather's completion. A step and
a checkpoint load drop every read-ahead (the files change). A checkpoint saves and loads the master
weights (the shards' source) item by item, and after a load the bf16 shards are rewritten from the
loaded masters through the step's buffers (``refresh_compute``).

Modules: ``pieces`` (the engine's ``offload`` arguments, the file layout: segments, pieces,
sub-groups), ``files`` (opening and reserving the files, O_DIRECT, raw aligned I/O, snapshots),
``offload`` (``NvmeOffload``, the streamed step; ``FileEntries`` for ``zero.checkpoint``),
``shards`` (``ShardPool``, stage 3's shards read for the gathers).
"""

from __future__ import annotations

# the public names, and the private ones the bench (experiments/bench/nvme.py) and the tests read,
# importable from zero.nvme as before it was split into these modules
from .files import _IO_CHUNK, _IO_THREADS, ALIGN, OffloadFiles, _aligned, _close, _free, _pread, _pwrite  # noqa: F401
from .offload import _SETS, FileEntries, NvmeOffload, _BufferSet, _per_element  # noqa: F401
from .pieces import (  # noqa: F401
    _ALIGN_ELEMS,
    _POISON,
    DEFAULT_SUB_GROUP,
    MODES,
    Piece,
    Plan,
    Segment,
    SubGroup,
    _placeholder,
    _poison,
    _round_up,
    check_arguments,
    cut_pieces,
    offload_mode,
)
from .shards import _SLOTS, ShardPool  # noqa: F401

__all__ = [
    "ALIGN",
    "DEFAULT_SUB_GROUP",
    "MODES",
    "FileEntries",
    "NvmeOffload",
    "OffloadFiles",
    "Piece",
    "Plan",
    "Segment",
    "ShardPool",
    "SubGroup",
    "check_arguments",
    "cut_pieces",
    "offload_mode",
]
