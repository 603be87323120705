"""The pieces of the family tables that several families share: rows (the embedding and head, the
norms, multi-head and latent attention, a dense block's SwiGLU, the router and experts, shared
experts), config fields (sizes, rotary positions) and the refusals every family makes.

Names: ``{i}`` the block, ``{e}`` the expert; ours on the left of each row, transformers 5's module
names on the right (the file's where they differ). Shapes follow the project's legend
(docs/design.md): H heads, Z key/value heads, J head dim.
"""

from __future__ import annotations

import torch

from ..model_config import _ROPE_PARAMS
from ..rope import ROPE_SCALINGS
from .tables import OMIT, Field, Fixed, fused_to_ours, ours_to_fused, row

L = "model.layers.{i}."
A = L + "self_attn."


def is_moe(cfg, i) -> bool:
    return cfg.is_moe_block(i)


def is_dense(cfg, i) -> bool:
    return not cfg.is_moe_block(i)


def _split_qkv(cfg, qkv):
    H, Z, J = cfg.n_heads, cfg.kv_heads, cfg.attn_head_dim
    return tuple(qkv.split([H * J, Z * J, Z * J], dim=0))  # our rows are q, k, v, each head-major


def _cat_qkv(cfg, q, k, v):
    return (torch.cat([q, k, v], dim=0),)


def _fused_experts(cfg, *ts):
    return ours_to_fused(*ts)


def _our_experts(cfg, *ts):
    return fused_to_ours(*ts)


EMBED = (row(["embed.weight"], ["model.embed_tokens.weight"]),)
HEAD = (row(["norm.weight"], ["model.norm.weight"]), row(["lm_head.weight"], ["lm_head.weight"]))
ATTN_NORM = (row(["blocks.{i}.attn_norm.weight"], [L + "input_layernorm.weight"]),)
FFN_NORM = (row(["blocks.{i}.ffn_norm.weight"], [L + "post_attention_layernorm.weight"]),)

# multi-head / grouped-query attention: our fused qkv [(H + 2Z) J, D] is q, k, v stacked
MHA = (
    row(
        ["blocks.{i}.attn.qkv.weight"], [A + f"{p}_proj.weight" for p in "qkv"], to_module=_split_qkv, to_ours=_cat_qkv
    ),
    row(
        ["blocks.{i}.attn.qkv.bias"],
        [A + f"{p}_proj.bias" for p in "qkv"],
        to_module=_split_qkv,
        to_ours=_cat_qkv,
        when=lambda cfg, i: cfg.qkv_bias,
    ),
    row(["blocks.{i}.attn.proj.weight"], [A + "o_proj.weight"]),
    *(
        row([f"blocks.{{i}}.attn.{n}.weight"], [A + f"{n}.weight"], when=lambda cfg, i: cfg.qk_norm != "none")
        for n in ("q_norm", "k_norm")
    ),
)


def _q_lora(cfg, i) -> bool:
    return cfg.q_lora_rank is not None


# DeepSeek's multi-head latent attention (moe.attention.LatentAttention names its parts after theirs)
MLA = (
    row(["blocks.{i}.attn.q_proj.weight"], [A + "q_proj.weight"], when=lambda cfg, i: not _q_lora(cfg, i)),
    row(["blocks.{i}.attn.q_a_proj.weight"], [A + "q_a_proj.weight"], when=_q_lora),
    row(["blocks.{i}.attn.q_a_norm.weight"], [A + "q_a_layernorm.weight"], when=_q_lora),
    row(["blocks.{i}.attn.q_b_proj.weight"], [A + "q_b_proj.weight"], when=_q_lora),
    row(["blocks.{i}.attn.kv_a_proj.weight"], [A + "kv_a_proj_with_mqa.weight"]),
    row(["blocks.{i}.attn.kv_a_norm.weight"], [A + "kv_a_layernorm.weight"]),
    row(["blocks.{i}.attn.kv_b_proj.weight"], [A + "kv_b_proj.weight"]),
    row(["blocks.{i}.attn.proj.weight"], [A + "o_proj.weight"]),
)

_SWIGLU = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))


def swiglu(ours: str, theirs: str, when) -> tuple:
    """A SwiGLU MLP of nn.Linear: ours ``{ours}.w1/w3/w2.weight``, theirs ``{theirs}.gate/up/down_proj.weight``."""
    return tuple(row([f"{ours}.{w}.weight"], [f"{theirs}.{t}.weight"], when=when) for w, t in _SWIGLU)


DENSE_FFN = swiglu("blocks.{i}.ffn", L + "mlp", is_dense)


def moe_rows(prefix_file: str = L + "mlp.", expert_names=("gate_proj", "up_proj", "down_proj")) -> tuple:
    """The router and the routed experts of an MoE block: in memory (transformers 5) always
    ``mlp.gate.weight`` and the fused ``mlp.experts.gate_up_proj``/``down_proj``; in the file under
    ``prefix_file``, one ``experts.{e}.<name>.weight`` per expert."""
    return (
        row(["blocks.{i}.ffn.router.weight"], [L + "mlp.gate.weight"], [prefix_file + "gate.weight"], when=is_moe),
        row(
            [f"blocks.{{i}}.ffn.experts.{w}" for w in ("w1", "w3", "w2")],
            [L + "mlp.experts.gate_up_proj", L + "mlp.experts.down_proj"],
            [prefix_file + f"experts.{{e}}.{n}.weight" for n in expert_names],
            to_module=_fused_experts,
            to_ours=_our_experts,
            experts=True,
            when=is_moe,
        ),
    )


def shared_rows(theirs: str) -> tuple:
    return swiglu("blocks.{i}.ffn.shared_experts", theirs, lambda cfg, i: is_moe(cfg, i) and cfg.moe.num_shared_experts)


# ---------------------------------------------------------------------------------------------
# config fields


def _none_if(default_of):
    """to_ours: None (our default) where their value is the default ``default_of(their_cfg)``."""

    def to_ours(value, c):
        return None if value is None or value == default_of(c) else value

    return to_ours


def _get(c, name):
    return c.get(name) if isinstance(c, dict) else getattr(c, name, None)


SIZES = (
    Field("vocab_size", "vocab_size"),
    Field("d_model", "hidden_size"),
    Field("n_layers", "num_hidden_layers"),
    Field("n_heads", "num_attention_heads"),
    Field("tie_embeddings", "tie_word_embeddings"),
    Field("norm_eps", "rms_norm_eps"),
    Field("max_seq_len", "max_position_embeddings"),
    Field("init_std", "initializer_range"),
    Field("moe.top_k", "num_experts_per_tok"),
)
KV_HEADS = Field(
    "n_kv_heads",
    "num_key_value_heads",
    to_theirs=lambda v, cfg: cfg.kv_heads,
    to_ours=_none_if(lambda c: _get(c, "num_attention_heads")),
)
HEAD_DIM = Field(
    "head_dim",
    "head_dim",
    to_theirs=lambda v, cfg: cfg.attn_head_dim,
    to_ours=_none_if(lambda c: _get(c, "hidden_size") // _get(c, "num_attention_heads")),
)
NORM_TOPK = Field("moe.normalize_topk", "norm_topk_prob")
MLP_ONLY = Field(
    "dense_layers", "mlp_only_layers", to_theirs=lambda v, cfg: list(v or []), to_ours=lambda v, c: v or None
)

# rotary positions: transformers 5's rope_parameters dict, our rope_* fields
_THEIR_TYPE = {"none": "default"}
_OUR_TYPE = {v: k for k, v in _THEIR_TYPE.items()}
_ROPE_KEYS = {
    "rope_factor": "factor",
    "rope_original_max_seq_len": "original_max_position_embeddings",
    "rope_beta_fast": "beta_fast",
    "rope_beta_slow": "beta_slow",
    "rope_mscale": "mscale",
    "rope_mscale_all_dim": "mscale_all_dim",
    "rope_attention_factor": "attention_factor",
    "rope_truncate": "truncate",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
}


def _their_kind(c) -> str:
    kind = (_get(c, "rope_parameters") or {}).get("rope_type", "default")
    return _OUR_TYPE.get(kind, kind)


def _rope_param(ours: str, theirs: str) -> Field:
    kinds = _ROPE_PARAMS[ours]

    def to_theirs(value, cfg):
        return value if cfg.rope_scaling in kinds and value is not None else OMIT

    def to_ours(value, c):
        kind = _their_kind(c)
        if kind not in kinds:
            return None
        if ours == "rope_factor" and value is None:  # transformers: the context's growth
            return (
                _get(c, "max_position_embeddings")
                / (_get(c, "rope_parameters") or {})[_ROPE_KEYS["rope_original_max_seq_len"]]
            )
        return value

    return Field(ours, f"rope_parameters.{theirs}", to_theirs, to_ours)


ROPE = (
    Field("rope_theta", "rope_parameters.rope_theta", to_theirs=lambda v, cfg: float(v)),
    Field(
        "rope_scaling",
        "rope_parameters.rope_type",
        to_theirs=lambda v, cfg: _THEIR_TYPE.get(v, v),
        to_ours=lambda v, c: None if v is None else _OUR_TYPE.get(v, v),
    ),
    *(_rope_param(o, t) for o, t in _ROPE_KEYS.items()),
)

# our fields with one value in the families below but DeepSeek-V3
MHA_ROUTED = {"attention": "mha", "rope_interleave": False, "first_k_dense": 0}
SOFTMAX_ROUTING = {
    "moe.activation": "swiglu",
    "moe.router": "token_choice",
    "moe.score_func": "softmax",
    "moe.softmax_before_topk": True,
    "moe.route_scale": 1.0,
    "moe.num_groups": None,
    "moe.topk_groups": None,
    "moe.expert_bias": False,
}
NO_SHARED = {"moe.num_shared_experts": 0, "moe.shared_expert_gate": False}
ALL_MOE = {"moe_every": 1, "dense_layers": None}

# ---------------------------------------------------------------------------------------------
# refusals every family makes

_SUPPORTED_ROPE = tuple(_THEIR_TYPE.get(k, k) for k in ROPE_SCALINGS)


def _rope_ok(value, _) -> bool:
    value = value or {}
    return value.get("rope_type", "default") in _SUPPORTED_ROPE and value.get("partial_rotary_factor", 1.0) == 1.0


def _rope_why(c) -> str:
    p = _get(c, "rope_parameters") or {}
    if p.get("partial_rotary_factor", 1.0) != 1.0:
        return "partial_rotary_factor: our rotary positions turn every pair of a head"
    if p.get("rope_type") == "dynamic":
        return (
            "rope_type 'dynamic' rescales by each forward's length beyond max_position_embeddings (inference-time "
            f"extrapolation); supported types are {_SUPPORTED_ROPE}"
        )
    return f"supported rope_type values are {_SUPPORTED_ROPE}"


def _no_noise(value, _) -> bool:
    return (value or 0.0) == 0


COMMON_FIXED: tuple[Fixed, ...] = (
    Fixed(
        "hidden_act",
        lambda cfg: "silu",
        lambda value, _: value in ("silu", "swish"),
        "our experts are SwiGLU (silu gate)",
    ),
    Fixed("rope_parameters", None, _rope_ok, _rope_why, shown=lambda p: p),
    Fixed(
        "partial_rotary_factor",
        None,
        lambda value, _: value in (None, 1.0),
        "our rotary positions turn every pair of a head",
    ),
    Fixed("attention_dropout", lambda cfg: 0.0, _no_noise, "our model has no such noise; 0 is valid"),
    Fixed(
        "quantization_config",
        None,
        lambda value, _: value is None,
        "only unquantized checkpoints are read",
        shown=lambda q: q.get("quant_method", q) if isinstance(q, dict) else getattr(q, "quant_method", q),
    ),
    Fixed(
        "sinks",
        None,
        lambda value, _: not value,
        "attention sinks (GPT-OSS) are not part of our attention",
    ),
    # a byte-level (or any Switchyard) vocabulary has no special tokens; a family's defaults (bos 1,
    # eos 2) would make generate() stop at an ordinary token. Any value is read: we have no use for them
    *(Fixed(f"{t}_token_id", lambda cfg: None, None) for t in ("bos", "eos", "pad")),
)

NO_BIAS = Fixed(
    "attention_bias", lambda cfg: False, lambda value, _: not value, "our attention projections have no bias"
)
NO_MLP_BIAS = Fixed("mlp_bias", None, lambda value, _: not value, "our MLPs have no bias")
NO_JITTER = Fixed("router_jitter_noise", lambda cfg: 0.0, _no_noise, "our router has no such noise; 0 is valid")


def _full_attention(value, c) -> bool:
    return not _get(c, "use_sliding_window") and all(t == "full_attention" for t in (value or []))


SLIDING_QWEN = (
    Fixed(
        "use_sliding_window", lambda cfg: False, lambda value, _: not value, "our attention is full causal attention"
    ),
    Fixed(
        "layer_types",
        None,
        _full_attention,
        "every layer of ours is full causal attention ('full_attention'); sliding-window layers are not supported",
    ),
)
