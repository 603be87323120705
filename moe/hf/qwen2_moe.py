"""The Qwen2-MoE adapter (``QWEN2_MOE``, read by ``moe.hf.adapter``): transformers'
``Qwen2MoeForCausalLM`` checkpoints as our ``Transformer`` and back.

Ours against theirs (``{i}`` the block, ``{e}`` the expert; ``moe.hf.common`` holds the shared rows):
grouped-query attention with a bias on q, k and v (``qkv_bias``; ours one fused ``qkv`` weight and
bias, theirs ``q_proj``/``k_proj``/``v_proj``); MoE blocks where ``(i + 1) % decoder_sparse_step ==
0`` and i is not in ``mlp_only_layers`` (our ``moe_every``, ``dense_layers``), the others a dense
SwiGLU of ``intermediate_size`` (``mlp.gate_proj/up_proj/down_proj``); in an MoE block the router
(``mlp.gate``, softmax over all experts, top-k, renormalised iff ``norm_topk_prob``), the routed
experts of ``moe_intermediate_size`` (fused in memory, ``mlp.experts.{e}.gate_proj/up_proj/
down_proj`` in the file) and one shared expert of ``shared_expert_intermediate_size``
(``mlp.shared_expert.*``) scaled per token by ``sigmoid(x @ mlp.shared_expert_gate)``. Refused:
sliding-window layers (``use_sliding_window``, ``layer_types``), an activation other than silu,
unsupported rotary scaling, quantization, and the rest of ``moe.hf.common.COMMON_FIXED``.
"""

from __future__ import annotations

from .adapter import Adapter
from .common import (
    ATTN_NORM,
    COMMON_FIXED,
    DENSE_FFN,
    EMBED,
    FFN_NORM,
    HEAD,
    KV_HEADS,
    MHA,
    MHA_ROUTED,
    MLP_ONLY,
    NORM_TOPK,
    ROPE,
    SIZES,
    SLIDING_QWEN,
    SOFTMAX_ROUTING,
    L,
    is_moe,
    moe_rows,
    shared_rows,
)
from .tables import Field, row

TABLE = (
    *EMBED,
    *ATTN_NORM,
    *MHA,
    *FFN_NORM,
    *DENSE_FFN,
    *moe_rows(),
    *shared_rows(L + "mlp.shared_expert"),
    row(["blocks.{i}.ffn.shared_expert_gate.weight"], [L + "mlp.shared_expert_gate.weight"], when=is_moe),
    *HEAD,
)
FIELDS = (
    *SIZES,
    KV_HEADS,
    Field("qkv_bias", "qkv_bias"),
    Field("d_ff", "intermediate_size"),
    Field("moe.d_ff", "moe_intermediate_size"),
    Field("moe.num_experts", "num_experts"),
    NORM_TOPK,
    Field(
        "moe.shared_d_ff",
        "shared_expert_intermediate_size",
        to_theirs=lambda v, cfg: v or cfg.moe.d_ff * cfg.moe.num_shared_experts,
    ),
    Field("moe_every", "decoder_sparse_step"),
    MLP_ONLY,
    *ROPE,
)
OURS_FIXED = {
    **MHA_ROUTED,
    "qk_norm": "none",
    **SOFTMAX_ROUTING,
    "moe.num_shared_experts": 1,
    "moe.shared_expert_gate": True,
}
QWEN2_MOE = Adapter(
    name="Qwen2-MoE",
    model_type="qwen2_moe",
    table=TABLE,
    fields=FIELDS,
    ours_fixed=OURS_FIXED,
    fixed=(*COMMON_FIXED, *SLIDING_QWEN),
    config_class="Qwen2MoeConfig",
    architectures=("Qwen2MoeForCausalLM",),
    zero_in_theirs=("blocks.{i}.ffn.router.expert_bias",),
)
