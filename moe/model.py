"""The reference decoder-only transformer: pre-norm blocks of causal attention and an FFN that is an
``MoELayer`` in every ``moe_every``-th block and a dense SwiGLU elsewhere.

Shapes follow the project's legend (docs/design.md): B batch, L sequence length, D model dim,
H heads, J head dim (D / H), V vocabulary, F FFN hidden dim.

RMSNorm, rotary positions (half-split, as GPT-NeoX / Llama), attention through
``torch.nn.functional.scaled_dot_product_attention`` with ``is_causal=True``, no biases anywhere. Process groups are
arguments: pass ``ep_group``/``dp_group`` or any object carrying them
(a ``zero.Layout``); ``None`` is one process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as nnf
from einops import rearrange
from torch.utils.checkpoint import checkpoint

from routing_kernels.runtime import is_expert_param, recompute_context

from .config import MoEConfig
from .experts import DenseFFN
from .layer import MoELayer, moe_layers


@dataclass
class TransformerConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int  # hidden size F of the dense SwiGLU blocks
    max_seq_len: int
    # 1: every block is MoE; 2: blocks 1, 3, 5... (every other FFN, as Switch/GShard); 0: fully dense
    moe_every: int = 1
    moe: MoEConfig | None = None
    tie_embeddings: bool = False
    checkpoint_activations: bool = False  # recompute each block in backward: memory for compute
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self):
        def bad(name, value, valid):
            raise ValueError(f"TransformerConfig.{name}={value!r} is invalid: {valid}")

        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(name, v, "expected a positive integer")
        if self.d_model % self.n_heads:
            bad("n_heads", self.n_heads, f"must divide d_model={self.d_model}")
        if (self.d_model // self.n_heads) % 2:
            bad(
                "n_heads",
                self.n_heads,
                f"head dim d_model/n_heads={self.d_model // self.n_heads} must be even for rotary positions",
            )
        if not isinstance(self.moe_every, int) or self.moe_every < 0:
            bad("moe_every", self.moe_every, "expected an integer >= 0 (0 means fully dense)")
        if self.moe_every and self.moe is None:
            bad("moe", None, f"moe_every={self.moe_every} needs an MoEConfig (or moe_every=0 for a dense model)")
        if self.moe_every > self.n_layers:
            bad(
                "moe_every",
                self.moe_every,
                f"larger than n_layers={self.n_layers}, so no block would be MoE; use 0 for dense",
            )
        if self.moe is not None and self.moe.d_model != self.d_model:
            bad("moe", f"MoEConfig(d_model={self.moe.d_model})", f"its d_model must equal d_model={self.d_model}")
        if self.rope_theta <= 0:
            bad("rope_theta", self.rope_theta, "expected a number > 0")

    def is_moe_block(self, i: int) -> bool:
        return self.moe_every > 0 and i % self.moe_every == self.moe_every - 1

    @classmethod
    def from_dict(cls, d: dict, moe: MoEConfig | None = None) -> TransformerConfig:
        names = {f.name for f in fields(cls)} - {"moe"}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown TransformerConfig keys {unknown}; valid keys are {sorted(names)}")
        return cls(**d, moe=moe)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalise in fp32: under bf16 autocast the mean of squares loses too many bits
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotary_tables(seq_len: int, head_dim: int, theta: float, device=None):
    """cos and sin of each position's rotation angles, each ``[L, J/2]``."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x_BHLJ, cos, sin):
    # half-split rotation: pairs (x[i], x[i + J/2]) rotate by angle i; cos, sin are [L, J/2]
    x1, x2 = x_BHLJ.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.to(x_BHLJ.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x_BLD, cos, sin):
        q_BHLJ, k_BHLJ, v_BHLJ = rearrange(self.qkv(x_BLD), "b l (three h j) -> three b h l j", three=3, h=self.n_heads)
        q_BHLJ, k_BHLJ = apply_rotary(q_BHLJ, cos, sin), apply_rotary(k_BHLJ, cos, sin)
        y_BHLJ = nnf.scaled_dot_product_attention(q_BHLJ, k_BHLJ, v_BHLJ, is_causal=True)
        return self.proj(rearrange(y_BHLJ, "b h l j -> b l (h j)"))


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig, is_moe: bool, ep_group=None, dp_group=None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = (
            MoELayer(cfg.moe, ep_group=ep_group, dp_group=dp_group)
            if is_moe
            else DenseFFN(cfg.d_model, cfg.d_ff, "swiglu")
        )

    def forward(self, x_BLD, cos, sin):
        x_BLD = x_BLD + self.attn(self.attn_norm(x_BLD), cos, sin)
        return x_BLD + self.ffn(self.ffn_norm(x_BLD))


class Transformer(nn.Module):
    """``forward(idx_BL) -> logits_BLV``. Auxiliary MoE losses need no handling by the caller: they
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
        cos, sin = rotary_tables(cfg.max_seq_len, cfg.d_model // cfg.n_heads, cfg.rope_theta)
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
        for block in self.blocks:
            nn.init.normal_(block.attn.qkv.weight, std=std)
            nn.init.normal_(block.attn.proj.weight, std=std / math.sqrt(2 * self.cfg.n_layers))

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``idx_BL -> logits_BLV`` for the whole model. A pipeline stage (``pipeline_stage``) maps
        what its first layer takes (token ids ``[B, L]`` or activations ``[B, L, D]``) to what its
        last layer gives (activations ``[B, L, D]``, or logits)."""
        lo, hi = self.layer_range
        L = x.shape[1]
        if L > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {L} exceeds max_seq_len={self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:L], self.rope_sin[:L]
        x_BLD = self.embed(x) if lo == 0 else x
        for i in range(max(lo, 1) - 1, min(hi - 1, self.cfg.n_layers)):  # layer i + 1 is block i
            block = self.blocks[i]
            if self.cfg.checkpoint_activations and self.training and torch.is_grad_enabled():
                # the recompute context tells a compiled MoE layer it is being recomputed
                x_BLD = checkpoint(block, x_BLD, cos, sin, use_reentrant=False, context_fn=recompute_context)
            else:
                x_BLD = block(x_BLD, cos, sin)
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
