"""The OLMoE adapter (``OLMOE``, read by ``moe.hf.adapter``): transformers' ``OlmoeForCausalLM``
checkpoints as our ``Transformer`` and back.

Ours against theirs (``moe.hf.common`` holds the shared rows): grouped-query attention whose
queries and keys are RMSNormed over the whole projection before the heads are split
(``self_attn.q_norm`` over ``num_attention_heads * head_dim``, ``k_norm`` over
``num_key_value_heads * head_dim``: our ``qk_norm="proj"``); every block MoE, a softmax router over
all experts, top-k, renormalised iff ``norm_topk_prob``, experts of ``intermediate_size``; no shared
expert, no biases. Refused: ``clip_qkv`` (a clamp of q, k, v ours does not have),
``attention_bias``, and the rest of ``moe.hf.common.COMMON_FIXED``.
"""

from __future__ import annotations

from .adapter import Adapter
from .common import (
    ALL_MOE,
    ATTN_NORM,
    COMMON_FIXED,
    EMBED,
    FFN_NORM,
    HEAD,
    KV_HEADS,
    MHA,
    MHA_ROUTED,
    NO_BIAS,
    NO_SHARED,
    NORM_TOPK,
    ROPE,
    SIZES,
    SOFTMAX_ROUTING,
    moe_rows,
)
from .tables import Field, Fixed

TABLE = (*EMBED, *ATTN_NORM, *MHA, *FFN_NORM, *moe_rows(), *HEAD)
FIELDS = (
    *SIZES,
    KV_HEADS,
    Field("moe.d_ff", "intermediate_size"),
    Field("moe.num_experts", "num_experts"),
    NORM_TOPK,
    *ROPE,
)
OURS_FIXED = {**MHA_ROUTED, **ALL_MOE, "qk_norm": "proj", "qkv_bias": False, **SOFTMAX_ROUTING, **NO_SHARED}
OLMOE = Adapter(
    name="OLMoE",
    model_type="olmoe",
    table=TABLE,
    fields=FIELDS,
    ours_fixed=OURS_FIXED,
    fixed=(
        *COMMON_FIXED,
        NO_BIAS,
        Fixed("clip_qkv", lambda cfg: None, lambda value, _: value is None, "our attention does not clamp q, k, v"),
    ),
    config_class="OlmoeConfig",
    architectures=("OlmoeForCausalLM",),
    zero_in_theirs=("blocks.{i}.ffn.router.expert_bias",),
)
