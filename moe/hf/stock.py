"""The stock way back from ``moe.hf.patch``: a patched model in transformers' own names and layouts.

``unpatch(model)`` is the inverse of ``patch``: the stock blocks back, holding the layers' current
weights in transformers' names and layout (experts gathered over the ep group), so
``save_pretrained`` writes what the stock class loads. A model still patched saves the same files:
``patch`` gives it a ``save_pretrained`` (``_SavePretrained``) that writes
``stock_state_dict(model)`` (the state dict ``unpatch`` would give, computed with the model left
patched). Under expert parallelism, where ranks hold slices of the experts, that is refused;
``moe.hf.save_pretrained(model, dir)``, called on every rank, gathers them and writes from rank 0.
The other way, a patched model's ``load_state_dict`` takes the stock module's names and layout as
well as its own (``_load_stock_layout``, a load pre-hook that ``patch`` puts on each patched layer,
converts them, keeping this rank's experts).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from routing_kernels.runtime import all_gather_into, group_rank, group_size

from ..layer import MoELayer
from .logits_tap import hook_if_already_hooked
from .tables import fused_to_ours, ours_to_fused


def unpatch(model: nn.Module) -> nn.Module:
    """The inverse of ``patch``, in place: every patched ``MoELayer`` becomes the stock transformers
    block again, holding the layer's current weights in the stock layout, so that ``state_dict``,
    ``save_pretrained`` and ``from_pretrained`` see transformers' own names and layouts (a model
    patched, trained, unpatched and saved loads into the stock class). The router, the shared
    experts and DeepSeek-V3's score-correction bias go back as they are (the same Parameters and
    buffer); the routed experts are copied into the fused ``gate_up_proj``/``down_proj``. Under
    expert parallelism every rank gathers all experts from its ``ep_group`` (a collective: every
    rank of the group calls ``unpatch``), so each rank ends with the whole stock model; returns
    ``model``."""
    targets = _patched_layers(model)
    if not targets:
        raise ValueError("moe.hf.unpatch: the model holds no layer that moe.hf.patch made (nothing to unpatch)")
    config = model.config  # patch refuses a model without one
    blocks = []
    for name, layer in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        block = _restore_block(layer, config)
        setattr(parent, child, block)
        blocks.append(block)
    hook_if_already_hooked(model, [b.gate for b in blocks])
    if isinstance(vars(model).get("save_pretrained"), _SavePretrained):
        del model.save_pretrained
    return model


def _gather_experts(t: torch.Tensor, layer: MoELayer) -> torch.Tensor:
    """``[X, ...]`` on each rank of the layer's ep group -> ``[E, ...]``, experts in global order."""
    group = layer.ep_group
    R = group_size(group)
    if R == 1:
        return t
    if layer.experts.expert_offset != group_rank(group) * layer.experts.num_local:
        raise AssertionError("expert offsets do not follow the ep group's rank order")
    out = torch.empty((R * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    all_gather_into(out, t.contiguous(), group)
    return out


def _stock_block(layer: MoELayer, config) -> nn.Module:
    """The stock block of a patched layer, holding the layer's router, score-correction bias and
    shared experts (the same Parameters, buffer and modules), with its routed experts still on the
    meta device: ``_restore_block`` fills them, ``stock_state_dict`` names through it."""
    model_type, block_cls = layer._hf_stock_block
    with torch.device("meta"):
        block = block_cls(config)
    block.gate.weight = layer.router.weight
    if model_type == "deepseek_v3":
        block.gate.e_score_correction_bias = layer.router.expert_bias
    shared = {"qwen2_moe": "shared_expert", "deepseek_v3": "shared_experts"}.get(model_type)
    if shared is not None:
        mlp, ffn = getattr(block, shared), layer.shared_experts
        mlp.gate_proj, mlp.up_proj, mlp.down_proj = ffn.w1, ffn.w3, ffn.w2
    if model_type == "qwen2_moe":
        block.shared_expert_gate = layer.shared_expert_gate
    block.train(layer.training)
    return block


@torch.no_grad()
def _restore_block(layer: MoELayer, config) -> nn.Module:
    block = _stock_block(layer, config)
    ex = layer.experts
    gate_up, down = ours_to_fused(*(_gather_experts(w.detach(), layer) for w in (ex.w1, ex.w3, ex.w2)))
    block.experts.gate_up_proj = nn.Parameter(gate_up, requires_grad=ex.w1.requires_grad)
    block.experts.down_proj = nn.Parameter(down, requires_grad=ex.w2.requires_grad)
    for name, t in list(block.named_parameters()) + list(block.named_buffers()):
        if t.is_meta:
            raise AssertionError(f"moe.hf.unpatch left {name} on the meta device")
    return block


def _patched_layers(model: nn.Module) -> list[tuple[str, MoELayer]]:
    return [(name, m) for name, m in model.named_modules() if hasattr(m, "_hf_stock_block")]


# the layer's state-dict entries that the stock block has no place for: the router's expert bias
# of a model without one (zeros, never trained: only DeepSeek-V3 maps it, to e_score_correction_bias)
_NOT_STOCK = ("router.expert_bias",)
_OUR_EXPERTS = ("experts.w1", "experts.w3", "experts.w2")
_STOCK_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def _stock_names(layer: MoELayer, config) -> dict[str, str | None]:
    """The stock block's state-dict keys, in its order, each with the patched layer's key of the same
    tensor (None for the fused routed experts, which have none: ``w1``/``w3``/``w2`` split them)."""
    mine = {id(t): k for k, t in layer.state_dict(keep_vars=True).items()}
    names = {}
    for k, t in _stock_block(layer, config).state_dict(keep_vars=True).items():
        if k in _STOCK_EXPERTS:
            names[k] = None
        elif id(t) in mine:
            names[k] = mine[id(t)]
        else:
            raise AssertionError(f"moe.hf: the stock block's {k} has no counterpart in the patched layer")
    unknown = [k for k in mine.values() if k not in names.values() and k not in _OUR_EXPERTS and k not in _NOT_STOCK]
    if unknown:
        raise AssertionError(f"moe.hf: the patched layer's {unknown} have no stock name")
    return names


def _load_stock_layout(
    layer: MoELayer, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
) -> None:
    """``load_state_dict`` pre-hook of a patched layer: its entries in the stock block's names and
    layout (a stock model's ``state_dict()``, ``stock_state_dict``'s output) become the layer's, in
    place, before the layer reads them: renamed, and the fused experts (all of them) split into
    ``w1``/``w3``/``w2`` and cut to this rank's experts. Entries already in the layer's names load
    as ever; one layer's entries in both layouts are refused. (The files ``save_pretrained`` writes
    hold the Hub's per-expert layout, which ``from_pretrained`` converts, not this one.)"""
    names = layer._hf_stock_names
    stock = [k for k, ours in names.items() if k != ours and prefix + k in state_dict]
    if not stock:
        return
    ours = [
        k
        for k in (*_OUR_EXPERTS, *(v for k, v in names.items() if v is not None and v != k))
        if prefix + k in state_dict
    ]
    if ours:
        raise ValueError(
            f"moe.hf: the state dict holds {prefix}{stock[0]} (transformers' layout) and {prefix}{ours[0]} "
            "(the patched layer's) for one layer: give each layer's entries in one layout"
        )
    present = [k for k in _STOCK_EXPERTS if prefix + k in state_dict]
    if present:
        if len(present) == 1:
            missing = next(k for k in _STOCK_EXPERTS if k not in present)
            raise ValueError(
                f"moe.hf: the state dict holds {prefix}{present[0]} without {prefix}{missing}: the routed "
                "experts load from both"
            )
        ex = layer.experts
        E, D, F = ex.num_global, ex.w1.shape[1], ex.w1.shape[2]
        gate_up, down = (state_dict.pop(prefix + k) for k in _STOCK_EXPERTS)
        for k, t, want in ((_STOCK_EXPERTS[0], gate_up, (E, 2 * F, D)), (_STOCK_EXPERTS[1], down, (E, D, F))):
            if tuple(t.shape) != want:
                raise ValueError(
                    f"moe.hf: {prefix}{k} has shape {tuple(t.shape)}: expected {want} (all {E} experts, "
                    "transformers' fused layout)"
                )
        lo, hi = ex.expert_offset, ex.expert_offset + ex.num_local
        for k, t in zip(_OUR_EXPERTS, fused_to_ours(gate_up[lo:hi], down[lo:hi])):
            state_dict[prefix + k] = t
    for k, our in names.items():
        if our is not None and our != k and prefix + k in state_dict:
            state_dict[prefix + our] = state_dict.pop(prefix + k)
    own = layer.state_dict(keep_vars=True)
    for k in _NOT_STOCK:  # no stock entry to come from: the layer's own value stays
        if k in own and k not in names.values():
            state_dict.setdefault(prefix + k, own[k].detach())


@torch.no_grad()
def stock_state_dict(model: nn.Module, state_dict: dict | None = None) -> dict:
    """A patched model's state dict in transformers' names and layouts, without unpatching it: what
    ``unpatch(model).state_dict()`` would return (the same keys, in the same order, equal tensors),
    while the model stays patched and its optimizer's Parameters stay its own. ``state_dict``: one
    of the patched model's own to convert instead (``model.state_dict()`` by default; a trainer's
    copy, or under ZeRO-3 ``model.state_dict() | engine.full_parameters()``). Entries outside the
    patched layers pass through as they are; the routed experts are fused into
    ``gate_up_proj``/``down_proj`` (new tensors; everything else is the given tensor).

    Under expert parallelism the state dict holds this rank's slice of each layer's experts (or all
    of them): the slices are gathered over the layers' ep group, a collective that every rank of
    the group calls, each with its own state dict of the same form. The state dict is checked
    whole (every key, every expert shape) before the first gather, so a bad one is refused on the
    rank that holds it without leaving the others waiting."""
    layers = _patched_layers(model)
    if not layers:
        raise ValueError(
            "moe.hf.stock_state_dict: the model holds no layer that moe.hf.patch made (its state_dict is already stock)"
        )
    sd = model.state_dict() if state_dict is None else state_dict
    plan = []  # (prefix, layer, its own entries by local name, its w1/w3/w2 as given, whether to gather them)
    for name, layer in layers:
        p = f"{name}." if name else ""
        mine = layer.state_dict(keep_vars=True)  # the layer's own entries, by local name
        missing = [p + k for k in mine if p + k not in sd]
        if missing:
            raise ValueError(
                f"moe.hf.stock_state_dict: the state dict has no {missing[0]!r}: expected one of the patched model's"
            )
        ex = layer.experts
        experts, forms = [], set()
        for w in _OUR_EXPERTS:
            t, local = sd[p + w], tuple(ex.get_parameter(w.removeprefix("experts.")).shape)
            full = (ex.num_global, *local[1:])
            if tuple(t.shape) not in (local, full):
                raise ValueError(
                    f"moe.hf.stock_state_dict: {p}{w} has shape {tuple(t.shape)}: expected {full} "
                    f"(every expert) or {local} (this rank's {ex.num_local} of {ex.num_global})"
                )
            experts.append(t)
            forms.add(t.shape[0] == ex.num_global)
        if len(forms) > 1:
            raise ValueError(
                f"moe.hf.stock_state_dict: {p}experts.w1/w3/w2 mix every expert with this rank's slice: "
                "give one or the other"
            )
        plan.append((p, layer, mine, experts, forms == {False}))
    converted = {}  # a patched layer's first key -> that layer's entries in stock names, in the stock block's order
    replaced = set()  # every key of a patched layer
    for p, layer, mine, experts, gather in plan:
        if gather:
            experts = [_gather_experts(w, layer) for w in experts]
        fused = dict(zip(_STOCK_EXPERTS, ours_to_fused(*experts)))
        entries = {p + k: fused[k] if ours is None else sd[p + ours] for k, ours in layer._hf_stock_names.items()}
        converted[p + next(iter(mine))] = entries
        replaced.update(p + k for k in mine)
    out = {}
    for k, v in sd.items():
        if k in converted:
            out.update(converted[k])
        elif k not in replaced:
            out[k] = v
    return out


def _ep_size(layers) -> int:
    return max(group_size(layer.ep_group) for _, layer in layers)


def save_pretrained(model: nn.Module, save_directory, *args, state_dict: dict | None = None, **kwargs) -> None:
    """Writes a patched model in transformers' names and layouts, as ``unpatch`` then the stock
    ``save_pretrained`` would, with the model left patched: the stock class's ``save_pretrained``
    over ``stock_state_dict(model, state_dict)``; other arguments pass through to it.

    Under expert parallelism, a collective: every rank calls it (each with its own ``state_dict``,
    under ZeRO-3 ``model.state_dict() | engine.full_parameters()``), the experts are gathered over
    each layer's ep group, and global rank 0 writes (transformers' rule for distributed saves).
    Without it, this is the model's own ``save_pretrained``, which ``patch`` installs."""
    layers = _patched_layers(model)
    if not layers:
        raise ValueError(
            "moe.hf.save_pretrained: the model holds no layer that moe.hf.patch made: call its own save_pretrained"
        )
    sd = stock_state_dict(model, state_dict)
    if _ep_size(layers) > 1 and torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return None
    return type(model).save_pretrained(model, save_directory, *args, state_dict=sd, **kwargs)


class _SavePretrained:
    """``save_pretrained`` of a patched model, which ``patch`` sets on the model it patched (an
    instance attribute, as accelerate's hooks replace ``forward``) and ``unpatch`` removes:
    ``moe.hf.save_pretrained``, so the directory holds transformers' names and layouts and the stock
    ``from_pretrained`` loads it. Refused, before anything is written or exchanged, under expert
    parallelism: transformers' Trainer calls ``save_pretrained`` on the writing rank alone, where a
    gather would wait forever for the others. An object holding the model rather than a bound
    method: a deep copy or an unpickled model gets its own (a bound method pickles as a lookup of
    its function's name on the model, which fails when the model is unpickled)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, save_directory, *args, **kwargs):
        model = self.model
        layers = _patched_layers(model)
        if not layers:  # every layer taken out by hand: the stock save
            return type(model).save_pretrained(model, save_directory, *args, **kwargs)
        R = _ep_size(layers)
        if R > 1:
            raise ValueError(
                f"moe.hf: save_pretrained of a model patched with expert parallelism (ep={R}): each rank "
                f"holds 1/{R} of the experts. Call moe.hf.save_pretrained(model, save_directory) on every "
                "rank (it gathers them; rank 0 writes), or moe.hf.unpatch(model) on every rank, then "
                "save_pretrained on one"
            )
        return save_pretrained(model, save_directory, *args, **kwargs)
