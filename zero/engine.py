"""``ZeroEngine``: ZeRO stages 0-3 with CPU offload, for any ``nn.Module``, composed with expert parallelism.

    engine = ZeroEngine(model, layout, stage=3, lr=3e-4, weight_decay=0.1, max_grad_norm=1.0)
    for micro_batches in loader:                      # one optimizer step
        with engine.no_sync():                        # local accumulation, no communication
            for x, y in micro_batches[:-1]:
                engine.backward(loss_fn(engine(x), y) / len(micro_batches))
        x, y = micro_batches[-1]
        engine.backward(loss_fn(engine(x), y) / len(micro_batches))   # reduction overlaps this backward
        grad_norm = engine.step()                     # clip, AdamW on the shards, re-gather (1-2)

What each stage keeps per rank (P parameters, W ranks of the sharding group):
    stage 0: weights, gradients, fp32 optimizer state, all full size (gradients all-reduced);
    stage 1: full weights and gradients, optimizer state (master weights + moments) of a 1/W slice;
             gradients are reduce-scattered, each rank updates its slice and all-gathers the weights;
    stage 2: stage 1, but only the 1/W gradient slice outlives the backward;
    stage 3: stage 2, and the weights are a 1/W slice too: each block's weights are all-gathered
             just before its forward and again before its backward, and freed after each; the next
             block's gather is started (async) while the current block computes.
Dense parameters shard over ``layout.dp_group``; expert parameters (marked by the experts module, ``routing_kernels.runtime.expert_shard``) over
``layout.edp_group``. Gradients are summed by the reduction and multiplied by 1/dp inside the
update, which is exactly the stage-0 rule of ``zero.grad_sync`` (dense averaged over dp, experts
summed over edp and divided by dp).

Blocks ("units"): by default each child of the model (a ``ModuleList``/``ModuleDict`` child is
expanded into its entries, so ``model.layers[i]`` is a block); parameters outside every block form a
root unit that is gathered for the whole forward and backward. Each unit's dense and expert
parameters are flat buffers (``zero.flat.FlatGroup``); under stages 0-2 they are also the gradient
buckets: a unit's reduction starts as soon as its last gradient has arrived, while the rest of the
backward runs.

Gradient accumulation: backward passes inside ``no_sync()`` only add local gradients into the flat
buffers; the first backward outside it (or ``step()`` itself, if every backward was inside) reduces
once. Like FSDP's ``no_sync``, stages 2-3 hold full-size local gradients while accumulating.

A parameter shared by two blocks (tied embeddings) joins the root unit. Activation checkpointing
works: a block's forward re-run inside the backward finds its weights gathered. Parameters with
``requires_grad=False`` are left alone (replicated, not sharded).

Under stage 3 a parameter's storage is empty outside its block's forward and backward: read weights
with ``full_parameters()`` (or the shards with ``shard_metadata()``), not ``model.state_dict()``.
``p.grad`` stays None under every stage; ``full_gradients()`` returns the synchronised gradients.

Not supported: a block whose forward runs more than once per backward (weight sharing inside a
block list across iterations of a loop); several backward passes per micro-batch outside
``no_sync()``; sparse gradients.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

import routing_kernels
from routing_kernels.runtime import all_gather_into, expert_shard, in_backward, is_expert_param

from .flat import FlatGroup
from .layout import Layout

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# stage 3 holds the block that computes plus the one being prefetched, never more
_MAX_GATHERED = 2
_CPU_ADAM_CHUNK = 1 << 16  # elements: 256 KiB of fp32 per operand, within a core's L2


class _Unit:
    """A block: the parameters gathered, reduced and freed together."""

    def __init__(self, name: str, module: nn.Module | None, flats: list[FlatGroup]):
        self.name = name
        self.module = module  # None for the root unit
        self.flats = flats
        self.expected = sum(len(f.params) for f in flats)
        self.arrived = 0  # gradients accumulated in the current backward
        self.ready = False
        self.launched = False
        self.handles = []

    @property
    def is_root(self) -> bool:
        return self.module is None

    def is_gathered(self) -> bool:
        return all(f.is_gathered() for f in self.flats)

    def has_sharded_params(self) -> bool:
        return any(f.sharded_params for f in self.flats)


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """Each child of ``model``; a ``ModuleList``/``ModuleDict`` child contributes its entries."""
    blocks = []
    for child in model.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            blocks.extend(child.children())
        else:
            blocks.append(child)
    return blocks


class ZeroEngine:
    """ZeRO data parallelism over ``layout`` for ``model`` (see the module docstring).

    ``lr, betas, eps, weight_decay``: AdamW (decoupled weight decay on every parameter, as
    ``torch.optim.AdamW``). ``max_grad_norm``: clip the global gradient 2-norm, each parameter
    counted once across dp, ep and pp. ``offload``: optimizer state, master weights and the update on
    the CPU (ZeRO-Offload); on a CPU-only machine the placement is unchanged but the separate fp32
    master copy and the copies in and out still run. ``mixed_precision``: ``"fp32"`` everywhere or
    ``"bf16"`` compute weights and gradients with fp32 master weights and moments (floating inputs of
    the model are cast to bf16). ``blocks``: the submodules gathered and reduced together (default
    ``default_blocks(model)``). ``keep_gathered_across_microbatches`` (stage 3): gather each block once
    per optimizer step and keep it until the step, for pipeline stages that run several micro-batches
    through the same weights. ``prefetch`` (stage 3): start the next block's gather early.
    ``sync_module_states``: broadcast the weights from the first rank of each group at start-up.
    ``weight_decay_filter(name, param) -> bool``: which parameters decay (default all, as
    ``torch.optim.AdamW`` with one group); e.g. ``lambda n, p: p.dim() >= 2`` spares norm gains and biases.
    ``lr`` may be reassigned between steps (``engine.lr = schedule(step)``).
    """

    def __init__(self, model: nn.Module, layout: Layout | None = None, *, stage: int = 0, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 max_grad_norm: float | None = None, offload: bool = False, mixed_precision: str = "fp32",
                 blocks: list[nn.Module] | None = None, keep_gathered_across_microbatches: bool = False,
                 prefetch: bool = True, sync_module_states: bool = True, weight_decay_filter=None):
        # every check happens before the first collective, so a bad value stops each rank alike
        if not isinstance(model, nn.Module):
            raise ValueError(f"model={type(model).__name__} must be a torch.nn.Module")
        if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
            raise ValueError(f"stage={stage!r} must be one of 0, 1, 2, 3")
        if mixed_precision not in _DTYPES:
            raise ValueError(f"mixed_precision={mixed_precision!r} must be one of {tuple(_DTYPES)}")
        if not (isinstance(lr, (int, float)) and lr >= 0):
            raise ValueError(f"lr={lr!r} must be a number >= 0")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas={betas!r} must be two numbers in [0, 1)")
        if not eps > 0:
            raise ValueError(f"eps={eps!r} must be > 0")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay={weight_decay!r} must be >= 0")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm!r} must be > 0, or None for no clipping")
        if layout is not None and not isinstance(layout, Layout):
            raise ValueError(f"layout={type(layout).__name__} must be a zero.Layout or None (one process)")
        if keep_gathered_across_microbatches and stage != 3:
            raise ValueError(f"keep_gathered_across_microbatches=True only applies to stage 3, got stage={stage}")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no parameter that requires a gradient")
        devices = {p.device for _, p in named}
        if len(devices) != 1:
            raise ValueError(f"the model's parameters lie on several devices {sorted(map(str, devices))}; move it to one first")
        for n, p in named:
            if not p.is_floating_point():
                raise ValueError(f"parameter {n} has dtype {p.dtype}; only floating-point parameters can be trained")
        blocks = default_blocks(model) if blocks is None else list(blocks)
        module_names = {m: n for n, m in model.named_modules()}
        for b in blocks:
            if b not in module_names:
                raise ValueError(f"block {type(b).__name__} is not a submodule of the model")
            if b is model:
                raise ValueError("the model itself cannot be a block; its own parameters form the root unit")
        block_set = set(blocks)
        for b in blocks:
            for sub in b.modules():
                if sub is not b and sub in block_set:
                    raise ValueError(f"block {module_names[sub]!r} lies inside block {module_names[b]!r}; blocks must not nest")

        decays = (lambda n, p: True) if weight_decay_filter is None else weight_decay_filter
        ep = 1 if layout is None else layout.ep
        for n, p in named:
            mark = expert_shard(p)
            if mark is not None and p.shape[0] * ep != mark.num_experts:
                raise ValueError(f"{n} holds {p.shape[0]} of {mark.num_experts} experts but the layout has ep={ep}; "
                                 f"build the MoE layers with the layout's ep_group")
        self.module = model
        self.layout = layout if layout is not None else Layout.single()
        self.stage = stage
        self.lr, self.betas, self.eps, self.weight_decay = float(lr), tuple(betas), float(eps), float(weight_decay)
        self.max_grad_norm = max_grad_norm
        self.offload = offload
        self.mixed_precision = mixed_precision
        self.compute_dtype = _DTYPES[mixed_precision]
        self.keep_gathered = keep_gathered_across_microbatches
        self.prefetch = prefetch
        self.device = next(iter(devices))
        self.opt_device = torch.device("cpu") if offload else self.device
        self.step_count = 0
        self.last_grad_norm: float | None = None  # what the last step() returned
        # instrumentation: stage 3 gathers and the most blocks (root excluded) gathered at once
        self.gather_stats = {"gathers": 0, "prefetches": 0, "max_gathered_blocks": 0}

        # ----- units: each parameter belongs to the first block that contains it, else the root
        owner = {}
        for b in blocks:
            for p in b.parameters():
                # a parameter shared by two blocks (tied embeddings) must stay gathered while either
                # runs: it goes to the root unit, gathered for the whole forward and backward
                owner[p] = None if p in owner and owner[p] is not b else b
        per_unit: dict = {b: [] for b in blocks}
        per_unit[None] = []
        for n, p in named:
            per_unit[owner.get(p)].append((n, p))
        L = self.layout
        dense_src = self._group_src(L.dp_group)
        expert_src = self._group_src(L.edp_group)
        self.units: list[_Unit] = []
        for key in [None] + blocks:
            items = per_unit[key]
            flats = []
            for kind, group, src in (("dense", L.dp_group, dense_src), ("expert", L.edp_group, expert_src)):
                chosen = [(n, p) for n, p in items if is_expert_param(p) == (kind == "expert")]
                if not chosen:
                    continue
                # decayed parameters first: any shard of the flat is then one decayed range and one
                # undecayed range, two calls of the fused update
                chosen.sort(key=lambda np_: not decays(*np_))
                f = FlatGroup([n for n, _ in chosen], [p for _, p in chosen], kind, group, stage=stage,
                              compute_dtype=self.compute_dtype, opt_device=self.opt_device, offload=offload)
                f.decay_end = sum(p.numel() for n, p in chosen if decays(n, p))  # flat offset where decay stops
                f.build(src if sync_module_states else None)
                flats.append(f)
            if flats:
                self.units.append(_Unit("<root>" if key is None else module_names[key], key, flats))
        self.root = next((u for u in self.units if u.is_root), None)
        self.flats = [f for u in self.units for f in u.flats]
        self._where = {}
        self._grad_hooks = []
        for u in self.units:
            for f in u.flats:
                for i, p in enumerate(f.params):
                    self._where[p] = (u, f, i)
                    p.grad = None
                    self._grad_hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

        # ----- per-step state
        self._sync = True  # False inside no_sync()
        self._fwd_order: list[_Unit] = []  # units in the order the current/last forward ran them
        self._prev_fwd_order: list[_Unit] = []  # the forward before: predicts the next block to prefetch
        self._bwd_queue: list[_Unit] = []  # reduction order of the current backward
        self._backward_open = False  # a backward has started and not yet been finished
        self._unreduced = False  # local gradients accumulated under no_sync, not yet reduced
        self._reduced = False  # reduced gradients wait for step()
        self._hooks = [model.register_forward_pre_hook(self._root_pre_forward, with_kwargs=True),
                       model.register_forward_hook(self._root_post_forward)]
        for u in self.units:
            if not u.is_root:
                self._hooks.append(u.module.register_forward_pre_hook(self._make_pre_forward(u)))
                self._hooks.append(u.module.register_forward_hook(self._make_post_forward(u)))

    @staticmethod
    def _group_src(group) -> int | None:
        if group is None:
            return None
        return dist.get_global_rank(group, 0)

    # ----- user API -----------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, then make sure this backward's reductions are complete."""
        loss.backward()
        self._finish_backward()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate local gradients without any communication."""
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    def zero_grad(self) -> None:
        """Discard gradients accumulated since the last step (``step()`` already consumes them)."""
        if self._backward_open:
            raise RuntimeError("zero_grad() during a backward pass")
        for f in self.flats:
            f.discard_grads()
        self._unreduced = False
        self._reduced = False

    @torch.no_grad()
    def step(self) -> float:
        """Clip, update every shard with AdamW, refresh the compute weights, drop the gradients.
        Returns the global gradient 2-norm before clipping (each parameter counted once)."""
        if self._backward_open:
            self._finish_backward()
        if self._unreduced:  # every backward of this step ran under no_sync: reduce now
            self._reduce_all()
        if not self._reduced:
            raise RuntimeError("step() found no gradients: run a backward pass since the last step() or zero_grad()")
        self._reduced = False
        dp = self.layout.dp
        grad_scale = 1.0 / dp
        norm = self._global_grad_norm()
        if self.max_grad_norm is not None:
            # torch.nn.utils.clip_grad_norm_'s coefficient, folded into the update
            grad_scale *= min(1.0, self.max_grad_norm / (norm + 1e-6))
        self.step_count += 1
        b1, b2 = self.betas
        for f in self.flats:
            grad = f.reduced_grad()
            if grad.device != f.master.device:
                grad = grad.to(f.master.device, dtype=torch.float32)
            copy = f.own_compute if f.separate_master else None
            # offloaded to the host: update there, then one transfer instead of one per chunk
            copy_after = copy is not None and copy.device != f.master.device
            if copy_after:
                copy = None
            opt_lo, opt_hi = f.opt_range
            cut = min(max(f.decay_end - opt_lo, 0), opt_hi - opt_lo)  # decayed part of this shard: [0, cut)
            n = f.master.numel()
            # on the CPU the update runs over cache-sized chunks: the reference's temporaries then
            # stay small and in cache instead of costing fresh pages each step (~2x faster here);
            # a GPU kernel gets each range in one launch
            chunk = _CPU_ADAM_CHUNK if f.master.device.type == "cpu" else n
            for lo, hi, wd in ((0, cut, self.weight_decay), (cut, n, 0.0)):
                for a in range(lo, hi, chunk):
                    b = min(a + chunk, hi)
                    routing_kernels.fused_adamw(
                        f.master[a:b], grad[a:b], f.exp_avg[a:b], f.exp_avg_sq[a:b], step=self.step_count, lr=self.lr,
                        beta1=b1, beta2=b2, eps=self.eps, weight_decay=wd, grad_scale=grad_scale,
                        param_copy=None if copy is None else copy[a:b])
            if copy_after:
                f.own_compute.copy_(f.master, non_blocking=True)
        handles = [h for h in (f.launch_param_gather() for f in self.flats) if h is not None]
        for h in handles:
            h.wait()
        for f in self.flats:
            f.discard_grads()
        if self.stage == 3:  # gathered weights are stale now
            for u in self.units:
                self._free_unit(u)
        self.last_grad_norm = norm
        return norm

    def shard_metadata(self) -> list[dict]:
        """What this rank's optimizer shards hold: one entry per flat group (contract 6)."""
        out = []
        for u in self.units:
            for f in u.flats:
                lo, hi = f.opt_range
                out.append({
                    "unit": u.name, "kind": f.kind, "group_size": f.world, "group_rank": f.rank,
                    "flat_numel": f.numel, "flat_padded": f.padded, "flat_range": (lo, hi),
                    "params": f.metadata(),
                })
        return out

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """fp32 master weights of every parameter this process holds (experts: its ep slice), gathered
        over the sharding groups. A collective: every rank must call it."""
        out = {}
        for f in self.flats:
            master = f.master.to(self.device)
            if f.stage == 0 or f.world == 1:
                full = master
            else:
                full = torch.empty(f.padded, dtype=torch.float32, device=self.device)
                all_gather_into(full, master.contiguous(), f.group)
            for n, off, k, shape in zip(f.names, f.offsets, f.numels, f.shapes):
                out[n] = full[off : off + k].view(shape).clone().cpu()
        return out

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The synchronised gradient (what one process would hold on the global batch, before
        clipping) of every parameter this process holds, between the last backward and step().
        A collective: every rank must call it."""
        if self._backward_open:
            self._finish_backward()
        if self._unreduced:
            self._reduce_all()
        if not self._reduced:
            raise RuntimeError("full_gradients() found no gradients: run a backward pass first")
        out = {}
        for f in self.flats:
            g = f.reduced_grad().float()
            if f.stage != 0 and f.world > 1:
                full = torch.empty(f.padded, dtype=torch.float32, device=g.device)
                all_gather_into(full, g.contiguous(), f.group)
                g = full
            for n, off, k, shape in zip(f.names, f.offsets, f.numels, f.shapes):
                out[n] = (g[off : off + k].view(shape) / self.layout.dp).cpu()
        return out

    def remove_hooks(self) -> None:
        for h in self._hooks + self._grad_hooks:
            h.remove()
        self._hooks, self._grad_hooks = [], []

    # ----- forward hooks ------------------------------------------------------------------------
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

    def _make_pre_forward(self, unit: _Unit):
        def hook(module, args):
            if not in_backward():
                self._fwd_order.append(unit)
            if self.stage == 3:
                self._gather(unit)
                if not in_backward():
                    self._prefetch(self._neighbour(unit, +1))
        return hook

    def _make_post_forward(self, unit: _Unit):
        def hook(module, args, output):
            if in_backward():
                return  # recomputation for activation checkpointing: the backward frees it
            hooked = torch.is_grad_enabled() and self._register_pre_backward(unit, output)
            # an output the hook cannot see into (not a tensor, list, tuple or dict) gives no signal
            # before the block's backward: such a block stays gathered until the backward ends
            if self.stage == 3 and not self.keep_gathered and (hooked or not torch.is_grad_enabled()):
                self._free_unit(unit)
        return hook

    def _register_pre_backward(self, unit: _Unit, output) -> bool:
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: self._pre_backward(unit), mode="any")
        return bool(tensors)

    def _pre_backward(self, unit: _Unit) -> None:
        self._open_backward()
        if self.stage == 3:
            self._gather(unit)
            self._prefetch(self._neighbour(unit, -1))

    def _neighbour(self, unit: _Unit, direction: int) -> _Unit | None:
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
        return sum(1 for u in self.units if not u.is_root and u.has_sharded_params() and
                   any(f.is_gathered() or f.gather_handle is not None for f in u.flats if f.sharded_params))

    def _note_gathered(self) -> None:
        self.gather_stats["max_gathered_blocks"] = max(self.gather_stats["max_gathered_blocks"], self._count_gathered())

    def _gather(self, unit: _Unit) -> None:
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

    def _prefetch(self, unit: _Unit | None) -> None:
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

    def _free_unit(self, unit: _Unit) -> None:
        for f in unit.flats:
            f.free_params()

    # ----- backward: gradient arrival and reduction -------------------------------------------
    def _open_backward(self) -> None:
        if not self._backward_open:
            if self._sync and self._reduced:
                raise RuntimeError("a second backward outside no_sync() before step(): gradients were already "
                                   "reduced; run every micro-batch but the last inside engine.no_sync()")
            self._backward_open = True
            self._bwd_queue = list(dict.fromkeys(reversed(self._fwd_order)))  # a unit run twice reduces once
            self._bwd_queue += [u for u in self.units if u not in self._bwd_queue]
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _on_grad(self, p: torch.Tensor) -> None:
        self._open_backward()
        unit, flat, index = self._where[p]
        flat.accumulate(index, p.grad)
        p.grad = None  # the flat buffer holds it now
        unit.arrived += 1
        if unit.arrived == unit.expected:
            unit.ready = True
            if self.stage == 3 and not unit.is_root and not self.keep_gathered:
                self._free_unit(unit)
            if self._sync:
                self._launch_ready()

    def _launch_ready(self) -> None:
        # reductions start strictly in queue order, so every rank issues the same sequence of
        # collectives on each group even if its gradients arrive in a different order
        for u in self._bwd_queue:
            if u.launched:
                continue
            if not u.ready:
                break
            self._launch(u)

    def _launch(self, unit: _Unit) -> None:
        unit.launched = True
        unit.handles = [h for h in (f.launch_reduce() for f in unit.flats) if h is not None]

    def _finish_backward(self) -> None:
        if not self._backward_open:
            return
        self._backward_open = False
        if self._sync:
            for u in self._bwd_queue:  # units whose gradients never (all) arrived still reduce
                if not u.launched:
                    self._launch(u)
            self._wait_reductions()
        else:
            self._unreduced = True
            for u in self.units:
                u.arrived, u.ready = 0, False
        if self.stage == 3 and not (self.keep_gathered and not self._sync):
            for u in self.units:
                self._free_unit(u)

    def _reduce_all(self) -> None:
        self._bwd_queue = list(dict.fromkeys(reversed(self._fwd_order)))  # a unit run twice reduces once
        self._bwd_queue += [u for u in self.units if u not in self._bwd_queue]
        for u in self._bwd_queue:
            self._launch(u)
        self._wait_reductions()

    def _wait_reductions(self) -> None:
        for u in self._bwd_queue:
            for h in u.handles:
                h.wait()
            for f in u.flats:
                f.finish_reduce()
            u.handles, u.launched, u.ready, u.arrived = [], False, False, 0
        self._unreduced = False
        self._reduced = True

    def _global_grad_norm(self) -> float:
        # each rank's norm slices are disjoint: dense over dp, expert slices over edp and distinct
        # experts over ep, so one sum over dp (and pp) counts every parameter once
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for f in self.flats:
            g = f.norm_slice()
            sq += torch.linalg.vector_norm(g, dtype=torch.float32).square().to(self.device)
        L = self.layout
        if L.dp_group is not None:
            dist.all_reduce(sq, group=L.dp_group)
        if L.pp_group is not None:
            dist.all_reduce(sq, group=L.pp_group)
        return math.sqrt(sq.item()) / L.dp

