"""The DeepSeek-V3 adapter (``DEEPSEEK_V3``, read by ``moe.hf.adapter``): transformers'
``DeepseekV3ForCausalLM`` checkpoints as our ``Transformer`` and back.

Ours against theirs (``moe.hf.common`` holds the shared rows): multi-head latent attention
(``attention="mla"``; ``q_a_proj``/``q_a_layernorm``/``q_b_proj`` or ``q_proj`` without a query
latent, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``), rotary positions
interleaved or not (``rope_interleave``; the same weights, since queries and keys are permuted
alike), usually yarn-scaled with its softmax-scale term (``mscale_all_dim``); the first
``first_k_dense_replace`` blocks dense (``intermediate_size``), the others MoE: sigmoid scores, the
``e_score_correction_bias`` added for selection only (our router's ``expert_bias``, loaded and
exported as it is), group-limited top-k (``n_group``/``topk_group``), renormalised iff
``norm_topk_prob``, times ``routed_scaling_factor``; experts of ``moe_intermediate_size`` and
``n_shared_experts`` shared ones fused into one ungated MLP of ``n_shared_experts *
moe_intermediate_size`` (``mlp.shared_experts``).

Refused: multi-token-prediction modules in the files (``num_nextn_predict_layers``: tensors of layers
past ``num_hidden_layers``, which transformers also skips), an ``rms_norm_eps`` other than 1e-6
(transformers' latent norms are fixed at 1e-6, ours use ``norm_eps`` everywhere), a ``topk_method``
or ``scoring_func`` other than V3's, ``moe_layer_freq`` other than 1, ``attention_bias``, and the rest
of ``moe.hf.common.COMMON_FIXED``.
"""

from __future__ import annotations

import re

from .adapter import Adapter
from .common import (
    ATTN_NORM,
    COMMON_FIXED,
    DENSE_FFN,
    EMBED,
    FFN_NORM,
    HEAD,
    MLA,
    NO_BIAS,
    NORM_TOPK,
    ROPE,
    SIZES,
    L,
    is_moe,
    moe_rows,
    shared_rows,
)
from .tables import Field, Fixed, row

TABLE = (
    *EMBED,
    *ATTN_NORM,
    *MLA,
    *FFN_NORM,
    *DENSE_FFN,
    *moe_rows(),
    row(["blocks.{i}.ffn.router.expert_bias"], [L + "mlp.gate.e_score_correction_bias"], when=is_moe),
    *shared_rows(L + "mlp.shared_experts"),
    *HEAD,
)


def _groups(theirs: str):
    """n_group / topk_group: ours None when the grouping selects nothing (one group, or every group)."""

    def to_ours(value, c):
        get = c.get if isinstance(c, dict) else lambda k: getattr(c, k, None)
        G, TG = get("n_group"), get("topk_group")
        return None if G in (None, 1) or TG == G else value

    return Field(
        f"moe.{'num_groups' if theirs == 'n_group' else 'topk_groups'}", theirs, lambda v, cfg: v or 1, to_ours
    )


def _n_shared(value, cfg) -> int:
    m = cfg.moe
    return (m.shared_d_ff or m.d_ff * m.num_shared_experts) // m.d_ff if m.num_shared_experts else 0


FIELDS = (
    *SIZES,
    Field("d_ff", "intermediate_size"),
    Field("moe.d_ff", "moe_intermediate_size"),
    Field("moe.num_experts", "n_routed_experts"),
    NORM_TOPK,
    Field("moe.route_scale", "routed_scaling_factor", to_theirs=lambda v, cfg: float(v)),
    _groups("n_group"),
    _groups("topk_group"),
    Field("moe.num_shared_experts", "n_shared_experts", to_theirs=_n_shared),
    Field("first_k_dense", "first_k_dense_replace"),
    *(Field(n, n) for n in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")),
    Field("rope_interleave", "rope_interleave"),
    *ROPE,
)
OURS_FIXED = {
    "attention": "mla",
    "moe_every": 1,
    "dense_layers": None,
    "moe.activation": "swiglu",
    "moe.router": "token_choice",
    "moe.score_func": "sigmoid",
    "moe.expert_bias": True,
    "moe.shared_d_ff": None,
    "moe.shared_expert_gate": False,
}

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _check_files(cfg, extra: set[str]) -> None:
    """Tensors of layers past the model's: DeepSeek-V3's multi-token-prediction modules."""
    mtp = sorted(n for n in extra if (m := _LAYER.match(n)) and int(m.group(1)) >= cfg.n_layers)
    if mtp:
        raise ValueError(
            f"DeepSeek-V3 config.num_nextn_predict_layers: the checkpoint holds multi-token-prediction modules "
            f"(e.g. {mtp[:3]}, {len(mtp)} tensors of layers >= num_hidden_layers={cfg.n_layers}), which our model "
            "does not have: remove them from the files (transformers skips them too)"
        )


DEEPSEEK_V3 = Adapter(
    name="DeepSeek-V3",
    model_type="deepseek_v3",
    table=TABLE,
    fields=FIELDS,
    ours_fixed=OURS_FIXED,
    fixed=(
        *COMMON_FIXED,
        NO_BIAS,
        Fixed(
            "rms_norm_eps",
            None,
            lambda value, _: value == 1e-6,
            "transformers' DeepSeek-V3 latent norms (q_a_layernorm, kv_a_layernorm) use eps 1e-6 whatever the config "
            "says, ours norm_eps everywhere: only 1e-6 computes the same",
        ),
        Fixed("num_key_value_heads", lambda cfg: cfg.n_heads, None),
        Fixed("num_nextn_predict_layers", lambda cfg: 0, None),
        Fixed("topk_method", None, lambda v, _: v in (None, "noaux_tc"), "only DeepSeek-V3's noaux_tc router is ours"),
        Fixed("scoring_func", None, lambda v, _: v in (None, "sigmoid"), "DeepSeek-V3's router scores by sigmoid"),
        Fixed("moe_layer_freq", None, lambda v, _: v in (None, 1), "every block past first_k_dense_replace is MoE"),
    ),
    config_class="DeepseekV3Config",
    architectures=("DeepseekV3ForCausalLM",),
    check_files=_check_files,
)
