"""``ZeroEngine``'s forward side: the hooks on its entry modules and blocks, and stage 3's
gathering of each block's weights.

The hooks record the order blocks run in (the next forward's prefetch follows the last one's order,
and the backward reduces in reverse), cast floating inputs to the compute dtype, and hook the
backward of each block's outputs. Under stage 3 a block's weights are all-gathered just before its
forward and again before its backward, and freed after each; the block expected next is gathered
asynchronously meanwhile (``prefetch``), with at most ``_MAX_GATHERED`` blocks gathered at once.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from routing_kernels.runtime import in_backward

from .units import Unit

# stage 3 holds the block that computes plus the one being prefetched, never more
_MAX_GATHERED = 2
# offload="nvme": the shards read from the files ahead of the block being gathered (zero.nvme.shards)
_READ_AHEAD = 2


class GatherHooks:
    """Mixed into ``ZeroEngine``: its forward hooks and stage-3 gathering. Owns ``gather_stats``,
    ``_fwd_order``, ``_prev_fwd_order`` and ``_hooks``; reads the engine's ``units``, ``root``,
    ``stage``, ``keep_gathered``, ``prefetch``, ``compute_dtype`` and ``_nvme`` (its shard pool);
    a block's backward starts with ``_open_backward`` (``zero.reduction``)."""

    def _init_forward(self, entries: list[nn.Module]) -> None:
        # instrumentation: stage 3 gathers and the most blocks (root excluded) gathered at once
        self.gather_stats = {"gathers": 0, "prefetches": 0, "max_gathered_blocks": 0}
        self._fwd_order: list[Unit] = []  # units in the order the current/last forward ran them
        self._prev_fwd_order: list[Unit] = []  # the forward before: predicts the next block to prefetch
        self._hooks = []
        for e in entries:
            self._hooks += [
                e.register_forward_pre_hook(self._root_pre_forward, with_kwargs=True),
                e.register_forward_hook(self._root_post_forward),
            ]
        for u in self.units:
            if not u.is_root:
                self._hooks.append(u.module.register_forward_pre_hook(self._make_pre_forward(u)))
                self._hooks.append(u.module.register_forward_hook(self._make_post_forward(u)))

    def _root_pre_forward(self, module, args, kwargs):
        if not in_backward():
            if self._fwd_order:
                self._prev_fwd_order = self._fwd_order
            self._fwd_order = []
        if self.root is not None and self.stage == 3:
            self._gather(self.root)
        if self.compute_dtype != torch.float32:
            cast = lambda t: t.to(self.compute_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            return tree_map(cast, args), tree_map(cast, kwargs)
        return None

    def _root_post_forward(self, module, args, output):
        if self.root is None:
            return
        if torch.is_grad_enabled() and not in_backward():
            self._register_pre_backward(self.root, output)
        elif self.stage == 3 and not torch.is_grad_enabled() and not self.keep_gathered:
            self._free_unit(self.root)

    def _make_pre_forward(self, unit: Unit):
        def hook(module, args):
            if not in_backward():
                self._fwd_order.append(unit)
            if self.stage == 3:
                if not in_backward():
                    self._read_ahead(unit, +1)
                self._gather(unit)
                if not in_backward():
                    self._prefetch(self._neighbour(unit, +1))

        return hook

    def _make_post_forward(self, unit: Unit):
        def hook(module, args, output):
            if in_backward():
                return  # recomputation for activation checkpointing: the backward frees it
            hooked = torch.is_grad_enabled() and self._register_pre_backward(unit, output)
            # an output the hook cannot see into (not a tensor, list, tuple or dict) gives no signal
            # before the block's backward: such a block stays gathered until the backward ends
            if self.stage == 3 and not self.keep_gathered and (hooked or not torch.is_grad_enabled()):
                self._free_unit(unit)

        return hook

    def _register_pre_backward(self, unit: Unit, output) -> bool:
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: self._pre_backward(unit), mode="any")
        return bool(tensors)

    def _pre_backward(self, unit: Unit) -> None:
        self._open_backward()
        if self.stage == 3:
            self._read_ahead(unit, -1)
            self._gather(unit)
            self._prefetch(self._neighbour(unit, -1))

    def _neighbour(self, unit: Unit, direction: int) -> Unit | None:
        """The block expected to run after ``unit``: in forward (+1) from the previous forward's
        order (registration order before there is one), in backward (-1) from this forward's."""
        if direction > 0:
            order = [u for u in self._prev_fwd_order if not u.is_root] or [u for u in self.units if not u.is_root]
        else:
            order = [u for u in self._fwd_order if not u.is_root]
        if unit not in order:
            return None
        i = order.index(unit) + direction
        return order[i] if 0 <= i < len(order) else None

    # ----- stage 3 gathering --------------------------------------------------------------------
    def _count_gathered(self) -> int:
        return sum(
            1
            for u in self.units
            if not u.is_root
            and u.has_sharded_params()
            and any(f.is_gathered() or f.gather_handle is not None for f in u.flats if f.sharded_params)
        )

    def _note_gathered(self) -> None:
        self.gather_stats["max_gathered_blocks"] = max(self.gather_stats["max_gathered_blocks"], self._count_gathered())

    def _gather(self, unit: Unit) -> None:
        if not unit.has_sharded_params():
            return
        if not unit.is_gathered() or any(f.gather_handle is not None for f in unit.flats):
            if not any(f.gather_handle is not None for f in unit.flats):
                self.gather_stats["gathers"] += 1
            for f in unit.flats:
                f.start_gather()
            self._note_gathered()
            for f in unit.flats:
                f.wait_gather()

    def _read_ahead(self, unit: Unit, direction: int) -> None:
        """offload="nvme": start reading the shards of ``unit`` and of the ``_READ_AHEAD`` blocks
        expected after it from the offload files (``zero.nvme.shards``), so that their reads overlap
        this block's gather and compute."""
        pool = self._nvme.shards if self._nvme is not None else None
        if pool is None:
            return
        units = [unit]
        for _ in range(_READ_AHEAD):
            nxt = self._neighbour(units[-1], direction)
            if nxt is None:
                break
            units.append(nxt)
        pool.read_ahead([f for u in units for f in u.flats])

    def _prefetch(self, unit: Unit | None) -> None:
        if unit is None or not self.prefetch or not unit.has_sharded_params() or unit.is_gathered():
            return
        if any(f.gather_handle is not None for f in unit.flats):
            return
        if self._count_gathered() >= _MAX_GATHERED:
            return  # the gather will happen on demand instead
        self.gather_stats["gathers"] += 1
        self.gather_stats["prefetches"] += 1
        for f in unit.flats:
            f.start_gather()
        self._note_gathered()

    def _free_unit(self, unit: Unit) -> None:
        for f in unit.flats:
            f.free_params()
