"""The reference decoder-only transformer: pre-norm blocks of causal attention (``moe.attention``)
and an FFN that is an ``MoELayer`` or a dense SwiGLU, by ``TransformerConfig.is_moe_block``.

Shapes follow the project's legend (docs/design.md): B batch, L sequence length, D model dim,
H heads, J head dim, V vocabulary, F FFN hidden dim, Y rotary dims of a head.

RMSNorm, rotary positions (``moe.rope``), attention through
``torch.nn.functional.scaled_dot_product_attention``. The defaults are the model as it was before
the open checkpoints' options: multi-head attention, J = D / H, half-split rotary, no scaling, no
biases, ``is_causal=True``. Process groups are arguments: pass ``ep_group``/``dp_group`` or any
object carrying them (a ``zero.Layout``); ``None`` is one process.

The options the open MoE checkpoints need are general config fields (the adapters in ``moe/hf``
map each family onto them):

- Mixtral: ``n_kv_heads``.
- Qwen2-MoE: ``n_kv_heads``, ``qkv_bias``, ``moe_every`` (``decoder_sparse_step``), ``dense_layers``
  (``mlp_only_layers``), MoEConfig's gated shared expert.
- Qwen3-MoE: ``n_kv_heads``, ``head_dim``, ``qk_norm="head"``, ``moe_every``, ``dense_layers``.
- OLMoE: ``qk_norm="proj"``.
- DeepSeek-V3: ``attention="mla"`` and its dims, ``rope_interleave``, ``rope_scaling="yarn"``,
  ``first_k_dense`` (``first_k_dense_replace``), MoEConfig's shared experts and sigmoid group routing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from routing_kernels.runtime import is_expert_param, recompute_context

from .attention import Attention, LatentAttention, RMSNorm, document_mask
from .config import MoEConfig
from .experts import DenseFFN
from .layer import MoELayer, moe_layers
from .rope import ROPE_SCALINGS, RopeSpec, apply_rotary, document_positions, rotary_tables, yarn_mscale

__all__ = ["Transformer", "TransformerConfig", "Block", "RMSNorm", "apply_rotary", "rotary_tables"]

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


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig, is_moe: bool, ep_group=None, dp_group=None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = LatentAttention(cfg) if cfg.attention == "mla" else Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = (
            MoELayer(cfg.moe, ep_group=ep_group, dp_group=dp_group)
            if is_moe
            else DenseFFN(cfg.d_model, cfg.d_ff, "swiglu")
        )

    def forward(self, x_BLD, cos, sin, mask_B1LL=None):
        x_BLD = x_BLD + self.attn(self.attn_norm(x_BLD), cos, sin, mask_B1LL)
        return x_BLD + self.ffn(self.ffn_norm(x_BLD))


class Transformer(nn.Module):
    """``forward(idx_BL, doc_ids_BL=None) -> logits_BLV``. Auxiliary MoE losses need no handling by the caller: they
    reach the backward pass through each ``MoELayer``."""

    def __init__(self, cfg: TransformerConfig, *, ep_group=None, dp_group=None, layout=None):
        super().__init__()
        if layout is not None:
            if ep_group is not None or dp_group is not None:
                raise ValueError("pass either layout or ep_group/dp_group, not both")
            ep_group, dp_group = getattr(layout, "ep_group", None), getattr(layout, "dp_group", None)
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, cfg.is_moe_block(i), ep_group, dp_group) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rotary_tables(cfg.max_seq_len, cfg.rope_dim, cfg.rope_spec)
        # not persistent: derived from the config, so checkpoints do not carry them
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _init_weights(self):
        # embeddings and attention at std 0.02 (GPT-2); residual output projections scaled by
        # 1/sqrt(2 n_layers) so the residual stream's variance does not grow with depth. MoE
        # experts and the dense FFNs keep their own (identical) fan-in init, so dense and MoE
        # baselines start alike.
        std = self.cfg.init_std
        nn.init.normal_(self.embed.weight, std=std)
        nn.init.normal_(self.lm_head.weight, std=std)
        # the q/k norms start at 1 and the qkv bias at 0 (transformers' init of those checkpoints)
        for block in self.blocks:
            for name, p in block.attn.named_parameters():
                if name == "proj.weight":
                    nn.init.normal_(p, std=std / math.sqrt(2 * self.cfg.n_layers))
                elif name.endswith("proj.weight") or name == "qkv.weight":
                    nn.init.normal_(p, std=std)
                elif name == "qkv.bias":
                    nn.init.zeros_(p)

    # the layers a pipeline cuts between: the embedding, each block, the head (final norm + lm_head)
    @property
    def num_pipeline_layers(self) -> int:
        return self.cfg.n_layers + 2

    @property
    def layer_range(self) -> tuple[int, int]:
        """The pipeline layers this module holds, ``[lo, hi)`` of ``num_pipeline_layers``; an error
        for a module holding several separate runs of layers (``keep_layers``)."""
        kept = getattr(self, "_kept", None)
        if kept is None:
            return 0, self.num_pipeline_layers
        lo, hi = min(kept), max(kept) + 1
        if len(kept) != hi - lo:
            raise ValueError(
                f"this module holds pipeline layers {sorted(kept)}, not one contiguous run: run the "
                f"stages made with pipeline_stage() instead"
            )
        return lo, hi

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``idx_BL -> logits_BLV`` for the whole model. A pipeline stage (``pipeline_stage``) maps
        what its first layer takes (token ids ``[B, L]`` or activations ``[B, L, D]``) to what its
        last layer gives (activations ``[B, L, D]``, or logits).

        ``doc_ids``: ``[B, L]`` integers, one per token, for sequences packed from several documents:
        a token attends only to the earlier tokens of its own document (a run of equal ids), and
        rotary positions restart at each document, so each document is computed as if alone (the
        scores depend on position differences only; the restart keeps each document's angles, and
        so their rounding, those of the document alone)
        ``None``: one document per sequence, on the causal kernel without a mask."""
        lo, hi = self.layer_range
        B, L = x.shape[:2]
        if L > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {L} exceeds max_seq_len={self.cfg.max_seq_len}")
        mask_B1LL = None
        if doc_ids is None:
            cos, sin = self.rope_cos[:L], self.rope_sin[:L]
        else:
            if tuple(doc_ids.shape) != (B, L) or doc_ids.is_floating_point() or doc_ids.is_complex():
                raise ValueError(
                    f"doc_ids must be integers of shape [B, L] = {[B, L]} (one document id per token), got "
                    f"{doc_ids.dtype} of shape {list(doc_ids.shape)}"
                )
            segment_BL, pos_BL = document_positions(doc_ids.to(x.device))
            cos, sin = self.rope_cos[pos_BL][:, None], self.rope_sin[pos_BL][:, None]  # [B, 1, L, Y/2]
            mask_B1LL = document_mask(segment_BL)
        x_BLD = self.embed(x) if lo == 0 else x
        for i in range(max(lo, 1) - 1, min(hi - 1, self.cfg.n_layers)):  # layer i + 1 is block i
            block = self.blocks[i]
            if self.cfg.checkpoint_activations and self.training and torch.is_grad_enabled():
                # the recompute context tells a compiled MoE layer it is being recomputed
                x_BLD = checkpoint(block, x_BLD, cos, sin, mask_B1LL, use_reentrant=False, context_fn=recompute_context)
            else:
                x_BLD = block(x_BLD, cos, sin, mask_B1LL)
        if hi == self.num_pipeline_layers:
            return self.lm_head(self.norm(x_BLD))
        return x_BLD

    def compile_blocks(self, **compile_kwargs) -> None:
        """``torch.compile`` each block, as torchtitan does: one graph per block (attention and
        its MoE layer or dense FFN, no graph break), shared by blocks of the same kind. The block's
        ``forward`` is compiled, not its call, so hooks on the block itself (ZeRO's gathers and
        releases, pipeline bookkeeping) run eagerly around the graph and parameter names are
        unchanged; hooks on modules inside a block (the trainer's statistics) are traced."""
        for block in self.blocks:
            if isinstance(block, Block):  # a pipeline placeholder (nn.Identity) has nothing to compile
                block.forward = torch.compile(block.forward, **compile_kwargs)

    def pipeline_stage(self, lo: int, hi: int) -> Transformer:
        """A module that runs pipeline layers ``[lo, hi)`` of this model (layer 0 the embedding,
        layer i + 1 block i, the last layer the final norm and lm_head); see ``keep_layers``."""
        return self.keep_layers([(lo, hi)])

    def keep_layers(self, ranges: list[tuple[int, int]]) -> Transformer:
        """A module holding the pipeline layers of ``ranges`` (``[(lo, hi), ...]``) of this model
        and sharing their parameters. Every parameter keeps its name in the whole model
        (``blocks.3.attn.qkv.weight``), so a stage's weights, gradients and checkpoints line up with
        the unsplit model's; blocks outside the ranges are parameterless placeholders, and the
        embedding or the head outside them are None. One range runs as a pipeline stage; several
        (a rank's virtual stages) make the module that holds them all, for the ZeRO engine."""
        n = self.num_pipeline_layers
        if getattr(self, "_kept", None) is not None:
            raise ValueError(f"keep_layers() splits the whole model; this module holds layers {sorted(self._kept)}")
        kept: set[int] = set()
        for r in ranges:
            lo, hi = r
            if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo < hi <= n):
                raise ValueError(
                    f"pipeline layers [{lo}, {hi}) are invalid: expected 0 <= lo < hi <= {n} "
                    f"(the embedding, {self.cfg.n_layers} blocks and the head)"
                )
            kept |= set(range(lo, hi))
        if not kept:
            raise ValueError("keep_layers() needs at least one range of layers")
        if self.cfg.tie_embeddings and (0 in kept) != (n - 1 in kept):
            raise ValueError(
                f"tie_embeddings=True shares one weight between the embedding (layer 0) and the head "
                f"(layer {n - 1}), and layers {sorted(kept)} hold only one of them: untie them "
                f"(model.tie_embeddings=false) to split the model into pipeline stages"
            )
        part = Transformer.__new__(Transformer)
        nn.Module.__init__(part)
        part.cfg = self.cfg
        part._kept = frozenset(kept)
        part.embed = self.embed if 0 in kept else None
        part.blocks = nn.ModuleList(b if i + 1 in kept else nn.Identity() for i, b in enumerate(self.blocks))
        part.norm = self.norm if n - 1 in kept else None
        part.lm_head = self.lm_head if n - 1 in kept else None
        part.register_buffer("rope_cos", self.rope_cos, persistent=False)
        part.register_buffer("rope_sin", self.rope_sin, persistent=False)
        return part

    def moe_layers(self) -> list[MoELayer]:
        return moe_layers(self)

    def param_counts(self) -> dict:
        """``total``: every parameter once (tied weights once, all experts of the global model even
        when this rank holds E/ep of them). ``active``: what one token passes through: everything
        but the routed experts, plus top_k routed experts per MoE layer (for expert choice, top_k
        is the mean experts per token at capacity factor 1)."""
        seen, dense = set(), 0
        for p in self.parameters():
            if id(p) in seen or is_expert_param(p):
                continue
            seen.add(id(p))
            dense += p.numel()
        total = active = dense
        for layer in self.moe_layers():
            experts = layer.experts
            per_expert = sum(p.numel() for p in experts.parameters()) // experts.num_local
            total += per_expert * experts.num_global
            active += per_expert * layer.cfg.top_k
        return {"total": total, "active": active, "embedding": self.embed.weight.numel()}

    def attention_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward and backward, 3x the forward's) of one token's attention scores
        and weighted values over a context of ``seq_len``, causal masking not discounted (the PaLM
        paper's MFU convention): ``6 seq_len n_layers H (J + O)``, which is
        ``12 n_layers d_model seq_len`` for multi-head attention with J = O = d_model / H. The
        projections are parameters, counted by ``param_counts``."""
        cfg = self.cfg
        return 6 * seq_len * cfg.n_layers * cfg.n_heads * (cfg.attn_head_dim + cfg.value_head_dim)
