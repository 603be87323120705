"""Hugging Face interop: ``patch(model)`` swaps a transformers model's sparse-MoE blocks for ``MoELayer``.

Needs the optional extra (``pip install -e .[hf]``); ``import moe`` never imports this module.

Supported blocks (transformers 5.x layouts), with the routing each maps to:

| model_type | block | routing | shared expert |
|---|---|---|---|
| ``mixtral`` | ``MixtralSparseMoeBlock`` | softmax over E, top-k, renormalised | none |
| ``qwen2_moe`` | ``Qwen2MoeSparseMoeBlock`` | softmax over E, top-k, renormalised iff ``norm_topk_prob`` | one, gated by ``sigmoid(x @ shared_expert_gate)`` |
| ``qwen3_moe`` | ``Qwen3MoeSparseMoeBlock`` | softmax over E, top-k, renormalised iff ``norm_topk_prob`` | none |
| ``olmoe`` | ``OlmoeSparseMoeBlock`` | softmax over E, top-k, renormalised iff ``norm_topk_prob`` | none |
| ``deepseek_v3`` | ``DeepseekV3MoE`` | sigmoid scores, ``e_score_correction_bias`` added for selection only (the expert bias), group-limited top-k (``n_group``/``topk_group``), renormalised iff ``norm_topk_prob``, times ``routed_scaling_factor`` | ``n_shared_experts`` fused into one ungated MLP |

``unpatch(model)`` is the inverse: the stock blocks back, holding the layers' current weights in
transformers' names and layout (experts gathered over the ep group), so ``save_pretrained`` writes
what the stock class loads. A model still patched saves the same files: ``patch`` gives it a
``save_pretrained`` that writes ``stock_state_dict(model)`` (the state dict ``unpatch`` would give,
computed with the model left patched). Under expert parallelism, where ranks hold slices of the
experts, that is refused; ``moe.hf.save_pretrained(model, dir)``, called on every rank, gathers
them and writes from rank 0. The other way, a patched model's ``load_state_dict`` takes the stock
module's names and layout as well as its own (a load pre-hook on each patched layer converts them,
keeping this rank's experts).

Whole models move as Mixtral checkpoints: ``export_mixtral``/``import_mixtral`` (``moe.hf_mixtral``,
which holds the one mapping table between our names and layouts and Mixtral's).

Weights: the router and the shared experts are the stock Parameters; the routed experts are copied
once, at patch time, into contiguous tensors in ``MoELayer``'s layout (under expert parallelism each
rank copies only its own experts), and the stock fused tensors are dropped with the block.

- ``router.weight`` IS the stock ``gate.weight`` Parameter (same ``[E, D]`` layout).
- ``experts.w1``/``w3`` ``[X, D, F]`` hold the two halves of the stock fused
  ``experts.gate_up_proj [E, 2F, D]`` (``[:, :F]`` gate, ``[:, F:]`` up, transposed);
  ``experts.w2 [X, F, D]`` holds ``experts.down_proj [E, D, F]`` transposed
  (``moe.hf_mixtral.fused_to_ours``, the experts' row of the mapping table). They are new
  contiguous leaf Parameters: gradients land in ``w1.grad``/``w3.grad``/``w2.grad``, in the patched
  layout. (Views of the stock storage, as the first version held, cost 3-4% of a training step:
  the optimizer's elementwise passes over transposed, half-strided tensors, and the experts' matmuls
  on them; docs/design.md.)
- The shared expert's ``gate_proj``/``up_proj``/``down_proj`` Linear modules become the
  ``DenseFFN``'s ``w1``/``w3``/``w2`` as they are, and ``shared_expert_gate`` becomes the layer's
  ``shared_expert_gate`` (same Parameters).
- DeepSeek-V3's ``e_score_correction_bias`` buffer becomes the router's ``expert_bias`` buffer
  (the same tensor).

The layer's own auxiliary losses are switched off (``aux_loss_coef = z_loss_coef = 0``): the
transformers model computes its balancing loss from the router logits, which the patched layer
still hands to the model's output recorder (``output_router_logits=True`` keeps returning them and
the model's ``aux_loss`` keeps its value and gradient). Router logits are recorded in fp32 (the stock
routers return them in the input's dtype; the same values in fp32).

Known differences, below fp32 rounding: DeepSeek-V3's renormalisation adds 1e-20 to the
denominator (a sum of k sigmoids, never that small) and picks its top-k unsorted (the same set;
only the order in which the k outputs are summed differs).

Refused with a ValueError naming the field: an unknown ``model_type``, an activation other than
silu (``hidden_act``), router jitter (``router_jitter_noise`` > 0), a model whose config names a
supported type but holds no MoE block of the expected class; and a transformers release other than 5.x,
whose fused expert tensors could hold the same shapes in another order.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from routing_kernels.runtime import all_gather_into, group_rank, group_size, mark_expert_params

from ..config import MoEConfig
from ..experts import DenseFFN
from ..layer import MoELayer
from .mixtral import export_mixtral, fused_to_ours, import_mixtral, ours_to_fused  # noqa: F401 (moe.hf.export_mixtral, moe.hf.import_mixtral)

# model_type -> (block class name, router class name)
_BLOCKS = {
    "mixtral": ("MixtralSparseMoeBlock", "MixtralTopKRouter"),
    "qwen2_moe": ("Qwen2MoeSparseMoeBlock", "Qwen2MoeTopKRouter"),
    "qwen3_moe": ("Qwen3MoeSparseMoeBlock", "Qwen3MoeTopKRouter"),
    "olmoe": ("OlmoeSparseMoeBlock", "OlmoeTopKRouter"),
    "deepseek_v3": ("DeepseekV3MoE", "DeepseekV3TopkRouter"),
}
SUPPORTED_MODEL_TYPES = tuple(_BLOCKS)
_SILU = ("silu", "swish")


class _RouterLogitsTap(nn.Module):
    """Identity on the router logits, returned as ``(logits, None, None)`` like the stock router's
    ``(logits, weights, indices)``.

    ``patch`` gives each layer an instance of a subclass that also derives from the stock router
    class, so transformers' output recorder (which hooks modules by ``isinstance`` of the router
    class) records the patched layer's logits where it recorded the stock router's."""

    def __init__(self):
        nn.Module.__init__(self)

    def forward(self, logits_TE):
        return (logits_TE, None, None)

    def __reduce__(self):
        # the class is made at run time (``_tap_class``), so pickle cannot find it by name: a pickled
        # (or deep-copied) tap is rebuilt from the stock router class, which it can
        router_cls = next(c for c in type(self).__bases__ if c is not _RouterLogitsTap)
        return _new_tap, (router_cls,), self.__dict__


_TAP_CLASSES: dict[type, type] = {}


def _tap_class(router_cls: type) -> type:
    if router_cls not in _TAP_CLASSES:
        _TAP_CLASSES[router_cls] = type(
            f"{router_cls.__name__}LogitsTap",
            (_RouterLogitsTap, router_cls),
            {"__init__": _RouterLogitsTap.__init__, "forward": _RouterLogitsTap.forward},
        )
    return _TAP_CLASSES[router_cls]


def _new_tap(router_cls: type) -> _RouterLogitsTap:
    return _tap_class(router_cls).__new__(_tap_class(router_cls))


def _require(cond: bool, field: str, value, why: str) -> None:
    if not cond:
        raise ValueError(f"moe.hf.patch: config.{field}={value!r} is not supported: {why}")


# the transformers releases whose fused expert layouts ``patch`` maps: a major release may reorder
# gate_up_proj's halves or transpose a tensor of the same shape, which no shape check could see
_TRANSFORMERS_MAJOR = 5


def _check_transformers(version: str) -> None:
    if int(version.split(".")[0]) != _TRANSFORMERS_MAJOR:
        raise ValueError(
            f"moe.hf.patch: transformers {version} is not supported: moe.hf maps the fused expert "
            f"layouts of transformers {_TRANSFORMERS_MAJOR}.x (5.17 and 5.24 tested); install "
            f"'transformers>=5.17,<6' (pip install -e .[hf])"
        )


def _model_config(model):
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise ValueError("moe.hf.patch: the model has no .config (expected a transformers PreTrainedModel)")
    return cfg


def _moe_config(model_type: str, block) -> MoEConfig:
    gate, experts = block.gate, block.experts
    if not isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
        raise ValueError(
            f"moe.hf.patch: {type(block).__name__}.experts has no fused gate_up_proj tensor "
            "(transformers < 5 stores experts as modules; install transformers>=5)"
        )
    E, D = gate.weight.shape
    F = experts.down_proj.shape[2]
    kw = dict(
        d_model=D,
        d_ff=F,
        num_experts=E,
        top_k=int(gate.top_k),
        activation="swiglu",
        capacity_factor=None,
        aux_loss_coef=0.0,
        z_loss_coef=0.0,
        seq_aux_loss_coef=0.0,
    )
    if model_type == "mixtral":
        kw.update(normalize_topk=True)
    elif model_type in ("qwen2_moe", "qwen3_moe", "olmoe"):
        kw.update(normalize_topk=bool(gate.norm_topk_prob))
    elif model_type == "deepseek_v3":
        kw.update(
            score_func="sigmoid",
            normalize_topk=bool(gate.norm_topk_prob),
            route_scale=float(gate.routed_scaling_factor),
            expert_bias=True,
        )
        G, TG = int(gate.num_group), int(gate.topk_group)
        _require(
            E % G == 0 and E // G >= 2, "n_group", G, f"needs groups of >= 2 experts dividing n_routed_experts={E}"
        )
        if G > 1 or TG < G:
            kw.update(num_groups=G, topk_groups=TG)
    if model_type == "qwen2_moe":
        kw.update(num_shared_experts=1, shared_d_ff=block.shared_expert.down_proj.in_features, shared_expert_gate=True)
    elif model_type == "deepseek_v3":
        kw.update(num_shared_experts=1, shared_d_ff=block.shared_experts.down_proj.in_features)
    return MoEConfig(**kw)


def _check_config(model_type: str, hf_cfg) -> None:
    act = getattr(hf_cfg, "hidden_act", None)
    _require(act in _SILU, "hidden_act", act, "MoELayer's experts are SwiGLU (silu gate)")
    jitter = getattr(hf_cfg, "router_jitter_noise", 0.0) or 0.0
    _require(jitter == 0, "router_jitter_noise", jitter, "MoELayer's router has no input jitter")
    if model_type == "deepseek_v3":
        topk_method = getattr(hf_cfg, "topk_method", "noaux_tc")
        _require(
            topk_method in (None, "noaux_tc"),
            "topk_method",
            topk_method,
            "only DeepSeek-V3's noaux_tc router is implemented",
        )


def _copy_param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().contiguous().clone(), requires_grad=t.requires_grad)


def _take_mlp(ffn: DenseFFN, mlp) -> None:
    # the stock SwiGLU MLP's Linear modules, as they are: gate_proj -> w1, up_proj -> w3, down_proj -> w2
    ffn.w1, ffn.w3, ffn.w2 = mlp.gate_proj, mlp.up_proj, mlp.down_proj


def _convert_block(model_type: str, block, tap_cls, ep_group, dp_group) -> MoELayer:
    cfg = _moe_config(model_type, block)
    device = block.gate.weight.device
    with torch.device("meta"):
        layer = MoELayer(cfg, ep_group=ep_group, dp_group=dp_group)
    ex = layer.experts
    lo, hi = ex.expert_offset, ex.expert_offset + ex.num_local
    gate_up = block.experts.gate_up_proj[lo:hi]  # [X, 2F, D]
    down = block.experts.down_proj[lo:hi]  # [X, D, F]
    layer.router.weight = block.gate.weight
    # contiguous copies in our layout (this rank's experts only): the stock tensors go with the block
    ex.w1, ex.w3, ex.w2 = (_copy_param(w) for w in fused_to_ours(gate_up, down))
    mark_expert_params(ex.parameters(), ex.expert_offset, ex.num_global)
    if cfg.expert_bias:
        layer.router.expert_bias = block.gate.e_score_correction_bias
    else:
        layer.router.expert_bias = torch.zeros(cfg.num_experts, device=device)
    layer.load_since_update = torch.zeros(cfg.num_experts, device=device)
    if model_type == "qwen2_moe":
        _take_mlp(layer.shared_experts, block.shared_expert)
        layer.shared_expert_gate = block.shared_expert_gate
    elif model_type == "deepseek_v3":
        _take_mlp(layer.shared_experts, block.shared_experts)
    layer.router_logits_tap = tap_cls()
    layer.train(block.training)
    for name, t in list(layer.named_parameters()) + list(layer.named_buffers()):
        if t.is_meta:
            raise AssertionError(f"moe.hf.patch left {name} on the meta device")
    return layer


def patch(model: nn.Module, ep_group=None, dp_group=None) -> nn.Module:
    """Replace, in place, every sparse-MoE block of a transformers model by an ``MoELayer`` holding the
    same weights (the experts copied into our layout, see the module docstring) and the equivalent
    routing; returns ``model``.

    ``ep_group``: the expert-parallel group; each of its R ranks keeps experts
    ``[rank * E/R, (rank + 1) * E/R)`` and tokens cross it by All-to-All, so every
    rank must call ``patch`` on the same model with the same group. ``dp_group``: the data-parallel
    group over which the layer reduces its routing statistics. None means one process for either."""
    import transformers

    _check_transformers(transformers.__version__)
    hf_cfg = _model_config(model)
    model_type = getattr(hf_cfg, "model_type", None)
    _require(model_type in _BLOCKS, "model_type", model_type, f"supported model types are {SUPPORTED_MODEL_TYPES}")
    _check_config(model_type, hf_cfg)
    block_name, router_name = _BLOCKS[model_type]
    targets = [name for name, m in model.named_modules() if type(m).__name__ == block_name]
    if not targets:
        raise ValueError(
            f"moe.hf.patch: config.model_type={model_type!r} but the model holds no {block_name} (already patched?)"
        )
    router_cls = type(model.get_submodule(targets[0]).gate)
    _require(
        router_cls.__name__ == router_name,
        "model_type",
        model_type,
        f"expected the router class {router_name}, found {router_cls.__name__}",
    )
    tap_cls = _tap_class(router_cls)
    layers = []
    for name in targets:  # one block at a time, so a block's stock experts are freed before the next is copied
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        block = getattr(parent, child)
        layer = _convert_block(model_type, block, tap_cls, ep_group, dp_group)
        layer._hf_stock_block = (model_type, type(block))  # what ``unpatch`` puts back (not state)
        layer._hf_stock_names = _stock_names(layer, hf_cfg)
        layer._register_load_state_dict_pre_hook(_load_stock_layout, with_module=True)
        setattr(parent, child, layer)
        layers.append(layer)
    _hook_if_already_hooked(model, [layer.router_logits_tap for layer in layers])
    model.save_pretrained = _SavePretrained(model)  # writes the stock layout
    return model


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
    config = _model_config(model)
    blocks = []
    for name, layer in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        block = _restore_block(layer, config)
        setattr(parent, child, block)
        blocks.append(block)
    _hook_if_already_hooked(model, [b.gate for b in blocks])
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
                f"moe.hf.stock_state_dict: {p}experts.w1/w3/w2 mix every expert with this rank's slice: give one or the other"
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


def _hook_if_already_hooked(model: nn.Module, recorders: list[nn.Module]) -> None:
    # transformers installs its output-recording hooks lazily, once per (sub)model, on the first
    # forward that records something; where that already happened, the modules that carried the
    # hooks are gone (patch: the stock routers; unpatch: the taps), so the new ``recorders`` (taps
    # or stock routers, both returning ``(logits, ...)``) are hooked here
    hooked = [m for m in model.modules() if getattr(m, "_output_capturing_hooks_installed", False)]
    if not hooked:
        return
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, OutputRecorder, install_output_capuring_hook

    done = set()
    for sub in hooked:
        # keyed by str(class) in every 5.x (5.24 wraps the dict in a class whose .get takes the model;
        # plain dict.get with the key works on both)
        specs = (dict.get(_CAN_RECORD_REGISTRY, str(sub.__class__)) or {}).get("router_logits")
        if specs is None:
            continue
        inside = {id(m) for m in sub.modules()}
        for spec in specs if isinstance(specs, list) else [specs]:
            index = spec.index if isinstance(spec, OutputRecorder) else 1
            for rec in recorders:
                if id(rec) in inside and id(rec) not in done:
                    install_output_capuring_hook(rec, "router_logits", index)
                    done.add(id(rec))
