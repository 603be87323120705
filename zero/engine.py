"""``ZeroEngine``: data parallelism (ZeRO stages 0-3, CPU offload) for any ``nn.Module`` and any
elementwise torch optimizer, composed with expert parallelism. Stage 0 is the plain replicated
data parallelism (DDP's all-reduce) through the same code: one API for every stage.

    engine = ZeroEngine(model, layout, stage=3, max_grad_norm=1.0,
                        optimizer=lambda groups: torch.optim.AdamW(groups, lr=3e-4, weight_decay=0.1),
                        param_groups=lambda name, p: {} if p.dim() >= 2 else {"weight_decay": 0.0})
    for micro_batches in loader:                      # one optimizer step
        with engine.no_sync():                        # local accumulation, no communication
            for x, y in micro_batches[:-1]:
                engine.backward(loss_fn(engine(x), y) / len(micro_batches))
        x, y = micro_batches[-1]
        engine.backward(loss_fn(engine(x), y) / len(micro_batches))   # reduction overlaps this backward
        engine.lr = schedule(step)                    # or engine.optimizer.param_groups[i]["lr"] = ...
        grad_norm = engine.step()                     # clip, the optimizer on the shards, re-gather (1-2)

(``loss.backward()`` works as well as ``engine.backward(loss)``, and ``model(x)`` as ``engine(x)``.)

What each stage keeps per rank (W ranks of the sharding group):
    stage 0: weights, gradients, fp32 optimizer state, all full size (gradients all-reduced);
    stage 1: full weights and gradients, optimizer state (master weights + moments) of a 1/W slice;
             gradients are reduce-scattered, each rank updates its slice and all-gathers the weights;
    stage 2: stage 1, but only the 1/W gradient slice outlives the backward;
    stage 3: stage 2, and the weights are a 1/W slice too: each block's weights are all-gathered
             just before its forward and again before its backward, and freed after each; the next
             block's gather is started (async) while the current block computes.
Dense parameters shard over ``layout.dp_group``; expert parameters (marked by the experts module,
``routing_kernels.runtime.expert_shard``) over ``layout.edp_group``.

The reduction rule that makes every layout train like one process on the global batch (each
rank's loss the mean over its own micro-batch, all micro-batches the same size): dense gradients
are averaged over dp; an expert's gradient already sums every rank of its ep group (the All-to-All
backward brings it home), so it is summed over its edp replicas and divided by dp (not by edp:
that is the classic "expert gradients ep-times too large" bug). The reduction sums; the step
multiplies by 1/dp. The clipping norm counts each parameter once across dp, ep and pp.

The optimizer (``optimizer=``, a factory): the engine hands it param groups over *shard tensors*,
not over the model's parameters. Each unit's dense and expert parameters are laid end to end in a
flat buffer, grouped by param group, so this rank's slice of the flat (the whole flat under stage
0) is a few contiguous ranges, one per param group; each range is one 1-D fp32 tensor (a view of
the master weights, on the optimizer's device) in the optimizer group of its param group. Group i
of ``engine.optimizer.param_groups`` is param group i (with the options given for it), on every
rank, possibly empty on some. Before ``optimizer.step()`` each shard tensor's ``.grad`` is its
slice of the reduced gradient times 1/dp and the clip coefficient (an optimizer with
``fuses_scale_and_copy``, ``routing_kernels.FusedAdamW``, takes the factor inside its kernel
instead); afterwards the compute weights are refreshed from the masters (bf16 copy, offload copy
back) and stages 1-2 all-gather them. So any optimizer whose update of an element reads only that
element's parameter, gradient and state (and per-group scalars) trains exactly as unsharded: torch's
SGD, Adam, AdamW, Adagrad, RMSprop, ... and ``routing_kernels.FusedAdamW`` (the default). An
optimizer that needs whole tensors (Adafactor's factored moments, Muon's orthogonalised matrix
updates, LBFGS's line search) is refused, and so is one the engine does not know, unless its class
says ``elementwise = True``. A parameter that got no gradient in a step is stepped with a zero
gradient (torch.optim would skip it: weight decay and momentum still move it here).

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

Non-finite steps are skipped on every rank alike (``zero.stepping``).

ZeRO++ (``zero.zeropp``; each option on its own or together, for dense and expert parameters):
``hpz=True`` (stage 3) keeps a node-local secondary partition so the backward's gather stays inside
the node, bit for bit the same training; ``qwz=True`` (stage 3) moves the weights' all-gathers as
int8 with fp32 scales per ``quant_block`` elements; ``qgz=True`` (stages 1-3) reduces the
gradients by a hierarchical quantized all-to-all (``qgz_bits`` 4 or 8), intra-node then
inter-node. A node is ``layout.node_size`` consecutive ranks. ``comm_bytes()``: the bytes this
rank sent in the last optimizer step, ``{"intra": ..., "inter": ...}`` per link tier, counted by
``zero.comm``'s model at every collective the engine issues.

Not supported: a block whose forward runs more than once per backward (weight sharing inside a
block list across iterations of a loop); several backward passes per micro-batch outside
``no_sync()``; sparse gradients.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from routing_kernels.runtime import expert_shard

from .admission import build_optimizer, check_elementwise, optimizer_factory, resolve_param_groups
from .comm import CommCounter
from .gather import GatherHooks
from .layout import Layout
from .nvme import NvmeOffload, ShardPool, cut_pieces, offload_mode
from .nvme import check_arguments as check_offload_arguments
from .reduction import GradReduction
from .stepping import OptimizerStep
from .units import build_units, check_blocks, default_blocks
from .zeropp import check_options as check_zeropp

# default_blocks and check_elementwise were defined here before units and admission were split out
__all__ = ["ZeroEngine", "default_blocks", "check_elementwise"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class ZeroEngine(GatherHooks, GradReduction, OptimizerStep):
    """ZeRO data parallelism over ``layout`` for ``model`` (see the module docstring).

    ``optimizer``: a factory ``groups -> torch.optim.Optimizer`` called once with a list of param
    groups over this rank's shard tensors (``[{"params": [1-D fp32 tensors], **options}, ...]``, one
    per param group, in order) that must return an optimizer over exactly those groups, e.g.
    ``lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9)``. Default:
    ``routing_kernels.FusedAdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)``
    (the Triton kernel on CUDA, its reference elsewhere); ``lr, betas, eps, weight_decay`` configure
    that default only and are refused next to a factory (give them to it). The optimizer is
    ``engine.optimizer``: its state is keyed by the shard tensors that ``shard_metadata()`` describes.

    ``param_groups``: the torch way over the model's parameters, either a list of dicts
    (``[{"params": decay_params, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 1e-3}]``;
    every trainable parameter in exactly one group; parameters with ``requires_grad=False`` are
    ignored) or a function ``(name, param) -> dict of options`` (parameters with equal options share a
    group, groups in order of first appearance). The options reach the factory's groups unchanged and
    override the optimizer's defaults, as in torch. Default: one group of every trainable parameter.

    ``max_grad_norm``: clip the global gradient 2-norm, each parameter counted once across dp, ep and
    pp. ``offload``: ``"none"`` (or False), ``"cpu"`` (or True): optimizer state, master weights and
    the update on the CPU (ZeRO-Offload; on a CPU-only machine the placement is unchanged but the
    separate fp32 master copy and the copies in and out still run), or ``"nvme"``: the update on the
    CPU too, with the master weights and the optimizer's per-element state in files under
    ``offload_dir`` streamed through three host buffer sets of ``offload_sub_group_elems`` elements
    per state tensor (ZeRO-Infinity, ``zero.nvme``; ``optimizer.state`` then holds only per-tensor
    scalars between steps, and the optimizer's tensors are sub-group pieces of the shards); at
    stage 3 the compute-dtype parameter shards are in those files too, read before each gather.
    ``mixed_precision``: ``"fp32"`` everywhere or ``"bf16"`` compute weights and gradients with fp32
    master weights and optimizer state (floating inputs of the model are cast to bf16). ``blocks``:
    the submodules gathered and reduced together (default ``default_blocks(model)``).
    ``keep_gathered_across_microbatches`` (stage 3): gather each block once per optimizer step and
    keep it until the step, for pipeline stages that run several micro-batches through the same
    weights. ``prefetch`` (stage 3): start the next block's gather early. ``sync_module_states``:
    broadcast the weights from the first rank of each group at start-up. ``entries``: the modules
    whose forward starts a forward pass (default ``[model]``); a pipeline rank passes its stage
    modules, which run the layers ``model`` holds (``zero.pipeline``). ``start_reduction()``
    launches the reduction of what ``no_sync()`` accumulated without waiting (``step()`` waits),
    and ``accumulate_param_grads(params)`` takes gradients that were assigned to ``.grad``
    directly: the pipeline uses both.

    ``hpz``, ``qwz``, ``qgz``, ``qgz_bits`` (4 or 8), ``quant_block`` (elements per fp32 scale):
    ZeRO++, see the module docstring and ``zero.zeropp``.

    ``engine.lr = x`` sets the lr of every optimizer group (reading it needs them equal); per-group
    learning rates go through ``engine.optimizer.param_groups`` (or a ``torch.optim.lr_scheduler``
    over ``engine.optimizer``). Every argument, the param groups and the optimizer the factory builds
    are checked before the first collective, so a bad value stops each rank alike with a message,
    and the model is left untouched.
    """

    def __init__(
        self,
        model: nn.Module,
        layout: Layout | None = None,
        *,
        stage: int = 0,
        optimizer=None,
        param_groups=None,
        lr: float | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        weight_decay: float | None = None,
        max_grad_norm: float | None = None,
        offload: bool | str = False,
        offload_dir: str | os.PathLike | None = None,
        offload_sub_group_elems: int | None = None,
        mixed_precision: str = "fp32",
        blocks: list[nn.Module] | None = None,
        keep_gathered_across_microbatches: bool = False,
        prefetch: bool = True,
        sync_module_states: bool = True,
        entries: list[nn.Module] | None = None,
        hpz: bool = False,
        qwz: bool = False,
        qgz: bool = False,
        qgz_bits: int = 4,
        quant_block: int = 256,
    ):
        # every check happens before the first collective, so a bad value stops each rank alike
        factory, entries = self._check_arguments(
            model,
            layout,
            stage=stage,
            mixed_precision=mixed_precision,
            optimizer=optimizer,
            default_optimizer=dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay),
            max_grad_norm=max_grad_norm,
            keep_gathered=keep_gathered_across_microbatches,
            entries=entries,
        )
        offload_mode_ = offload_mode(offload)
        offload_dir, sub_group_elems = check_offload_arguments(offload_mode_, offload_dir, offload_sub_group_elems)
        named, device = self._trainable_parameters(model)
        blocks, module_names = check_blocks(model, blocks)
        group_of, group_options = resolve_param_groups(param_groups, named)  # param -> group index; options
        self._check_expert_counts(named, layout)
        zpp = check_zeropp(stage, layout, hpz=hpz, qwz=qwz, qgz=qgz, qgz_bits=qgz_bits, quant_block=quant_block)

        self.module = model
        self.layout = layout if layout is not None else Layout.single()
        self.stage = stage
        self.max_grad_norm = max_grad_norm
        self.offload = offload_mode_ != "none"  # the optimizer runs on the host (cpu or nvme)
        self.offload_mode = offload_mode_
        self.mixed_precision = mixed_precision
        self.compute_dtype = _DTYPES[mixed_precision]
        self.keep_gathered = keep_gathered_across_microbatches
        self.prefetch = prefetch
        self.device = device
        self.opt_device = torch.device("cpu") if self.offload else self.device
        self.step_count = 0
        self.last_grad_norm: float | None = None  # what the last step() returned
        self.last_step_skipped = False  # the last step() found a non-finite value and changed nothing
        self.skipped_steps = 0  # steps skipped so far
        self.last_nonfinite: list[int] = []  # per entry of the last step's extra_finite: ranks where it was False
        self.last_extra_sums: list[float] = []  # the last step's extra_sums, each entry summed over the ranks
        self.zpp = zpp
        self.comm = CommCounter.for_layout(self.layout)  # every collective below goes through it

        self.units = build_units(
            named,
            blocks,
            module_names,
            group_of,
            self.layout,
            stage=stage,
            compute_dtype=self.compute_dtype,
            opt_device=self.opt_device,
            offload="nvme" if offload_mode_ == "nvme" else self.offload,
            comm=self.comm,
            zpp=zpp,
        )
        self.flats = [f for u in self.units for f in u.flats]
        # offload="nvme": the optimizer's tensors are the sub-group pieces of the files (zero.nvme)
        plan = cut_pieces(self.flats, sub_group_elems) if offload_mode_ == "nvme" else None
        self.root = next((u for u in self.units if u.is_root), None)
        self.param_group_names = [[n for n, p in named if group_of[p] == gi] for gi in range(len(group_options))]
        # the optimizer over the shard tensors, checked before the first collective
        self.optimizer = build_optimizer(factory, group_options, self.flats)
        self._fused_step = bool(getattr(self.optimizer, "fuses_scale_and_copy", False))
        self._nvme = None
        if plan is not None:  # opens and reserves the files; every rank raises if one cannot
            groups = [self.layout.dp_group, self.layout.pp_group]
            shard_dtype = self.compute_dtype if stage == 3 else None  # stage 3: the shards in the files too
            self._nvme = NvmeOffload(
                plan,
                self.optimizer,
                offload_dir,
                device=device,
                groups=groups,
                fused=self._fused_step,
                shard_dtype=shard_dtype,
            )
            if stage == 3:
                self._nvme.shards = ShardPool(self._nvme, self.flats, device)
            for f in self.flats:
                f.master_sink = self._nvme.write_master
                f.shard_source = self._nvme.shards

        self._load_values(sync_module_states)  # the first collective
        self.comm.end_setup()  # the counts per step start here
        self._init_reduction()  # gradient hooks, per-step state (zero.reduction)
        self._init_forward(entries)  # forward hooks, gather_stats (zero.gather)

    @staticmethod
    def _check_arguments(
        model, layout, *, stage, mixed_precision, optimizer, default_optimizer, max_grad_norm, keep_gathered, entries
    ):
        """``(optimizer factory, entries)`` from the arguments, each checked (in this order, so the
        first bad one is named)."""
        if not isinstance(model, nn.Module):
            raise ValueError(f"model={type(model).__name__} must be a torch.nn.Module")
        if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
            raise ValueError(f"stage={stage!r} must be one of 0, 1, 2, 3")
        if mixed_precision not in _DTYPES:
            raise ValueError(f"mixed_precision={mixed_precision!r} must be one of {tuple(_DTYPES)}")
        factory = optimizer_factory(optimizer, **default_optimizer)
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm!r} must be > 0, or None for no clipping")
        if layout is not None and not isinstance(layout, Layout):
            raise ValueError(f"layout={type(layout).__name__} must be a zero.Layout or None (one process)")
        if keep_gathered and stage != 3:
            raise ValueError(f"keep_gathered_across_microbatches=True only applies to stage 3, got stage={stage}")
        entries = [model] if entries is None else list(entries)
        if not entries or not all(isinstance(e, nn.Module) for e in entries):
            raise ValueError(
                f"entries={entries!r} must be a non-empty list of modules whose forward starts a forward pass"
            )
        return factory, entries

    @staticmethod
    def _trainable_parameters(model: nn.Module) -> tuple[list, torch.device]:
        """``(name, param)`` of each parameter that requires a gradient, and their one device."""
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no parameter that requires a gradient")
        devices = {p.device for _, p in named}
        if len(devices) != 1:
            raise ValueError(
                f"the model's parameters lie on several devices {sorted(map(str, devices))}; move it to one first"
            )
        for n, p in named:
            if not p.is_floating_point():
                raise ValueError(f"parameter {n} has dtype {p.dtype}; only floating-point parameters can be trained")
        return named, next(iter(devices))

    @staticmethod
    def _check_expert_counts(named, layout) -> None:
        ep = 1 if layout is None else layout.ep
        for n, p in named:
            mark = expert_shard(p)
            if mark is not None and p.shape[0] * ep != mark.num_experts:
                raise ValueError(
                    f"{n} holds {p.shape[0]} of {mark.num_experts} experts but the layout has ep={ep}; "
                    f"build the MoE layers with the layout's ep_group"
                )

    def _load_values(self, sync_module_states: bool) -> None:
        """The weights into the flat buffers, broadcast from the first rank of each group."""
        dense_src = self._group_src(self.layout.dp_group) if sync_module_states else None
        expert_src = self._group_src(self.layout.edp_group) if sync_module_states else None
        for f in self.flats:
            f.load(dense_src if f.kind == "dense" else expert_src)

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

    def accumulate_param_grads(self, params) -> None:
        """Move gradients that were assigned to ``p.grad`` directly, rather than accumulated by
        autograd, into the engine's buffers (torch's pipelining does this in the weight-gradient
        pass of its zero-bubble schedules). Call it inside ``no_sync()``."""
        if self._sync:
            raise RuntimeError(
                "accumulate_param_grads() runs inside no_sync(): reduce with start_reduction() or step()"
            )
        for p in params:
            if p.grad is None or p not in self._where:
                continue
            _, flat, index = self._where[p]
            flat.accumulate(index, p.grad)
            p.grad = None
            self._unreduced = True

    def start_reduction(self) -> None:
        """Start reducing the gradients accumulated under ``no_sync()`` now, without waiting
        (``step()`` waits): a pipeline stage calls it after its last backward of the step, so the
        reduction overlaps what the other stages still compute."""
        if self._backward_open:
            self._finish_backward()
        if self._unreduced:
            self._reduce_all(wait=False)

    def zero_grad(self) -> None:
        """Discard gradients accumulated since the last step (``step()`` already consumes them)."""
        if self._backward_open:
            raise RuntimeError("zero_grad() during a backward pass")
        if self._reducing:  # collectives in flight must complete on every rank alike
            self._wait_reductions()
        for f in self.flats:
            f.discard_grads()
        self._unreduced = False
        self._reduced = False

    def comm_bytes(self, breakdown: bool = False) -> dict:
        """The bytes this rank sent in the last optimizer step (from the end of the step before to
        the end of that one), ``{"intra": ..., "inter": ...}`` by link tier (``zero.comm``'s model);
        ``breakdown=True``: the same per label (``param_gather``, ``grad_reduce``, ...). Bytes
        the engine's construction sent are in ``engine.comm.setup``."""
        if breakdown:
            return self.comm.breakdown(self.comm.last)
        return self.comm.totals(self.comm.last)

    def shard_metadata(self) -> list[dict]:
        """What this rank's optimizer holds, one entry per flat group, so that shards written under
        one layout can be placed under another. ``params``: the parameter slices of the flat's
        optimizer range (``shard_range`` from its start); ``shard_tensors``: each tensor the
        optimizer holds for this flat, with ``param_group`` and ``index`` (it is
        ``engine.optimizer.param_groups[g]["params"][j]`` for ``index == (g, j)``, its state
        ``engine.optimizer.state[that tensor]``), its ``flat_range`` and the parameter slices it
        holds (``shard_range`` counted from the tensor's start)."""
        position = {
            id(t): (g, j) for g, group in enumerate(self.optimizer.param_groups) for j, t in enumerate(group["params"])
        }
        out = []
        for u in self.units:
            for f in u.flats:
                lo, hi = f.opt_range
                out.append(
                    {
                        "unit": u.name,
                        "kind": f.kind,
                        "group_size": f.world,
                        "group_rank": f.rank,
                        "flat_numel": f.numel,
                        "flat_padded": f.padded,
                        "flat_range": (lo, hi),
                        "params": f.metadata(),
                        "shard_tensors": [
                            {
                                "param_group": g,
                                "index": position[id(t)],
                                "flat_range": (a, b),
                                "params": f.metadata(a, b),
                            }
                            for g, a, b, t in f.shards
                        ],
                    }
                )
        return out

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """fp32 master weights of every parameter this process holds (experts: its ep slice), gathered
        over the sharding groups. A collective: every rank must call it."""
        out = {}
        for f in self.flats:
            master = (f.master if f.master is not None else self._nvme.read_master(f)).to(self.device)
            if f.stage == 0 or f.world == 1:
                full = master
            else:
                full = torch.empty(f.padded, dtype=torch.float32, device=self.device)
                self.comm.all_gather(full, master.contiguous(), f.group, label="inspect")
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
        if self._reducing:
            self._wait_reductions()
        if not self._reduced:
            raise RuntimeError("full_gradients() found no gradients: run a backward pass first")
        out = {}
        for f in self.flats:
            g = f.reduced_grad().float()
            if f.stage != 0 and f.world > 1:
                full = torch.empty(f.padded, dtype=torch.float32, device=g.device)
                self.comm.all_gather(full, g.contiguous(), f.group, label="inspect")
                g = full
            for n, off, k, shape in zip(f.names, f.offsets, f.numels, f.shapes):
                out[n] = (g[off : off + k].view(shape) / self.layout.dp).cpu()
        return out

    def remove_hooks(self) -> None:
        for h in self._hooks + self._grad_hooks:
            h.remove()
        self._hooks, self._grad_hooks = [], []
