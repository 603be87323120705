"""A ``ZeroEngine``'s state as named DCP entries: each parameter's and optimizer state's shard with
its place in the global tensor, the persistent buffers, the RNG states, and the metadata a
checkpoint records beside them."""

from __future__ import annotations

import math
import random
import warnings

import torch

from .integrity import (
    FORMAT,
)

PARAM, OPTIM, BUFFER, SHAPE, RNG = "param/", "optim/", "buffer/", "shape/", "rng/"


def _global_offset(s) -> int:
    """Where a ParamSlice's first element sits in the flattened global parameter."""
    if s.expert_offset is None:
        return s.param_range[0]
    return s.expert_offset * math.prod(s.shape[1:]) + s.param_range[0]


def _per_element(value, t: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == t.numel()


def _rng_entries(rank: int) -> dict[str, torch.Tensor]:
    out = {f"{RNG}{rank}/torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"{RNG}{rank}/cuda"] = torch.cuda.get_rng_state()
    version, state, gauss = random.getstate()
    out[f"{RNG}{rank}/python"] = torch.tensor([version, *state], dtype=torch.int64)
    out[f"{RNG}{rank}/python_gauss"] = torch.tensor([math.nan if gauss is None else gauss], dtype=torch.float64)
    return out


def _set_rng(values: dict[str, torch.Tensor], rank: int) -> None:
    p = f"{RNG}{rank}/"
    torch.set_rng_state(values[p + "torch"])
    if p + "cuda" in values and torch.cuda.is_available():
        torch.cuda.set_rng_state(values[p + "cuda"])
    if p + "python" in values:
        v = values[p + "python"].tolist()
        g = values[p + "python_gauss"].item()
        random.setstate((v[0], tuple(v[1:]), None if math.isnan(g) else g))


def _entries(engine, rank: int, rng: bool, counted: set | None = None, in_files=None):
    """``(tensors, chunks, scalars)``: the state as DCP entries of views into the engine (no copy),
    the chunk map, and ``(key, tensor, state key)`` of each optimizer scalar (a fresh tensor, so a
    load can write it back into ``optimizer.state``). ``counted``, when given, receives the keys
    whose bytes this rank counts towards the size of the whole save (``_share_bytes``).

    With ``offload="nvme"`` the master weights and the per-element optimizer state are in files:
    their entries are meta tensors registered in ``in_files`` (a ``zero.nvme.FileEntries``, which
    the planners read and write per item), under the same keys and chunks as in memory, so a
    checkpoint does not tell how it was saved and loads either way."""
    tensors, chunks, scalars = {}, {}, []
    counted = set() if counted is None else counted
    offload = getattr(engine, "_nvme", None)
    if offload is not None and in_files is None:
        raise ValueError("an engine with offload='nvme' needs in_files=zero.nvme.FileEntries(...) for its entries")
    for f in engine.flats:
        # DCP writes a replica once: stage 0 replicates each flat over its group, so its group
        # rank 0 counts it; a plain tensor (shape, optimizer scalar) counts where its parameter's
        # global element 0 is held
        first = f.stage != 0 or f.rank == 0
        opt_lo = f.opt_range[0]
        for s in f.metadata():  # the parameters inside this rank's master range
            key = PARAM + s.name
            if f.master is None:  # in the offload files
                tensors[key] = in_files.add(key, 0, f, opt_lo + s.shard_range[0], opt_lo + s.shard_range[1])
            else:
                tensors[key] = f.master[s.shard_range[0] : s.shard_range[1]]
            chunks[key] = (_global_offset(s), math.prod(s.global_shape))
            tensors[SHAPE + s.name] = torch.tensor(s.global_shape, dtype=torch.int64)
            if first:
                counted.update([key] + ([SHAPE + s.name] if _global_offset(s) == 0 else []))
        for _, a, b, t in f.shards:
            for skey, value in engine.optimizer.state.get(t, {}).items():
                for s in f.metadata(a, b):
                    key = f"{OPTIM}{skey}/{s.name}"
                    if _per_element(value, t):
                        tensors[key] = value[s.shard_range[0] : s.shard_range[1]]
                        chunks[key] = (_global_offset(s), math.prod(s.global_shape))
                        if first:
                            counted.add(key)
                    else:
                        scalar = (
                            value.detach().clone().cpu()
                            if isinstance(value, torch.Tensor)
                            else torch.tensor(float(value), dtype=torch.float64)
                        )
                        tensors[key] = scalar
                        scalars.append((key, t, skey))
                        if first and _global_offset(s) == 0:
                            counted.add(key)
        if f.master is None and offload.state_in_files:
            # per (flat, param group) range, as the in-memory shard tensors are: one chunk per key
            for _, a, b in f.shard_ranges(f.group_bounds):
                for s in f.metadata(a, b):
                    for slot, (skey, _) in offload.state_slots():
                        key = f"{OPTIM}{skey}/{s.name}"
                        tensors[key] = in_files.add(key, slot, f, a + s.shard_range[0], a + s.shard_range[1])
                        chunks[key] = (_global_offset(s), math.prod(s.global_shape))
                        if first:
                            counted.add(key)
    for name, buf in _persistent_buffers(engine.module):
        tensors[BUFFER + name] = buf
        if engine.layout.dp_rank == 0:  # buffers are replicated over dp
            counted.add(BUFFER + name)
    if rng:
        tensors.update(_rng_entries(rank))
        counted.update(k for k in tensors if k.startswith(f"{RNG}{rank}/"))
    return tensors, chunks, scalars


def _share_bytes(tensors: dict, counted: set) -> int:
    """The bytes this rank counts towards the whole save (summed over the ranks: what DCP writes)."""
    return sum(tensors[k].numel() * tensors[k].element_size() for k in counted)


def _persistent_buffers(module: torch.nn.Module):
    """``(name, buffer)`` of the buffers in the module's ``state_dict``. A non-persistent buffer is
    derived (rotary tables) or must be transient between steps (``MoELayer.load_since_update`` is
    zeroed by the bias update that ends each step), so it is not saved."""
    for mod_name, mod in module.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in mod._non_persistent_buffers_set:
                yield (f"{mod_name}.{name}" if mod_name else name), buf


@torch.no_grad()
def _init_optimizer_state(engine) -> None:
    """Create the optimizer's lazily built state (torch optimizers build it in their first step) by
    one step with zero gradients at lr 0, which leaves every weight as it is (weight decay is
    scaled by lr); the load then overwrites the state."""
    offload = getattr(engine, "_nvme", None)
    shards = [t for f in engine.flats for _, _, _, t in f.shards]
    if offload.state_in_files if offload is not None else all(engine.optimizer.state.get(t) for t in shards):
        return
    lrs = [g["lr"] for g in engine.optimizer.param_groups]
    for g in engine.optimizer.param_groups:
        g["lr"] = 0.0
    if offload is None:
        for t in shards:
            t.grad = torch.zeros_like(t)
    try:
        if offload is not None:  # through the files, a sub-group at a time
            offload.step(1.0, zero_grads=True)
        else:
            engine.optimizer.step()
    finally:
        for t in shards:
            t.grad = None
        for g, lr in zip(engine.optimizer.param_groups, lrs):
            g["lr"] = lr


# DCP warns on every single-process save and load (and again from an async save's thread) that it
# assumes one process, even when told so with ``no_dist=True``: noise for us, filtered for DCP only
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    module="torch.distributed.checkpoint",
)


_warned: set = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def _meta(engine, step: int, extra: dict | None) -> dict:
    layout = engine.layout
    return {
        "format": FORMAT,
        "step": int(step),
        "engine_step": engine.step_count,
        "engine_skipped_steps": engine.skipped_steps,  # non-finite steps skipped so far (not in step_count)
        "layout": {
            "world": layout.world,
            "pp": layout.pp,
            "dp": layout.dp,
            "ep": layout.ep,
            "stage": engine.stage,
            "offload": engine.offload,
            "offload_mode": getattr(engine, "offload_mode", "cpu" if engine.offload else "none"),
            "mixed_precision": engine.mixed_precision,
        },
        "optimizer": type(engine.optimizer).__name__,
        "torch": torch.__version__,
        "extra": extra or {},
    }
