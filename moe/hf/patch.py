"""``patch(model)`` swaps a transformers model's sparse-MoE blocks for ``MoELayer``, in place.

Needs the optional extra (``pip install -e .[hf]``); ``import moe`` never imports this package, and
this module imports transformers only when a model is patched.

Supported blocks (transformers 5.x layouts), with the routing each maps to (``_BLOCKS``):

- ``mixtral``, ``MixtralSparseMoeBlock``: softmax over E, top-k, renormalised; no shared expert.
- ``qwen2_moe``, ``Qwen2MoeSparseMoeBlock``: softmax over E, top-k, renormalised iff
  ``norm_topk_prob``; one shared expert, gated by ``sigmoid(x @ shared_expert_gate)``.
- ``qwen3_moe``, ``Qwen3MoeSparseMoeBlock``: softmax over E, top-k, renormalised iff
  ``norm_topk_prob``; no shared expert.
- ``olmoe``, ``OlmoeSparseMoeBlock``: softmax over E, top-k, renormalised iff ``norm_topk_prob``;
  no shared expert.
- ``deepseek_v3``, ``DeepseekV3MoE``: sigmoid scores, ``e_score_correction_bias`` added for
  selection only (the expert bias), group-limited top-k (``n_group``/``topk_group``), renormalised
  iff ``norm_topk_prob``, times ``routed_scaling_factor``; ``n_shared_experts`` fused into one
  ungated MLP.

The way back (``unpatch``, ``stock_state_dict``, ``save_pretrained``, loading the stock layout into
a patched model) is ``moe.hf.stock``. Whole models move as Mixtral checkpoints:
``export_mixtral``/``import_mixtral`` (``moe.hf.mixtral``, which holds the one mapping table between
our names and layouts and Mixtral's).

Weights: the router and the shared experts are the stock Parameters; the routed experts are copied
once, at patch time, into contiguous tensors in ``MoELayer``'s layout (under expert parallelism each
rank copies only its own experts), and the stock fused tensors are dropped with the block.

- ``router.weight`` IS the stock ``gate.weight`` Parameter (same ``[E, D]`` layout).
- ``experts.w1``/``w3`` ``[X, D, F]`` hold the two halves of the stock fused
  ``experts.gate_up_proj [E, 2F, D]`` (``[:, :F]`` gate, ``[:, F:]`` up, transposed);
  ``experts.w2 [X, F, D]`` holds ``experts.down_proj [E, D, F]`` transposed
  (``moe.hf.tables.fused_to_ours``, the experts' row of the Mixtral table). They are new
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
still hands to the model's output recorder (``moe.hf.logits_tap``; ``output_router_logits=True``
keeps returning them and the model's ``aux_loss`` keeps its value and gradient). Router logits are
recorded in fp32 (the stock routers return them in the input's dtype; the same values in fp32).

Known differences, below fp32 rounding: DeepSeek-V3's renormalisation adds 1e-20 to the
denominator (a sum of k sigmoids, never that small) and picks its top-k unsorted (the same set;
only the order in which the k outputs are summed differs).

Refused with a ValueError naming the field: an unknown ``model_type``, an activation other than
silu (``hidden_act``), router jitter (``router_jitter_noise`` > 0), a model whose config names a
supported type but holds no MoE block of the expected class; and a transformers release other than
5.x, whose fused expert tensors could hold the same shapes in another order.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from routing_kernels.runtime import mark_expert_params

from ..config import MoEConfig
from ..experts import DenseFFN
from ..layer import MoELayer
from .logits_tap import hook_if_already_hooked, tap_class
from .stock import _load_stock_layout, _SavePretrained, _stock_names
from .tables import fused_to_ours

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


def _convert_block(model_type: str, block, tap_cls, ep_group, dp_group, ep_node_groups=None) -> MoELayer:
    cfg = _moe_config(model_type, block)
    device = block.gate.weight.device
    with torch.device("meta"):
        layer = MoELayer(cfg, ep_group=ep_group, dp_group=dp_group, ep_node_groups=ep_node_groups)
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


def patch(model: nn.Module, ep_group=None, dp_group=None, ep_node_groups=None) -> nn.Module:
    """Replace, in place, every sparse-MoE block of a transformers model by an ``MoELayer`` holding the
    same weights (the experts copied into our layout, see the module docstring) and the equivalent
    routing; returns ``model``.

    ``ep_group``: the expert-parallel group; each of its R ranks keeps experts
    ``[rank * E/R, (rank + 1) * E/R)`` and tokens cross it by All-to-All, so every
    rank must call ``patch`` on the same model with the same group. ``dp_group``: the data-parallel
    group over which the layer reduces its routing statistics. None means one process for either.
    ``ep_node_groups``: ``(intra, inter)``, the ep group's node sub-groups (a ``zero.Layout`` built
    with ``ep_dispatch="node"``: ``layout.ep_node_groups``): each token
    then crosses to a node once (``moe.dispatch.NodeDispatcher``)."""
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
    tap_cls = tap_class(router_cls)
    layers = []
    for name in targets:  # one block at a time, so a block's stock experts are freed before the next is copied
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        block = getattr(parent, child)
        layer = _convert_block(model_type, block, tap_cls, ep_group, dp_group, ep_node_groups)
        layer._hf_stock_block = (model_type, type(block))  # what ``unpatch`` puts back (not state)
        layer._hf_stock_names = _stock_names(layer, hf_cfg)
        layer._register_load_state_dict_pre_hook(_load_stock_layout, with_module=True)
        setattr(parent, child, layer)
        layers.append(layer)
    hook_if_already_hooked(model, [layer.router_logits_tap for layer in layers])
    model.save_pretrained = _SavePretrained(model)  # writes the stock layout
    return model
