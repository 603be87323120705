"""The reference decoder-only transformer: pre-norm blocks of causal attention (``moe.attention``)
and an FFN that is an ``MoELayer`` or a dense SwiGLU, by ``TransformerConfig.is_moe_block``.

Shapes follow the project's legend (docs/design.md): B batch, L sequence length, D model dim,
H heads, J head dim, V vocabulary, F FFN hidden dim, Y rotary dims of a head.

RMSNorm, rotary positions (``moe.rope``), attention through
``torch.nn.functional.scaled_dot_product_attention``. The defaults are the model as it was before
the open checkpoints' options: multi-head attention, J = D / H, half-split rotary, no scaling, no
biases, ``is_causal=True``. Process groups are arguments: pass ``ep_group``/``dp_group`` or any
object carrying them (a ``zero.Layout``, and its ``ep_node_groups`` under ``ep_dispatch="node"``);
``None`` is one process.

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

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from routing_kernels.runtime import is_expert_param, recompute_context

from .attention import Attention, LatentAttention, RMSNorm, document_mask
from .experts import DenseFFN
from .layer import MoELayer, moe_layers
from .model_config import TransformerConfig
from .recompute import checkpoint_once
from .rope import apply_rotary, document_positions, rotary_tables

__all__ = ["Transformer", "TransformerConfig", "Block", "RMSNorm", "apply_rotary", "rotary_tables"]


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig, is_moe: bool, ep_group=None, dp_group=None, ep_node_groups=None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = LatentAttention(cfg) if cfg.attention == "mla" else Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = (
            MoELayer(cfg.moe, ep_group=ep_group, dp_group=dp_group, ep_node_groups=ep_node_groups)
            if is_moe
            else DenseFFN(cfg.d_model, cfg.d_ff, "swiglu")
        )

    def forward(self, x_BLD, cos, sin, mask_B1LL=None):
        x_BLD = x_BLD + self.attn(self.attn_norm(x_BLD), cos, sin, mask_B1LL)
        return x_BLD + self.ffn(self.ffn_norm(x_BLD))


class Transformer(nn.Module):
    """``forward(idx_BL, doc_ids_BL=None) -> logits_BLV``. Auxiliary MoE losses need no handling by the caller: they
    reach the backward pass through each ``MoELayer``.

    ``recompute_once``: under ``checkpoint_activations``, checkpoint each block with
    ``moe.recompute.checkpoint_once`` (one recomputation for every backward pass over the graph: a
    split backward's input and weight passes) instead of ``torch.utils.checkpoint`` (one per pass).
    ``zero.pipeline.Pipeline`` sets it on its chunks under a split-backward schedule."""

    recompute_once = False

    def __init__(self, cfg: TransformerConfig, *, ep_group=None, dp_group=None, layout=None):
        super().__init__()
        if layout is not None:
            if ep_group is not None or dp_group is not None:
                raise ValueError("pass either layout or ep_group/dp_group, not both")
            ep_group, dp_group = getattr(layout, "ep_group", None), getattr(layout, "dp_group", None)
        tiers = getattr(layout, "ep_node_groups", None)  # None: the flat dispatch
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(
            Block(cfg, cfg.is_moe_block(i), ep_group, dp_group, tiers) for i in range(cfg.n_layers)
        )
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
                if self.recompute_once:  # a split backward: one recomputation for all its passes
                    x_BLD = checkpoint_once(block, x_BLD, cos, sin, mask_B1LL, context_fn=recompute_context)
                else:
                    x_BLD = checkpoint(
                        block, x_BLD, cos, sin, mask_B1LL, use_reentrant=False, context_fn=recompute_context
                    )
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
