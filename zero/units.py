"""A ``ZeroEngine``'s units: the blocks whose parameters are gathered, reduced and freed together
(and the root unit of every parameter outside them), each holding its dense and its expert
parameters as flat groups (``zero.flat.FlatGroup``) cut into one shard tensor per param group."""

from __future__ import annotations

import torch.nn as nn

from routing_kernels.runtime import is_expert_param

from .flat import FlatGroup


class Unit:
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


def check_blocks(model: nn.Module, blocks: list[nn.Module] | None) -> tuple[list[nn.Module], dict]:
    """``(blocks, module name of each submodule)``: ``blocks`` (default ``default_blocks(model)``)
    checked to be submodules of ``model`` other than itself, none inside another."""
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
    return blocks, module_names


def build_units(named, blocks, module_names, group_of, layout, **flat_options) -> list[Unit]:
    """The units, the root first, then the blocks in order (a unit without trainable parameters is
    left out). ``named``: the trainable ``(name, param)``; ``group_of``: each one's param group;
    ``flat_options``: ``FlatGroup``'s ``stage``, ``compute_dtype``, ``opt_device``, ``offload`` (and
    ``comm``, ``zpp``); each flat gets its group's node tier from ``layout``."""
    per_unit = _parameters_per_unit(named, blocks)
    tiers = {
        "dense": (layout.dp_group, (layout.dp_intra_group, layout.dp_inter_group, layout.node_split("dp"))),
        "expert": (layout.edp_group, (layout.edp_intra_group, layout.edp_inter_group, layout.node_split("edp"))),
    }
    units = []
    for key in [None] + blocks:
        flats = []
        for kind, (group, tier) in tiers.items():
            chosen = [(n, p) for n, p in per_unit[key] if is_expert_param(p) == (kind == "expert")]
            if chosen:
                flats.append(_flat_group(chosen, kind, group, group_of, dict(flat_options, tier=tier)))
        if flats:
            units.append(Unit("<root>" if key is None else module_names[key], key, flats))
    return units


def _parameters_per_unit(named, blocks) -> dict:
    """``{block or None (the root): [(name, param), ...]}``: each parameter belongs to the first
    block that contains it, else the root."""
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
    return per_unit


def _flat_group(chosen, kind: str, group, group_of, flat_options: dict) -> FlatGroup:
    # grouped by param group: any shard of the flat is then one contiguous range per group
    chosen.sort(key=lambda np_: group_of[np_[1]])
    f = FlatGroup([n for n, _ in chosen], [p for _, p in chosen], kind, group, **flat_options)
    f.allocate()  # no values and no communication yet: the optimizer is checked first
    bounds, off = [], 0
    for gi in sorted({group_of[p] for _, p in chosen}):
        k = sum(p.numel() for _, p in chosen if group_of[p] == gi)
        bounds.append((gi, off, off + k))
        off += k
    f.group_bounds = bounds  # (param group, flat start, flat end)
    opt_lo = f.opt_range[0]
    # one shard tensor per (flat, param group) range this rank's optimizer updates (offload="nvme":
    # zero.nvme.cut_pieces cuts them, there is no master in memory to view)
    f.shards = (
        []
        if f.master is None
        else [(gi, a, b, f.master[a - opt_lo : b - opt_lo]) for gi, a, b in f.shard_ranges(bounds)]
    )
    return f
