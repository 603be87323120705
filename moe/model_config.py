"""``TransformerConfig``: the reference transformer's architecture as one dataclass, every field
checked by name in ``__post_init__`` (attention, rotary positions and their scaling, the placement
of dense and MoE blocks), and the derived sizes the model and the planner read.

The options the open MoE checkpoints need are general fields; ``moe.model``'s docstring lists
which family uses which.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .config import MoEConfig
from .rope import ROPE_SCALINGS, RopeSpec, yarn_mscale

QK_NORMS = ("none", "head", "proj")
ATTENTIONS = ("mha", "mla")
_MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
# the rope parameters each scaling type reads, beyond theta
_ROPE_PARAMS = {
    "rope_factor": ("linear", "yarn", "llama3"),
    "rope_original_max_seq_len": ("yarn", "llama3"),
    "rope_beta_fast": ("yarn",),
    "rope_beta_slow": ("yarn",),
    "rope_mscale": ("yarn",),
    "rope_mscale_all_dim": ("yarn",),
    "rope_attention_factor": ("yarn",),
    "rope_truncate": ("yarn",),
    "rope_low_freq_factor": ("llama3",),
    "rope_high_freq_factor": ("llama3",),
}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class TransformerConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int  # hidden size F of the dense SwiGLU blocks (each expert's is moe.d_ff)
    max_seq_len: int
    # Which blocks are MoE: block i (from 0) is MoE iff moe_every > 0, (i + 1) % moe_every == 0,
    # i >= first_k_dense and i is not in dense_layers. moe_every 1: every block; 2: blocks 1, 3, 5...
    # (Switch/GShard; Qwen2-MoE's decoder_sparse_step); 0: fully dense
    moe_every: int = 1
    moe: MoEConfig | None = None
    tie_embeddings: bool = False
    checkpoint_activations: bool = False  # recompute each block in backward: memory for compute
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5  # every RMSNorm's (blocks, final, q/k norms, MLA's latent norms)
    init_std: float = 0.02
    first_k_dense: int = 0  # the first k blocks are dense (DeepSeek's first_k_dense_replace)
    # blocks that are dense (Qwen's mlp_only_layers); a plain None default, not a default_factory,
    # so the Hydra schema's fields all have a value
    dense_layers: list[int] | None = None

    # attention
    attention: str = "mha"  # mha: multi-head / grouped-query; mla: DeepSeek's multi-head latent attention
    n_kv_heads: int | None = None  # key/value heads, dividing n_heads (grouped-query); None: n_heads
    head_dim: int | None = None  # J; the q and output projections are n_heads * head_dim wide; None: d_model / n_heads
    # RMSNorm of queries and keys before rotary: none; head (each head over J, Qwen3-MoE); proj (the
    # whole projection: n_heads * J for queries, n_kv_heads * J for keys, OLMoE)
    qk_norm: str = "none"
    qkv_bias: bool = False  # a bias on the fused q/k/v projection, none on the output's (Qwen2-MoE)
    # MLA (attention="mla"); queries and keys are qk_nope_head_dim + qk_rope_head_dim wide per head,
    # values v_head_dim; q_lora_rank None: a plain query projection
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None

    # rotary positions (moe.rope): pairs (x[2i], x[2i+1]) when interleaved (DeepSeek's rope_interleave),
    # else (x[i], x[i + J/2])
    rope_interleave: bool = False
    rope_scaling: str = "none"  # none | linear | yarn | llama3 (transformers' rope_type; none = default)
    rope_factor: float = 1.0
    rope_original_max_seq_len: int | None = None  # yarn, llama3: the pre-training context
    rope_beta_fast: float = 32.0  # yarn
    rope_beta_slow: float = 1.0  # yarn
    rope_mscale: float = 0.0  # yarn; 0: unset
    # yarn; 0: unset. With attention="mla" it also multiplies the softmax scale by
    # (0.1 * rope_mscale_all_dim * ln(rope_factor) + 1)^2 (DeepSeek-V2/V3)
    rope_mscale_all_dim: float = 0.0
    rope_attention_factor: float | None = None  # yarn: the factor on cos/sin; None: from the mscales
    rope_truncate: bool = True  # yarn: round the ramp's ends to whole pairs
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3

    def __post_init__(self):
        def bad(name, value, valid):
            raise ValueError(f"TransformerConfig.{name}={value!r} is invalid: {valid}")

        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                bad(name, v, "expected a positive integer")
        self._check_attention(bad)
        self._check_rope(bad)
        self._check_placement(bad)
        if self.moe is not None and self.moe.d_model != self.d_model:
            bad("moe", f"MoEConfig(d_model={self.moe.d_model})", f"its d_model must equal d_model={self.d_model}")

    def _check_attention(self, bad):
        H = self.n_heads
        if self.attention not in ATTENTIONS:
            bad("attention", self.attention, f"expected one of {ATTENTIONS}")
        if self.qk_norm not in QK_NORMS:
            bad("qk_norm", self.qk_norm, f"expected one of {QK_NORMS}")
        for name in ("qkv_bias", "rope_interleave", "rope_truncate"):
            if not isinstance(getattr(self, name), bool):
                bad(name, getattr(self, name), "expected true or false")
        if self.attention == "mla":
            for name in _MLA_DIMS:
                v = getattr(self, name)
                if (v is not None or name != "q_lora_rank") and (not _is_int(v) or v < 1):
                    bad(name, v, "expected a positive integer (attention='mla' needs it)")
            if self.qk_rope_head_dim % 2:
                bad("qk_rope_head_dim", self.qk_rope_head_dim, "must be even: rotary positions turn pairs")
            why = {
                "n_kv_heads": ("keys and values of every head come from one latent", None),
                "head_dim": ("MLA's heads are qk_nope_head_dim + qk_rope_head_dim (q, k) and v_head_dim wide", None),
                "qk_norm": ("MLA normalises its latents (q_a_norm, kv_a_norm), not q and k", "none"),
                "qkv_bias": ("MLA's projections have no bias", False),
            }
            for name, (reason, default) in why.items():
                v = getattr(self, name)
                if v != default and not (name == "n_kv_heads" and v == H):
                    bad(name, v, f"not an option of attention='mla': {reason}")
            return
        for name in _MLA_DIMS:
            if getattr(self, name) is not None:
                bad(name, getattr(self, name), "an MLA dimension: set attention='mla' to use it, or leave it null")
        if self.n_kv_heads is not None and (not _is_int(self.n_kv_heads) or self.n_kv_heads < 1 or H % self.n_kv_heads):
            bad("n_kv_heads", self.n_kv_heads, f"expected a positive divisor of n_heads={H} (or null: n_heads)")
        if self.head_dim is not None:
            if not _is_int(self.head_dim) or self.head_dim < 2 or self.head_dim % 2:
                bad("head_dim", self.head_dim, "expected an even integer >= 2 (rotary positions turn pairs), or null")
            return
        if self.d_model % H:
            bad("n_heads", H, f"must divide d_model={self.d_model} (or set head_dim)")
        if (self.d_model // H) % 2:
            bad("n_heads", H, f"head dim d_model/n_heads={self.d_model // H} must be even for rotary positions")

    def _check_rope(self, bad):
        if not _is_number(self.rope_theta) or self.rope_theta <= 0:
            bad("rope_theta", self.rope_theta, "expected a number > 0")
        kind = self.rope_scaling
        if kind == "dynamic":
            bad(
                "rope_scaling",
                kind,
                "dynamic NTK rescales by each forward's length beyond max_position_embeddings, an inference-time "
                "extrapolation; within it (any training length) it is the default table: use 'none'",
            )
        if kind not in ROPE_SCALINGS:
            bad("rope_scaling", kind, f"expected one of {ROPE_SCALINGS}")
        defaults = {f.name: f.default for f in fields(self)}
        for name, kinds in _ROPE_PARAMS.items():
            if kind not in kinds and getattr(self, name) != defaults[name]:
                bad(name, getattr(self, name), f"rope_scaling={kind!r} does not use it (it is for {'/'.join(kinds)})")
        if not _is_number(self.rope_factor) or self.rope_factor <= 0:
            bad("rope_factor", self.rope_factor, "expected a number > 0")
        if kind in ("yarn", "llama3"):
            v = self.rope_original_max_seq_len
            if not _is_int(v) or v < 1:
                bad("rope_original_max_seq_len", v, f"rope_scaling={kind!r} needs the pre-training context length")
        for name in ("rope_beta_fast", "rope_beta_slow", "rope_low_freq_factor", "rope_high_freq_factor"):
            if not _is_number(getattr(self, name)) or getattr(self, name) <= 0:
                bad(name, getattr(self, name), "expected a number > 0")
        for name in ("rope_mscale", "rope_mscale_all_dim"):
            if not _is_number(getattr(self, name)) or getattr(self, name) < 0:
                bad(name, getattr(self, name), "expected a number >= 0 (0: unset)")
        if self.rope_attention_factor is not None and (
            not _is_number(self.rope_attention_factor) or self.rope_attention_factor <= 0
        ):
            bad("rope_attention_factor", self.rope_attention_factor, "expected a number > 0, or null")
        if self.rope_low_freq_factor >= self.rope_high_freq_factor:
            bad(
                "rope_high_freq_factor",
                self.rope_high_freq_factor,
                f"must exceed rope_low_freq_factor={self.rope_low_freq_factor}",
            )

    def _check_placement(self, bad):
        n = self.n_layers
        if not _is_int(self.moe_every) or self.moe_every < 0:
            bad("moe_every", self.moe_every, "expected an integer >= 0 (0 means fully dense)")
        if not _is_int(self.first_k_dense) or self.first_k_dense < 0:
            bad("first_k_dense", self.first_k_dense, "expected an integer >= 0")
        dense = self.dense_layers
        if dense is not None:
            if not isinstance(dense, (list, tuple)) or not all(_is_int(i) for i in dense):
                bad("dense_layers", dense, "expected a list of block indices, or null")
            self.dense_layers = dense = list(dense)
            if any(not 0 <= i < n for i in dense) or len(set(dense)) != len(dense):
                bad("dense_layers", dense, f"expected distinct block indices in [0, n_layers={n})")
        if self.moe_every and self.moe is None:
            bad("moe", None, f"moe_every={self.moe_every} needs an MoEConfig (or moe_every=0 for a dense model)")
        if self.moe_every > n:
            bad("moe_every", self.moe_every, f"larger than n_layers={n}, so no block would be MoE; use 0 for dense")
        if self.moe_every and not any(self.is_moe_block(i) for i in range(n)):
            # blame first_k_dense when it alone leaves no MoE block, else dense_layers
            alone = any((i + 1) % self.moe_every == 0 for i in range(self.first_k_dense, n))
            name = "dense_layers" if alone else "first_k_dense"
            bad(name, getattr(self, name), "leaves no block MoE; use moe_every=0 for a dense model")

    def is_moe_block(self, i: int) -> bool:
        return (
            self.moe_every > 0
            and (i + 1) % self.moe_every == 0
            and i >= self.first_k_dense
            and i not in (self.dense_layers or ())
        )

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.attention == "mla" or self.n_kv_heads is None else self.n_kv_heads

    @property
    def attn_head_dim(self) -> int:
        """J, the width of a query or key head."""
        if self.attention == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim or self.d_model // self.n_heads

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.attention == "mla" else self.attn_head_dim

    @property
    def rope_dim(self) -> int:
        """Y, the rotated dims of a query or key head."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.attn_head_dim

    @property
    def rope_spec(self) -> RopeSpec:
        return RopeSpec(
            theta=float(self.rope_theta),
            scaling=self.rope_scaling,
            factor=float(self.rope_factor),
            original_max_seq_len=self.rope_original_max_seq_len,
            beta_fast=float(self.rope_beta_fast),
            beta_slow=float(self.rope_beta_slow),
            mscale=float(self.rope_mscale),
            mscale_all_dim=float(self.rope_mscale_all_dim),
            attention_factor=self.rope_attention_factor,
            truncate=self.rope_truncate,
            low_freq_factor=float(self.rope_low_freq_factor),
            high_freq_factor=float(self.rope_high_freq_factor),
        )

    @property
    def mla_softmax_scale(self) -> float:
        scale = self.attn_head_dim**-0.5
        if self.rope_scaling == "yarn" and self.rope_mscale_all_dim:
            scale *= yarn_mscale(self.rope_factor, self.rope_mscale_all_dim) ** 2
        return scale

    @classmethod
    def from_dict(cls, d: dict, moe: MoEConfig | None = None) -> TransformerConfig:
        names = {f.name for f in fields(cls)} - {"moe"}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown TransformerConfig keys {unknown}; valid keys are {sorted(names)}")
        return cls(**d, moe=moe)
