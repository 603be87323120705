"""Flat parameter groups: parameters laid end to end in one buffer, padded, and this rank's shard.

Shapes follow the project's legend (docs/design.md): N real elements of the group, W ranks in its
sharding group (``dp`` for dense parameters, ``edp`` for expert parameters), P = N rounded up to a
multiple of W, C = P / W elements of each rank's chunk. Rank w owns the flat slice
``[w * C, (w + 1) * C)``; the padding is zero in weights, gradients and
moments, so it never changes a norm or an update.

Buffers of one group (what exists depends on the stage, see ``ZeroEngine``):
- ``full_P``: the compute weights (compute dtype); every parameter's ``.data`` is a view into it.
  Under stage 3 its storage is resized to zero between uses and refilled by an all-gather.
- ``shard_C``: stage 3's own slice of the compute weights, kept between uses (None with
  ``offload="nvme"``: in the offload files, read before each gather through ``shard_source``, a
  ``zero.nvme.shards.ShardPool``; then even one rank "gathers", from its file).
- ``grad_full_P``: local gradients, summed over the micro-batches of a step (no communication in
  between); stages 2-3 free it once it has been reduce-scattered.
- ``grad_shard_C``: the summed gradient of this rank's slice (stages 2-3), kept from step to step;
  a group of one rank takes ``grad_full_P`` over as its shard and frees it after the step.
- ``master``: the fp32 master weights of this rank's optimizer range, on the optimizer device (a
  view of the compute weights when those are fp32 on that device; None with ``offload="nvme"``,
  whose master weights are in files, ``zero.nvme``). The optimizer (any elementwise
  ``torch.optim.Optimizer``, see ``ZeroEngine``) holds 1-D views of it, one per param group's range,
  and keeps its own state (Adam's moments, SGD's momentum) for them.
- ``secondary``: hpZ's node-local slice of the gathered weights (P / k elements, k the group's
  members on this node; ``zero.zeropp``), kept from a block's first gather until the weights change.

Every collective goes through the engine's ``zero.comm.CommCounter`` (``comm``), which counts its
bytes per link tier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from routing_kernels.runtime import expert_shard, group_rank, group_size

from .comm import CommCounter
from .zeropp import Pending, ZeroPP, quantized_all_gather, quantized_reduce_scatter


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _is_allocated(t: torch.Tensor) -> bool:
    return t.untyped_storage().size() > 0


@dataclass(frozen=True)
class ParamSlice:
    """Which part of one parameter a rank's shard holds, so a shard written under one layout can be
    placed under another.

    ``shape`` is the tensor this process holds; ``global_shape`` the parameter of the whole model
    (for experts, dimension 0 runs over all E experts and this process holds
    ``[expert_offset, expert_offset + shape[0])``). ``param_range`` is the held range of the
    parameter's flattened elements, ``shard_range`` where those elements sit in the shard buffer.
    """

    name: str
    shape: tuple
    global_shape: tuple
    expert_offset: int | None
    param_range: tuple[int, int]
    shard_range: tuple[int, int]


class FlatGroup:
    """One unit's dense or expert parameters as a flat buffer sharded over ``group``."""

    def __init__(
        self,
        names,
        params,
        kind: str,
        group,
        *,
        stage: int,
        compute_dtype,
        opt_device,
        offload: bool | str,
        comm: CommCounter | None = None,
        zpp: ZeroPP | None = None,
        tier: tuple | None = None,
    ):
        """``tier``: ``(intra_group, inter_group, (n, k))`` of ``group`` (``zero.Layout``'s node tier),
        needed by hpZ and qgZ."""
        self.comm = comm if comm is not None else CommCounter()
        self.zpp = zpp if zpp is not None else ZeroPP()
        self.intra_group, self.inter_group, self.split = tier if tier is not None else (None, None, None)
        self.names = list(names)
        self.params = list(params)
        self.kind = kind  # "dense" or "expert"
        self.group = group
        self.stage = stage
        self.world = group_size(group)
        self.rank = group_rank(group)
        self.shapes = [tuple(p.shape) for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.offsets = [0]
        for n in self.numels[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = sum(self.numels)
        self.padded = -(-self.numel // self.world) * self.world
        self.shard_numel = self.padded // self.world
        self.lo, self.hi = self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel
        self.compute_dtype = compute_dtype
        self.device = self.params[0].device
        self.opt_device = opt_device
        self.offload = offload
        # stage 3 with offload="nvme": the compute shard lives in the offload files (zero.nvme.shards)
        self.params_in_files = stage == 3 and offload == "nvme"
        self.shard_source = None  # the engine's ShardPool, when params_in_files
        self.written = [False] * len(self.params)  # which gradient slices hold this step's values
        self.grad_full_P: torch.Tensor | None = None
        self.grad_shard_C: torch.Tensor | None = None
        self.gather_handle = None
        # hpZ pays only where the group spans nodes: inside one node the secondary is the primary
        self.hpz = self.zpp.hpz and self.sharded_params and self.split is not None and self.split[0] > 1
        self.secondary: torch.Tensor | None = None
        if self.hpz:
            k = self.split[1]
            self.secondary_numel = self.padded // k
            self.secondary_lo = group_rank(self.intra_group) * self.secondary_numel
        self.qgz = self.zpp.qgz and self.stage >= 1 and self.world > 1
        self.master_sink = None  # offload="nvme": where load() sends the master weights (zero.nvme)

    # ----- set-up -------------------------------------------------------------------------------
    @torch.no_grad()
    def allocate(self) -> None:
        """The buffers the optimizer's shard tensors are views of (the master slice), and the compute
        buffer they may alias; no values, no communication. ``load`` fills them. Between the two the
        engine builds and checks the optimizer, so a bad optimizer stops before any collective and
        leaves the model untouched. (Stages 0-2 allocate the full compute buffer here: until ``load``
        rebinds the parameters, the engine's construction holds the weights twice.)"""
        opt_lo, opt_hi = self.opt_range
        # fp32 compute on the optimizer's device: the compute slice itself is the master copy
        self.separate_master = self.compute_dtype != torch.float32 or bool(self.offload)
        if self.sharded_params:
            self.full_P = None  # created (and freed) by load: the weights' gather target
            self.shard_C = None
            if not self.params_in_files:  # else in the files, with the master (zero.nvme.shards)
                self.shard_C = torch.zeros(self.shard_numel, dtype=self.compute_dtype, device=self.device)
            own = self.shard_C
        else:
            self.full_P = torch.zeros(self.padded, dtype=self.compute_dtype, device=self.device)
            self.shard_C = None
            own = self.full_P[opt_lo:opt_hi]
        self.own_compute = own  # the compute weights refreshed from the master after each step
        if self.offload == "nvme":
            self.master = None  # in the files of zero.nvme, which cuts the shard tensors itself
        elif self.separate_master:
            pin = self.offload and torch.cuda.is_available()
            self.master = torch.zeros(own.numel(), dtype=torch.float32, device=self.opt_device, pin_memory=pin)
        else:
            self.master = own

    @torch.no_grad()
    def load(self, sync_src_global_rank: int | None) -> None:
        """Lay the parameters' values into the buffers (broadcast from ``sync_src_global_rank`` first,
        when given) and make the parameters views of the flat buffer."""
        master_src_P = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
        for p, off, n in zip(self.params, self.offsets, self.numels):
            master_src_P[off : off + n].copy_(p.detach().reshape(-1))
        if sync_src_global_rank is not None and self.world > 1:
            # every replica starts from the same weights, as DDP and FSDP's sync_module_states do
            self.comm.broadcast(master_src_P, sync_src_global_rank, self.group, label="setup")
        if self.sharded_params:
            if self.shard_C is not None:  # else master_sink writes the compute shard too
                self.shard_C.copy_(master_src_P[self.lo : self.hi])
            self.full_P = torch.empty(self.padded, dtype=self.compute_dtype, device=self.device)
        else:
            self.full_P.copy_(master_src_P)
        for p, off, n, shape in zip(self.params, self.offsets, self.numels, self.shapes):
            p.data = self.full_P[off : off + n].view(shape)
        if self.sharded_params:
            _free(self.full_P)
        if self.separate_master:
            opt_lo, opt_hi = self.opt_range
            if self.master is None:  # offload="nvme": into its files
                self.master_sink(self, master_src_P[opt_lo:opt_hi])
            else:
                self.master.copy_(master_src_P[opt_lo:opt_hi])
        if self.stage <= 1:  # full-size gradients live as long as the engine
            self.grad_full_P = torch.zeros(self.padded, dtype=self.compute_dtype, device=self.device)

    def shard_ranges(self, bounds: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """``(param_group, a, b)`` for each flat range ``[a, b)`` of one param group that this rank's
        optimizer updates, given each group's flat range ``(param_group, start, end)``; the
        padding belongs to no group, so it stays zero whatever the optimizer does."""
        opt_lo, opt_hi = self.opt_range
        out = []
        for g, start, end in bounds:
            a, b = max(start, opt_lo), min(end, opt_hi)
            if a < b:
                out.append((g, a, b))
        return out

    @property
    def opt_range(self) -> tuple[int, int]:
        # stage 0 replicates the optimizer: every rank updates the whole flat
        return (0, self.padded) if self.stage == 0 else (self.lo, self.hi)

    # ----- stage 3: gather and free -------------------------------------------------------------
    @property
    def sharded_params(self) -> bool:
        return self.stage == 3 and (self.world > 1 or self.params_in_files)

    def is_gathered(self) -> bool:
        return not self.sharded_params or _is_allocated(self.full_P)

    def start_gather(self) -> None:
        if self.is_gathered() or self.gather_handle is not None:
            return
        self.full_P.untyped_storage().resize_(self.padded * self.full_P.element_size())
        if self.secondary is not None:  # hpZ: the node holds every slice since this step's first gather
            if self.intra_group is None:  # the node's only member of the group keeps the whole block
                self.full_P.copy_(self.secondary)
                self.gather_handle = Pending()
            else:
                work = self.comm.all_gather(
                    self.full_P, self.secondary, self.intra_group, label="param_gather_secondary", async_op=True
                )
                self.gather_handle = Pending(work)
            return
        # the secondary serves a backward: a forward without autograd (evaluation) leaves none behind
        keep = (self._keep_secondary,) if self.hpz and torch.is_grad_enabled() else ()
        shard = self.shard_C
        if self.shard_source is not None:  # read from the offload files, held until the gather is done
            shard = self.shard_source.acquire(self)
            keep += (lambda: self.shard_source.release(self),)
        if self.world == 1:  # offload="nvme" alone: the "gather" is the read, as the weights were
            self.full_P.copy_(shard)
            self.gather_handle = Pending(None, *keep)
        elif self.zpp.qwz:
            pending = quantized_all_gather(self.full_P, shard, self.group, self.zpp.block, self.comm, "param_gather")
            pending.then.extend(keep)
            self.gather_handle = pending
        else:
            work = self.comm.all_gather(self.full_P, shard, self.group, label="param_gather", async_op=True)
            self.gather_handle = Pending(work, *keep)

    def _keep_secondary(self) -> None:
        lo = self.secondary_lo
        self.secondary = self.full_P[lo : lo + self.secondary_numel].clone()

    def wait_gather(self) -> None:
        if self.gather_handle is None:
            self.start_gather()
        if self.gather_handle is not None:
            self.gather_handle.wait()
            self.gather_handle = None

    def free_params(self) -> None:
        if self.sharded_params:
            if self.gather_handle is not None:  # a prefetch nobody used: finish it before freeing
                self.gather_handle.wait()
                self.gather_handle = None
            _free(self.full_P)

    # ----- gradients ----------------------------------------------------------------------------
    @torch.no_grad()
    def accumulate(self, index: int, grad: torch.Tensor) -> None:
        """Add one parameter's fresh local gradient into the flat gradient buffer."""
        if self.grad_full_P is None:
            self.grad_full_P = torch.empty(self.padded, dtype=self.compute_dtype, device=self.device)
            self.grad_full_P[self.numel :].zero_()
        off, n = self.offsets[index], self.numels[index]
        dst = self.grad_full_P[off : off + n]
        if self.written[index]:
            dst.add_(grad.reshape(-1))
        else:  # the first gradient of a step overwrites: no separate zeroing pass
            dst.copy_(grad.reshape(-1))
            self.written[index] = True

    @torch.no_grad()
    def _complete_local_grads(self) -> None:
        if self.grad_full_P is None:
            self.grad_full_P = torch.zeros(self.padded, dtype=self.compute_dtype, device=self.device)
        for i, w in enumerate(self.written):
            if not w:  # a parameter this rank did not use still takes part in the reduction
                off, n = self.offsets[i], self.numels[i]
                self.grad_full_P[off : off + n].zero_()
                self.written[i] = True

    @torch.no_grad()
    def launch_reduce(self):
        """Start the gradient reduction (summed over the group; the 1/dp is applied by the step)."""
        self._complete_local_grads()
        if self.world == 1:
            return None
        if self.stage == 0:
            return self.comm.all_reduce(self.grad_full_P, self.group, label="grad_reduce", async_op=True)
        if self.stage == 1:
            # in place into this rank's slice of the full buffer (NCCL's documented in-place form,
            # recvbuff = sendbuff + rank * count; gloo copies its input first): no second buffer
            out = self.grad_full_P[self.lo : self.hi]
        else:
            if self.grad_shard_C is None:
                self.grad_shard_C = torch.empty(self.shard_numel, dtype=self.compute_dtype, device=self.device)
            out = self.grad_shard_C
        if self.qgz:  # qgZ has read all of the local gradient before it writes out (stage 1's lies inside it)
            return quantized_reduce_scatter(
                out,
                self.grad_full_P,
                intra=self.intra_group,
                inter=self.inter_group,
                split=self.split,
                bits=self.zpp.qgz_bits,
                block=self.zpp.block,
                comm=self.comm,
            )
        return self.comm.reduce_scatter(out, self.grad_full_P, self.group, label="grad_reduce", async_op=True)

    @torch.no_grad()
    def finish_reduce(self) -> None:
        """After the reduction: keep what the stage keeps."""
        if self.stage >= 1 and self.world == 1:
            # nothing to scatter: the whole local buffer is this rank's shard
            if self.stage >= 2:
                self.grad_shard_C = self.grad_full_P
                self.grad_full_P = None
        elif self.stage >= 2:
            self.grad_full_P = None
        self.written = [False] * len(self.params)

    def reduced_grad(self) -> torch.Tensor:
        """The summed gradient of the slice this rank's optimizer updates."""
        if self.stage == 0:
            return self.grad_full_P
        if self.stage == 1:
            return self.grad_full_P[self.lo : self.hi] if self.world > 1 else self.grad_full_P
        return self.grad_shard_C

    def norm_slice(self) -> torch.Tensor:
        """This rank's disjoint part of the reduced gradient, for a norm that counts each element once."""
        if self.stage == 0:
            return self.grad_full_P[self.lo : self.hi]
        return self.reduced_grad()

    def discard_grads(self) -> None:
        self.written = [False] * len(self.params)
        if self.stage >= 2:
            self.grad_full_P = None
            if self.world == 1:
                # the shard is the whole local buffer (finish_reduce), consumed by the step: kept, it
                # would sit beside the next step's buffer, two full gradients where one is needed
                self.grad_shard_C = None

    # ----- after the optimizer ------------------------------------------------------------------
    @torch.no_grad()
    def launch_param_gather(self):
        """Stages 1-2: every rank's updated slice back into everyone's full weights. Runs after every
        change of the weights (a step, a checkpoint load), so it also drops hpZ's secondary slice."""
        self.secondary = None
        if self.stage in (1, 2) and self.world > 1:
            # in place: the input is this rank's slice of the output, as NCCL documents
            return self.comm.all_gather(
                self.full_P, self.full_P[self.lo : self.hi], self.group, label="param_update_gather", async_op=True
            )
        return None

    # ----- metadata -----------------------------------------------------------------------------
    def metadata(self, lo: int | None = None, hi: int | None = None) -> list[ParamSlice]:
        """The parameter slices in the flat range ``[lo, hi)`` (default: this rank's optimizer range),
        with ``shard_range`` counted from ``lo``."""
        if lo is None:
            lo, hi = self.opt_range
        out = []
        for name, p, shape, off, n in zip(self.names, self.params, self.shapes, self.offsets, self.numels):
            a, b = max(off, lo), min(off + n, hi)
            if a >= b:
                continue
            mark = expert_shard(p)
            expert_offset = None if mark is None else mark.offset
            global_shape = shape if mark is None else (mark.num_experts,) + tuple(shape[1:])
            out.append(ParamSlice(name, shape, global_shape, expert_offset, (a - off, b - off), (a - lo, b - lo)))
        return out
