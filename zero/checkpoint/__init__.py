"""Sharded checkpoints of a ``ZeroEngine``: every rank writes its own shards through
``torch.distributed.checkpoint`` (DCP), and any layout loads any other.

    ckpt = Checkpointer(engine, "runs/x/checkpoints", keep_last=3, async_save=True)
    path = ckpt.latest()                      # newest complete, verified checkpoint (or None)
    if path is not None:
        meta = ckpt.load(path)                # weights, optimizer state, buffers, RNG; meta["extra"]
    ...
    ckpt.save(step, extra={"data_step": step})  # returns once the state is staged (async) or written
    ckpt.close()                              # waits for the last save

What a checkpoint holds (keys of the DCP state dict; ``<name>`` is the model's parameter or buffer
name, e.g. ``blocks.3.moe.experts.w1``):

- ``param/<name>``: the fp32 master weights as the flattened GLOBAL parameter, a 1-D tensor of
  ``prod(global_shape)`` elements (an expert weight: all E experts, expert e at rows
  ``[e * rows, (e + 1) * rows)`` of the flat order). Each rank contributes the 1-D chunk it holds,
  at its global offset: the slice of the parameter inside its ZeRO shard (stages 1-3), or the
  whole parameter it holds (stage 0; experts: its ep slice at ``expert_offset``). Chunks may be any
  length; DCP stores each chunk with its offset and, at load, reads the overlap of the saved chunks
  with each chunk the loading rank asks for, so ZeRO stage, dp, ep and offload may all change.
- ``optim/<key>/<name>``: the optimizer's per-element state (AdamW's ``exp_avg``/``exp_avg_sq``,
  SGD's ``momentum_buffer``) chunked exactly like the weights, and its per-tensor scalars (``step``)
  as plain tensors.
- ``buffer/<name>``: every buffer of the model's ``state_dict`` (routers' expert biases), as is.
- ``shape/<name>``: each parameter's global shape (int64), for consolidation.
- ``rng/<rank>/...``: each rank's torch (CPU, CUDA) and Python RNG states.

Replicas (stage 0, or experts replicated over edp) hand DCP the same chunk at the same offset; DCP's
save planning keeps one copy, written by the least-loaded replica. Plain tensors (scalars, buffers,
shapes) are deduplicated the same way. Everything is keyed by parameter names, not by ranks, so a
pipeline stage that keeps the full model's names reshards across pp as well.

DCP plans the save and the load (who writes which chunk, which saved chunks overlap a requested
one) and writes its ``.metadata`` as always; the bytes differ from DCP's default writer: each rank
writes one file ``__<rank>_0.distcp`` holding its items' raw bytes back to back (``_Writer``; DCP's
own writer runs every item through ``torch.save``, at about 0.2x of a plain write here), and reads
them back with ``SafeReader`` (a 1-D chunk's requested part straight into its destination).

Beside DCP's files a checkpoint directory holds ``meta.json`` (step, writer layout, optimizer, the
caller's ``extra``), any ``files`` the caller adds (e.g. the resolved config) and, written last by
rank 0 once every rank has written and fsynced, ``MANIFEST.json``: every file with its size and
XXH3-128 checksum (computed by each rank as it writes, gathered to rank 0; temp file, fsync,
rename, fsync of the directory). A directory without a manifest is incomplete; ``verify`` re-reads
every file against it (``verify_together``: every rank a share). Format 1 (``torch.save`` items,
SHA-256) is still read.

Loading never executes code from the checkpoint: items are raw bytes (format 1: DCP's
``torch.load(weights_only=True)``); the ``.metadata`` (a plain pickle, which torch's
``weights_only`` unpickler cannot parse: it lacks protocol 4's opcodes) goes through
``SafeUnpickler``, which resolves only DCP's metadata classes, ``torch.Size``, dtypes, layouts and
paths; byte items are refused.

The modules, in the order they build on each other:

- ``group``: this process's rank in the checkpoint's process group, ``new_group``, and ``_agree``
  (every rank raises together);
- ``integrity``: the directory's files: ``step_dir``, durable writes, checksums, the manifest,
  ``verify``/``verify_together``, ``latest_complete``, ``prune``, ``read_meta``;
- ``storage``: the bytes of DCP's files: ``_Writer`` (raw items), ``SafeReader``, ``SafeUnpickler``;
- ``planners``: DCP's save and load planning of 1-D chunks of flattened global tensors;
- ``entries``: the engine's state as named DCP entries (shards with their global place, buffers, RNG,
  the metadata);
- ``state``: ``save`` and ``load`` of those entries (async staging, a full disk), ``read_tensors``;
- ``checkpointer``: ``Checkpointer``, the driver of periodic saves and resumes.

An engine with ``offload="nvme"`` (``zero.nvme``) writes the same entries: its master weights and
per-element optimizer state are read from its offload files one item at a time as DCP writes them,
and a load writes each item it reads into them (``FileEntries``), so neither holds a second copy
of the state in memory; such a checkpoint loads in memory and the other way round. An async save
copies the offload files beside themselves (on disk, not into RAM: staging would) and writes from
the copy; without room for it, the save runs synchronously, with a warning.

A save that meets a full disk (ENOSPC, EDQUOT) removes its partial directory (which would hold
the space, so every retry failed at the same save), keeps every complete checkpoint and raises
``CheckpointDiskFull`` (an ``OSError``: ``directory``, ``needed``, ``free``) on every rank. The
bytes it needs are known before it writes: each rank counts the bytes DCP will have it write
(replicas once) and one all-reduce, the one that already agrees the directory is fresh, sums them.

This module re-exports what the rest of the project uses; the private pieces are imported from
their module.
"""

from .checkpointer import Checkpointer
from .entries import BUFFER, OPTIM, PARAM, SHAPE
from .group import new_group
from .integrity import (
    MANIFEST,
    META,
    CheckpointDiskFull,
    file_digest,
    finish,
    latest_complete,
    list_checkpoints,
    prune,
    read_meta,
    step_dir,
    verify,
    verify_together,
    write_durably,
)
from .state import load, read_tensors, save
from .storage import SafeReader

__all__ = [
    "save",
    "load",
    "read_tensors",
    "Checkpointer",
    "CheckpointDiskFull",
    "new_group",
    "step_dir",
    "list_checkpoints",
    "latest_complete",
    "prune",
    "verify",
    "verify_together",
    "finish",
    "read_meta",
    "file_digest",
    "write_durably",
    "SafeReader",
    "MANIFEST",
    "META",
    "PARAM",
    "OPTIM",
    "BUFFER",
    "SHAPE",
]
