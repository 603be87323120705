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

What each stage keeps per rank (P parameters, W ranks of the sharding group):
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

Non-finite steps: ``step()`` skips, on every rank alike, a step whose gradient norm is not finite
(a NaN or inf gradient on any rank, or a norm that overflows fp32) or whose ``extra_finite`` flags
(the caller's own checks, e.g. ``engine.step(extra_finite=torch.isfinite(loss))``: a loss that is
NaN on one rank only) are False on any rank. The flags ride in the all-reduce that sums the norm,
so the decision costs no extra collective and no extra host sync. A skipped step changes nothing:
weights, optimizer state (moments and step counts) and ``step_count`` stay as they were, the
gradients are dropped, and stage 3 frees its gathered weights as after a normal step. So a step
never writes a non-finite gradient into the weights; ``weights_finite()`` checks the weights
themselves (a collective). After each step: ``last_grad_norm`` (what step() returned),
``last_step_skipped``, ``skipped_steps`` (the total) and ``last_nonfinite`` (for each entry of
``extra_finite``, flattened, the number of ranks on which it was False). ``step(...,
skip_if_nonfinite=False)`` applies the step anyway.

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

# optimizers whose update of one element reads other elements of the same parameter: a ZeRO shard
# tensor is a 1-D slice of a flat buffer that holds several parameters end to end and, under
# stages 1-3, cuts through them, so the whole-tensor quantity they need is not there
_WHOLE_TENSOR = {
    "Adafactor": "keeps factored second moments (one statistic per row and per column of each matrix) and scales "
    "each update by its parameter's RMS, which need the parameter's whole 2-D tensor",
    "Muon": "orthogonalises each matrix's update (Newton-Schulz iterations over the parameter's 2-D shape)",
    "LBFGS": "keeps a history of whole flattened parameter vectors and re-evaluates a closure for its line search",
    "SparseAdam": "needs sparse gradients, and ZeRO reduces dense flat gradient buffers",
}
# optimizers known to update each element from its own parameter, gradient and state alone
_ELEMENTWISE = {
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
    routing_kernels.FusedAdamW,
}


def check_elementwise(opt) -> None:
    """Raise ValueError unless ``opt`` may run on ZeRO shard tensors (see the module docstring).
    A class or instance attribute ``elementwise`` (True or False) overrides what the engine knows."""
    name = type(opt).__name__
    flag = getattr(opt, "elementwise", None)
    why = next((_WHOLE_TENSOR[c.__name__] for c in type(opt).__mro__ if c.__name__ in _WHOLE_TENSOR), None)
    if flag is True:
        return
    # the exact class: a subclass may change the update (it declares ``elementwise = True`` if not)
    if flag is None and why is None and type(opt) in _ELEMENTWISE:
        return
    shard = (
        "ZeroEngine gives the optimizer 1-D shard tensors (slices of flat buffers that hold several parameters "
        "end to end and, under stages 1-3, cut through them; under stage 0 too)"
    )
    if why is not None:
        raise ValueError(
            f"optimizer {name} cannot run under ZeroEngine: it {why}; {shard}, so it would compute "
            f"something else than unsharded. Use an elementwise optimizer (AdamW, Adam, SGD, ...)."
        )
    if flag is False:
        raise ValueError(f"optimizer {name} says elementwise = False: its update needs whole tensors, and {shard}")
    raise ValueError(
        f"optimizer {name} is not known to be elementwise: {shard}, which is exact only for an optimizer "
        f"whose update of each element reads just that element's parameter, gradient and state (and "
        f"per-group scalars such as lr or the step count); per-tensor norms (LAMB, LARS) or matrix "
        f"shapes are not. If {name} is elementwise, set the class attribute {name}.elementwise = True"
    )


def _resolve_param_groups(param_groups, named) -> tuple[dict, list[dict]]:
    """(param -> group index, each group's options) from the ``param_groups`` argument."""
    if param_groups is None:
        return {p: 0 for _, p in named}, [{}]
    group_of, options = {}, []
    if callable(param_groups):
        for n, p in named:
            opts = param_groups(n, p)
            opts = {} if opts is None else opts
            if not isinstance(opts, dict) or "params" in opts:
                raise ValueError(
                    f"param_groups({n!r}, ...) returned {opts!r}; it must return a dict of group options "
                    f"(e.g. {{'weight_decay': 0.0}}) without 'params'"
                )
            if opts not in options:
                options.append(opts)
            group_of[p] = options.index(opts)
        return group_of, [dict(o) for o in options]
    if isinstance(param_groups, dict) or not isinstance(param_groups, (list, tuple)):
        raise ValueError(
            f"param_groups must be a list of dicts (torch's form) or a function (name, param) -> options, "
            f"got {type(param_groups).__name__}"
        )
    name_of = {id(p): n for n, p in named}  # the trainable parameters
    model_params = {}  # id -> the group that lists it
    for gi, g in enumerate(param_groups):
        if not isinstance(g, dict) or "params" not in g:
            raise ValueError(f"param_groups[{gi}] must be a dict with a 'params' entry, got {g!r:.80}")
        params = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise ValueError(
                    f"param_groups[{gi}]['params'] holds a {type(p).__name__}; it must hold the model's parameters"
                )
            if id(p) in model_params:
                raise ValueError(
                    f"parameter {name_of.get(id(p), '?')} is in param_groups[{model_params[id(p)]}] and "
                    f"param_groups[{gi}]; each parameter belongs to exactly one group"
                )
            model_params[id(p)] = gi
            if id(p) not in name_of and p.requires_grad:
                raise ValueError(
                    f"param_groups[{gi}] holds a tensor of shape {tuple(p.shape)} that is not a trainable "
                    f"parameter of the model"
                )
        options.append({k: v for k, v in g.items() if k != "params"})
    for n, p in named:
        if id(p) not in model_params:
            raise ValueError(f"parameter {n} is in no param group; list every trainable parameter in exactly one group")
        group_of[p] = model_params[id(p)]
    return group_of, options


def _check_optimizer(opt, given: list[list[int]]) -> None:
    """The factory's optimizer must be an elementwise torch optimizer over exactly the groups it was
    given (``given``: the ids of each group's shard tensors)."""
    if not isinstance(opt, torch.optim.Optimizer):
        raise ValueError(
            f"the optimizer factory returned {type(opt).__name__}; it must return a torch.optim.Optimizer "
            f"built over the param groups it is given"
        )
    check_elementwise(opt)
    got = [[id(t) for t in g["params"]] for g in opt.param_groups]
    if got == given:
        return
    shard_ids = {i for g in given for i in g}
    held = [i for g in got for i in g]
    if held and not shard_ids & set(held):
        raise ValueError(
            f"the optimizer from the factory holds {len(held)} tensors and none of the shard tensors it "
            f"was given: build it over the factory's argument (lambda groups: "
            f"torch.optim.AdamW(groups, ...)), not over model.parameters()"
        )
    raise ValueError(
        f"the optimizer from the factory must keep the {len(given)} param groups it is given, in order and "
        f"unchanged (sizes {[len(g) for g in given]}); it has {len(got)} groups of sizes "
        f"{[len(g) for g in got]}"
    )


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
    pp. ``offload``: optimizer state, master weights and the update on the CPU (ZeRO-Offload); on a
    CPU-only machine the placement is unchanged but the separate fp32 master copy and the copies in
    and out still run. ``mixed_precision``: ``"fp32"`` everywhere or ``"bf16"`` compute weights and
    gradients with fp32 master weights and optimizer state (floating inputs of the model are cast to
    bf16). ``blocks``: the submodules gathered and reduced together (default ``default_blocks(model)``).
    ``keep_gathered_across_microbatches`` (stage 3): gather each block once per optimizer step and
    keep it until the step, for pipeline stages that run several micro-batches through the same
    weights. ``prefetch`` (stage 3): start the next block's gather early. ``sync_module_states``:
    broadcast the weights from the first rank of each group at start-up. ``entries``: the modules
    whose forward starts a forward pass (default ``[model]``); a pipeline rank passes its stage
    modules, which run the layers ``model`` holds (``zero.pipeline``). ``start_reduction()``
    launches the reduction of what ``no_sync()`` accumulated without waiting (``step()`` waits),
    and ``accumulate_param_grads(params)`` takes gradients that were assigned to ``.grad``
    directly: the pipeline uses both.

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
        offload: bool = False,
        mixed_precision: str = "fp32",
        blocks: list[nn.Module] | None = None,
        keep_gathered_across_microbatches: bool = False,
        prefetch: bool = True,
        sync_module_states: bool = True,
        entries: list[nn.Module] | None = None,
    ):
        # every check happens before the first collective, so a bad value stops each rank alike
        if not isinstance(model, nn.Module):
            raise ValueError(f"model={type(model).__name__} must be a torch.nn.Module")
        if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
            raise ValueError(f"stage={stage!r} must be one of 0, 1, 2, 3")
        if mixed_precision not in _DTYPES:
            raise ValueError(f"mixed_precision={mixed_precision!r} must be one of {tuple(_DTYPES)}")
        adamw_kw = {
            k: v for k, v in dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay).items() if v is not None
        }
        if optimizer is not None:
            if isinstance(optimizer, torch.optim.Optimizer):
                raise ValueError(
                    f"optimizer={type(optimizer).__name__}(...) is an optimizer; pass a factory instead, "
                    f"e.g. optimizer=lambda groups: torch.optim.AdamW(groups, lr=3e-4): the engine "
                    f"builds it over its shard tensors, not over the model's parameters"
                )
            if not callable(optimizer):
                raise ValueError(
                    f"optimizer={optimizer!r} must be a callable mapping param groups to a torch.optim.Optimizer"
                )
            if adamw_kw:
                raise ValueError(
                    f"{', '.join(f'{k}={v!r}' for k, v in adamw_kw.items())} configure the default "
                    f"optimizer only; with optimizer=... give them to the factory"
                )
        lr, betas = adamw_kw.get("lr", 1e-3), adamw_kw.get("betas", (0.9, 0.999))
        eps, weight_decay = adamw_kw.get("eps", 1e-8), adamw_kw.get("weight_decay", 0.0)
        if not (isinstance(lr, (int, float)) and lr >= 0):
            raise ValueError(f"lr={lr!r} must be a number >= 0")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas={betas!r} must be two numbers in [0, 1)")
        if not eps > 0:
            raise ValueError(f"eps={eps!r} must be > 0")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay={weight_decay!r} must be >= 0")
        if optimizer is None:
            kw = dict(
                lr=float(lr), betas=tuple(float(b) for b in betas), eps=float(eps), weight_decay=float(weight_decay)
            )
            optimizer = lambda groups: routing_kernels.FusedAdamW(groups, **kw)  # noqa: E731
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm!r} must be > 0, or None for no clipping")
        if layout is not None and not isinstance(layout, Layout):
            raise ValueError(f"layout={type(layout).__name__} must be a zero.Layout or None (one process)")
        if keep_gathered_across_microbatches and stage != 3:
            raise ValueError(f"keep_gathered_across_microbatches=True only applies to stage 3, got stage={stage}")
        entries = [model] if entries is None else list(entries)
        if not entries or not all(isinstance(e, nn.Module) for e in entries):
            raise ValueError(
                f"entries={entries!r} must be a non-empty list of modules whose forward starts a forward pass"
            )
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
                    raise ValueError(
                        f"block {module_names[sub]!r} lies inside block {module_names[b]!r}; blocks must not nest"
                    )

        group_of, group_options = _resolve_param_groups(param_groups, named)  # param -> group index; options
        ep = 1 if layout is None else layout.ep
        for n, p in named:
            mark = expert_shard(p)
            if mark is not None and p.shape[0] * ep != mark.num_experts:
                raise ValueError(
                    f"{n} holds {p.shape[0]} of {mark.num_experts} experts but the layout has ep={ep}; "
                    f"build the MoE layers with the layout's ep_group"
                )
        self.module = model
        self.layout = layout if layout is not None else Layout.single()
        self.stage = stage
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
        self.last_step_skipped = False  # the last step() found a non-finite value and changed nothing
        self.skipped_steps = 0  # steps skipped so far
        self.last_nonfinite: list[int] = []  # per entry of the last step's extra_finite: ranks where it was False
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
        self.units: list[_Unit] = []
        for key in [None] + blocks:
            items = per_unit[key]
            flats = []
            for kind, group in (("dense", L.dp_group), ("expert", L.edp_group)):
                chosen = [(n, p) for n, p in items if is_expert_param(p) == (kind == "expert")]
                if not chosen:
                    continue
                # grouped by param group: any shard of the flat is then one contiguous range per group
                chosen.sort(key=lambda np_: group_of[np_[1]])
                f = FlatGroup(
                    [n for n, _ in chosen],
                    [p for _, p in chosen],
                    kind,
                    group,
                    stage=stage,
                    compute_dtype=self.compute_dtype,
                    opt_device=self.opt_device,
                    offload=offload,
                )
                f.allocate()  # no values and no communication yet: the optimizer is checked first
                bounds, off = [], 0
                for gi in sorted({group_of[p] for _, p in chosen}):
                    k = sum(p.numel() for _, p in chosen if group_of[p] == gi)
                    bounds.append((gi, off, off + k))
                    off += k
                f.group_bounds = bounds  # (param group, flat start, flat end)
                opt_lo = f.opt_range[0]
                # one shard tensor per (flat, param group) range this rank's optimizer updates
                f.shards = [(gi, a, b, f.master[a - opt_lo : b - opt_lo]) for gi, a, b in f.shard_ranges(bounds)]
                flats.append(f)
            if flats:
                self.units.append(_Unit("<root>" if key is None else module_names[key], key, flats))
        self.flats = [f for u in self.units for f in u.flats]
        self.param_group_names = [[n for n, p in named if group_of[p] == gi] for gi in range(len(group_options))]

        # ----- the optimizer over the shard tensors, checked before the first collective
        groups = [
            dict(options, params=[t for f in self.flats for g, _, _, t in f.shards if g == gi])
            for gi, options in enumerate(group_options)
        ]
        expected = [[id(t) for t in g["params"]] for g in groups]
        try:
            self.optimizer = optimizer(groups)
        except Exception as e:  # e.g. Muon refuses 1-D tensors itself
            raise ValueError(
                f"the optimizer factory failed on the engine's param groups, whose tensors are 1-D fp32 "
                f"shards of flat buffers ({type(e).__name__}: {e}); an optimizer that needs whole "
                f"parameter tensors (Muon's orthogonalised updates, Adafactor's factored moments) "
                f"cannot run under ZeroEngine"
            ) from e
        _check_optimizer(self.optimizer, expected)
        self._fused_step = bool(getattr(self.optimizer, "fuses_scale_and_copy", False))

        # ----- values: broadcast from the first rank of each group, laid into the flat buffers
        dense_src = self._group_src(L.dp_group) if sync_module_states else None
        expert_src = self._group_src(L.edp_group) if sync_module_states else None
        for f in self.flats:
            f.load(dense_src if f.kind == "dense" else expert_src)
        self.root = next((u for u in self.units if u.is_root), None)
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
        self._reducing = False  # reductions launched by start_reduction(), not yet waited for
        self._reduced = False  # reduced gradients wait for step()
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

    @torch.no_grad()
    def weights_finite(self) -> bool:
        """True when every trainable weight is finite, on every rank: each rank checks the master
        weights its optimizer updates (its shards; all of them under stage 0) and one all-reduce
        over dp (and pp) combines them. A collective: every rank must call it."""
        bad = torch.zeros((), dtype=torch.float32, device=self.device)
        for f in self.flats:
            for _, _, _, t in f.shards:
                bad += (~torch.isfinite(t)).sum().to(self.device, torch.float32)
        for group in (self.layout.dp_group, self.layout.pp_group):
            if group is not None:
                dist.all_reduce(bad, group=group)
        return bad.item() == 0

    @property
    def lr(self) -> float:
        """The learning rate of every optimizer group (an error if they differ: read
        ``engine.optimizer.param_groups`` then)."""
        lrs = {g["lr"] for g in self.optimizer.param_groups}
        if len(lrs) != 1:
            raise AttributeError(
                f"the optimizer's groups have different learning rates {sorted(lrs)}; "
                f"read them from engine.optimizer.param_groups"
            )
        return next(iter(lrs))

    @lr.setter
    def lr(self, value: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = value

    @torch.no_grad()
    def step(self, extra_finite: torch.Tensor | None = None, *, skip_if_nonfinite: bool = True) -> float:
        """Clip, run the optimizer on every shard tensor, refresh the compute weights, drop the
        gradients. Returns the global gradient 2-norm before clipping (each parameter counted once).

        A non-finite step is skipped on every rank (see "Non-finite steps" in the module docstring):
        when the norm, or any entry of any rank's ``extra_finite`` (a bool tensor, True where the
        caller's quantity is finite, e.g. ``torch.isfinite(loss)``; the same shape on every rank),
        is not finite, nothing is updated and the gradients are dropped. ``extra_finite`` travels in
        the norm's all-reduce. ``skip_if_nonfinite=False`` steps anyway (the old behaviour)."""
        if extra_finite is not None and not (
            isinstance(extra_finite, torch.Tensor) and extra_finite.dtype == torch.bool
        ):
            got = (
                f"a tensor of dtype {extra_finite.dtype}"
                if isinstance(extra_finite, torch.Tensor)
                else type(extra_finite).__name__
            )
            raise ValueError(
                f"extra_finite must be a bool tensor (True where the quantity is finite, e.g. "
                f"torch.isfinite(loss)), got {got}"
            )
        if self._backward_open:
            self._finish_backward()
        if self._unreduced:  # every backward of this step ran under no_sync: reduce now
            self._reduce_all()
        if self._reducing:  # start_reduction() launched it
            self._wait_reductions()
        if not self._reduced:
            raise RuntimeError("step() found no gradients: run a backward pass since the last step() or zero_grad()")
        self._reduced = False
        # the reduction summed over the group: 1/dp makes dense gradients the dp mean and expert
        # gradients (summed over ep by the All-to-All and over edp here) the global-batch ones
        grad_scale = 1.0 / self.layout.dp
        norm, self.last_nonfinite = self._global_grad_norm(extra_finite)
        self.last_grad_norm = norm
        self.last_step_skipped = skip_if_nonfinite and (not math.isfinite(norm) or any(self.last_nonfinite))
        if self.last_step_skipped:  # the same decision on every rank: the inputs were all-reduced
            self.skipped_steps += 1
            self._release_step()
            return norm
        if self.max_grad_norm is not None:
            # torch.nn.utils.clip_grad_norm_'s coefficient, folded into the same factor
            grad_scale *= min(1.0, self.max_grad_norm / (norm + 1e-6))
        self.step_count += 1
        copies, copy_after = {}, []
        shards = []
        for f in self.flats:
            if not f.shards:
                continue
            grad = f.reduced_grad()
            if grad.device != f.master.device or grad.dtype != torch.float32:
                # bf16 or offloaded: one fp32 copy on the optimizer's device for the whole shard
                grad = grad.to(f.master.device, dtype=torch.float32)
            if not self._fused_step and grad_scale != 1.0:
                grad.mul_(grad_scale)  # in place: the reduced gradient is consumed by this step
            opt_lo = f.opt_range[0]
            for _, a, b, t in f.shards:
                t.grad = grad[a - opt_lo : b - opt_lo]
                shards.append(t)
            if f.separate_master:
                if self._fused_step and f.own_compute.device == f.master.device:
                    # the kernel writes the (bf16) compute weights in the same pass
                    for _, a, b, t in f.shards:
                        copies[t] = f.own_compute[a - opt_lo : b - opt_lo]
                else:  # offloaded to the host: one transfer after the update, not one per tensor
                    copy_after.append(f)
        if self._fused_step:
            self.optimizer.step(grad_scale=grad_scale, param_copies=copies)
        else:
            self.optimizer.step()
        for t in shards:
            t.grad = None
        for f in copy_after:
            f.own_compute.copy_(f.master, non_blocking=True)
        handles = [h for h in (f.launch_param_gather() for f in self.flats) if h is not None]
        for h in handles:
            h.wait()
        self._release_step()
        return norm

    def _release_step(self) -> None:
        """The end of every step, taken or skipped: the gradients are consumed, and under stage 3
        the gathered weights are freed (stale after an update; the next forward gathers anew)."""
        for f in self.flats:
            f.discard_grads()
        if self.stage == 3:
            for u in self.units:
                self._free_unit(u)

    def shard_metadata(self) -> list[dict]:
        """What this rank's optimizer holds, one entry per flat group, so that shards written under
        one layout can be placed under another. ``params``: the parameter slices of the flat's
        optimizer range (``shard_range`` from its start); ``shard_tensors``: each tensor the optimizer holds for this flat, with ``param_group`` and
        ``index`` (it is ``engine.optimizer.param_groups[g]["params"][j]`` for ``index == (g, j)``,
        its state ``engine.optimizer.state[that tensor]``), its ``flat_range`` and the parameter
        slices it holds (``shard_range`` counted from the tensor's start)."""
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
        if self._reducing:
            self._wait_reductions()
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
        return sum(
            1
            for u in self.units
            if not u.is_root
            and u.has_sharded_params()
            and any(f.is_gathered() or f.gather_handle is not None for f in u.flats if f.sharded_params)
        )

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
                raise RuntimeError(
                    "a second backward outside no_sync() before step(): gradients were already "
                    "reduced; run every micro-batch but the last inside engine.no_sync()"
                )
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

    def _reduce_all(self, wait: bool = True) -> None:
        self._bwd_queue = list(dict.fromkeys(reversed(self._fwd_order)))  # a unit run twice reduces once
        self._bwd_queue += [u for u in self.units if u not in self._bwd_queue]
        for u in self._bwd_queue:
            self._launch(u)
        self._unreduced = False
        self._reducing = True
        if wait:
            self._wait_reductions()

    def _wait_reductions(self) -> None:
        for u in self._bwd_queue:
            for h in u.handles:
                h.wait()
            for f in u.flats:
                f.finish_reduce()
            u.handles, u.launched, u.ready, u.arrived = [], False, False, 0
        self._unreduced = False
        self._reducing = False
        self._reduced = True

    def _global_grad_norm(self, extra_finite: torch.Tensor | None = None) -> tuple[float, list[int]]:
        """The global gradient norm, and for each entry of ``extra_finite`` the number of ranks on
        which it is False: one all-reduce over dp (and pp) carries both, and a non-finite gradient
        on any rank makes the summed square non-finite everywhere."""
        # each rank's norm slices are disjoint: dense over dp, expert slices over edp and distinct
        # experts over ep, so one sum over dp (and pp) counts every parameter once
        sq = torch.zeros(1, dtype=torch.float32, device=self.device)
        for f in self.flats:
            g = f.norm_slice()
            sq += torch.linalg.vector_norm(g, dtype=torch.float32).square().to(self.device)
        if extra_finite is not None:
            sq = torch.cat([sq, (~extra_finite.reshape(-1)).to(self.device, torch.float32)])
        L = self.layout
        if L.dp_group is not None:
            dist.all_reduce(sq, group=L.dp_group)
        if L.pp_group is not None:
            dist.all_reduce(sq, group=L.pp_group)
        values = sq.tolist()  # the step's one host sync
        return math.sqrt(values[0]) / L.dp, [int(v) for v in values[1:]]
