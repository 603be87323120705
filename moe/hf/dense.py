"""Dense checkpoints that an MoE run starts from (sparse upcycling, ``moe.hf.upcycle``): the Llama
(``LLAMA``) and Qwen3 (``QWEN3``) adapters, read by ``moe.hf.adapter`` like the MoE families.

Ours against theirs (``moe.hf.common`` holds the rows): every block dense (``moe_every=0``), a
SwiGLU of ``intermediate_size`` (``mlp.gate_proj/up_proj/down_proj``); Llama's grouped-query
attention without biases, Qwen3's with its own ``head_dim`` and per-head q/k RMSNorm
(``qk_norm="head"``). Refused: ``attention_bias`` (Llama's biases q, k, v and the output
projection; ours has no output bias), ``mlp_bias``, sliding-window layers (Qwen3), and the rest of
``moe.hf.common.COMMON_FIXED``. Each has an MoE counterpart that an upcycled model exports as
(``MOE_OF``): Llama -> Mixtral, Qwen3 -> Qwen3-MoE.
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
    HEAD_DIM,
    KV_HEADS,
    MHA,
    MHA_ROUTED,
    NO_BIAS,
    NO_MLP_BIAS,
    ROPE,
    SIZES,
    SLIDING_QWEN,
)
from .tables import Field

TABLE = (*EMBED, *ATTN_NORM, *MHA, *FFN_NORM, *DENSE_FFN, *HEAD)
_DENSE_FIELDS = (
    *(f for f in SIZES if not f.ours.startswith("moe.")),
    KV_HEADS,
    HEAD_DIM,
    Field("d_ff", "intermediate_size"),
)
_DENSE = {**MHA_ROUTED, "moe_every": 0, "dense_layers": None, "qkv_bias": False}

LLAMA = Adapter(
    name="Llama",
    model_type="llama",
    table=TABLE,
    fields=(*_DENSE_FIELDS, *ROPE),
    ours_fixed={**_DENSE, "qk_norm": "none"},
    fixed=(*COMMON_FIXED, NO_BIAS, NO_MLP_BIAS),
    config_class="LlamaConfig",
    architectures=("LlamaForCausalLM",),
)
QWEN3 = Adapter(
    name="Qwen3",
    model_type="qwen3",
    table=TABLE,
    fields=(*_DENSE_FIELDS, *ROPE),
    ours_fixed={**_DENSE, "qk_norm": "head"},
    fixed=(*COMMON_FIXED, NO_BIAS, *SLIDING_QWEN),
    config_class="Qwen3Config",
    architectures=("Qwen3ForCausalLM",),
)
# the MoE family an upcycled model of each dense one is
MOE_OF = {"llama": "mixtral", "qwen3": "qwen3_moe"}
