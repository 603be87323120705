"""The Qwen3-MoE adapter (``QWEN3_MOE``, read by ``moe.hf.adapter``): transformers'
``Qwen3MoeForCausalLM`` checkpoints as our ``Transformer`` and back.

Ours against theirs (``moe.hf.common`` holds the shared rows): grouped-query attention with a
``head_dim`` of its own (``q_proj`` is ``num_attention_heads * head_dim`` wide, not
``hidden_size``) and an RMSNorm of each query and key head over ``head_dim`` before the rotation
(``self_attn.q_norm``/``k_norm``: our ``qk_norm="head"``); no biases; MoE blocks by
``decoder_sparse_step`` and ``mlp_only_layers`` as Qwen2-MoE (dense ones of ``intermediate_size``),
each a softmax router over all experts, top-k, renormalised iff ``norm_topk_prob``, and fine-grained
experts of ``moe_intermediate_size``; no shared expert. Refused: ``attention_bias``, sliding-window
layers, and the rest of ``moe.hf.common.COMMON_FIXED``.
"""

from __future__ import annotations

from .adapter import Adapter
from .common import (
    ALL_MOE,
    ATTN_NORM,
    COMMON_FIXED,
    DENSE_FFN,
    EMBED,
    FFN_NORM,
    HEAD,
    HEAD_DIM,
    KV_HEADS,
    MHA,
    MHA_ROUTED,
    MLP_ONLY,
    NO_BIAS,
    NO_SHARED,
    NORM_TOPK,
    ROPE,
    SIZES,
    SLIDING_QWEN,
    SOFTMAX_ROUTING,
    moe_rows,
)
from .tables import Field

TABLE = (*EMBED, *ATTN_NORM, *MHA, *FFN_NORM, *DENSE_FFN, *moe_rows(), *HEAD)
FIELDS = (
    *SIZES,
    KV_HEADS,
    HEAD_DIM,
    Field("d_ff", "intermediate_size"),
    Field("moe.d_ff", "moe_intermediate_size"),
    Field("moe.num_experts", "num_experts"),
    NORM_TOPK,
    Field("moe_every", "decoder_sparse_step"),
    MLP_ONLY,
    *ROPE,
)
OURS_FIXED = {
    **MHA_ROUTED,
    "dense_layers": ALL_MOE["dense_layers"],
    "qk_norm": "head",
    "qkv_bias": False,
    **SOFTMAX_ROUTING,
    **NO_SHARED,
}
QWEN3_MOE = Adapter(
    name="Qwen3-MoE",
    model_type="qwen3_moe",
    table=TABLE,
    fields=FIELDS,
    ours_fixed=OURS_FIXED,
    fixed=(*COMMON_FIXED, NO_BIAS, *SLIDING_QWEN),
    config_class="Qwen3MoeConfig",
    architectures=("Qwen3MoeForCausalLM",),
    zero_in_theirs=("blocks.{i}.ffn.router.expert_bias",),
)
