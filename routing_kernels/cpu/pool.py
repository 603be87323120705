"""The CPU expert path's large buffers, kept from step to step: a small caching allocator per set of
expert weights (``pool_for``)."""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

_HAS_USE_COUNT = hasattr(torch._C, "_storage_Use_Count")


class BufferPool:
    """The block path's large buffers (``routing_kernels.cpu.blocks``), kept from step to step.

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

    # below this a buffer comes straight from the heap: glibc reuses small freed blocks without
    # faults, and pooling them only takes memory the step's other temporaries would have reused
    # (measured: pooling 1 MB saved blocks at S2 raised faults per step from 25k to 37k; 4 MB ones
    # at S1 cut 58k to 25k). A class attribute, so that a test can pool every buffer of a tiny layer.
    min_bytes = 1 << 20

    def __init__(self):
        self._slots: dict[
            str, list[tuple[torch.Tensor, int]]
        ] = {}  # slot -> [(buffer, use count when only we hold it)]

    @staticmethod
    def _use_count(t: torch.Tensor) -> int:
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata)

    def held(self) -> int:
        """How many buffers the pool keeps, lent or free, over all slots."""
        return sum(len(v) for v in self._slots.values())

    def empty(self, slot: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape`` and ``like``'s dtype and device."""
        shape = torch.Size(shape)
        # a buffer made under inference mode is an inference tensor, which a later training step
        # could neither write in place nor save for backward: inference mode does not pool
        if (
            not _HAS_USE_COUNT
            or torch.is_inference_mode_enabled()
            or shape.numel() * like.element_size() < self.min_bytes
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

    def block(self, slot: str, rows: int, cols: int, like: torch.Tensor, block_rows: int) -> torch.Tensor:
        """``[rows, cols]`` with ``rows <= block_rows``: the first rows of a ``[block_rows, cols]``
        buffer, so that one buffer serves every block of a call, the ragged last one included."""
        if rows > block_rows:
            return like.new_empty(rows, cols)
        return self.empty(slot, (block_rows, cols), like)[:rows]


# keyed by w1, the Parameter object, which outlives ZeRO's ``p.data`` swaps: a layer's buffers are
# lent again to the same layer, step after step
_pools: WeakIdKeyDictionary = WeakIdKeyDictionary()


def pool_for(w1: torch.Tensor) -> BufferPool:
    """The pool of the expert weights whose first weight is ``w1`` (made on first use)."""
    pool = _pools.get(w1)
    if pool is None:
        pool = _pools[w1] = BufferPool()
    return pool
