"""Causal self-attention: ``Attention`` (multi-head, grouped-query, optional q/k RMSNorm and qkv
bias) and ``LatentAttention`` (DeepSeek's multi-head latent attention, MLA), over one kernel,
``torch.nn.functional.scaled_dot_product_attention``.

Shapes follow the project's legend (docs/design.md): B batch, L sequence length, D model dim,
H heads, Z key/value heads (H/Z query heads share one), J query/key head dim, O value head dim
(MLA's ``v_head_dim``; J elsewhere), Y rotary dims of a head.

Document masking: ``mask_B1LL`` (``document_mask``), True where a query may attend a key. Without it
the kernel runs with ``is_causal=True`` and no mask, as before documents existed. With it, SDPA takes
the boolean block-diagonal causal mask. Not ``flex_attention``: in torch 2.13 its backward is not
implemented on CPU (NotImplementedError, eager or not), and uncompiled it is a slow reference path
on GPU, while SDPA with a mask runs everywhere (the memory-efficient kernel on GPU).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as nnf

from .rope import apply_rotary


class _RMSNorm(torch.autograd.Function):
    """``(x * rsqrt(mean(x^2) + eps)).to(x.dtype) * weight``, normalised in fp32, keeping for the
    backward the input as it came and the fp32 reciprocal root only. Autograd over the same
    operators would keep the input's fp32 copy and the normalised value as well (4 + c bytes a
    value more, c the input's element size). The backward recomputes the normalised value and runs
    autograd's own formulas in autograd's order, so forward and gradients match it bit for bit."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = x.float()
        r = torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, r)
        return (x32 * r).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight, r = ctx.saved_tensors
        x32 = x.float()
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad * (x32 * r).to(x.dtype)).sum_to_size(weight.shape).to(weight.dtype)
        if not ctx.needs_input_grad[0]:
            return None, grad_w, None
        grad_n = (grad * weight).to(x.dtype).float()  # the product's, then the cast's
        # x32 * r, r = rsqrt(s), s = mean(x32^2) + eps: rsqrt's -0.5 r^3, mean's 1 / width, square's 2 x
        grad_s = (grad_n * x32).sum(-1, keepdim=True) * (-0.5 * r.pow(3))
        grad_x = grad_n * r + grad_s.expand_as(x32) / x32.shape[-1] * (2 * x32)
        return grad_x.to(x.dtype), grad_w, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalise in fp32: under bf16 autocast the mean of squares loses too many bits
        return _RMSNorm.apply(x, self.weight, self.eps)


def document_mask(segment_BL: torch.Tensor) -> torch.Tensor:
    """``[B, 1, L, L]``, True where query t may attend key s: s <= t, in the same document."""
    L = segment_BL.shape[1]
    causal_LL = torch.ones(L, L, dtype=torch.bool, device=segment_BL.device).tril()
    same_BLL = segment_BL[:, :, None] == segment_BL[:, None, :]
    return (same_BLL & causal_LL)[:, None]


def split_heads(x_BLX: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, L, n X/n] -> [B, n, L, X/n]`` (einops ``b l (h j) -> b h l j``), a view.

    Plain view ops rather than ``einops.rearrange``: torch.compile traces einops >= 0.8.2's pattern
    parser instruction by instruction on every compile (measured: 68% of a block's trace, see
    docs/design.md), and these two lines trace in none."""
    return x_BLX.unflatten(-1, (n, -1)).transpose(1, 2)


def merge_heads(y_BHLJ: torch.Tensor) -> torch.Tensor:
    """``[B, H, L, J] -> [B, L, H J]`` (einops ``b h l j -> b l (h j)``), a contiguous copy."""
    return y_BHLJ.transpose(1, 2).flatten(2)


def attend(q_BHLJ, k_BZLJ, v_BZLO, mask_B1LL=None, scale: float | None = None):
    """Causal attention, ``[B, H, L, O]``; grouped-query when Z < H (query head h reads key/value
    head h // (H / Z), as transformers' ``repeat_kv``)."""
    gqa = k_BZLJ.shape[1] != q_BHLJ.shape[1]
    if mask_B1LL is None:
        return nnf.scaled_dot_product_attention(q_BHLJ, k_BZLJ, v_BZLO, is_causal=True, scale=scale, enable_gqa=gqa)
    return nnf.scaled_dot_product_attention(q_BHLJ, k_BZLJ, v_BZLO, attn_mask=mask_B1LL, scale=scale, enable_gqa=gqa)


class Attention(nn.Module):
    """Multi-head attention with ``n_kv_heads`` key/value heads (grouped-query below ``n_heads``).

    One fused ``qkv`` projection, rows ``[q (H J) | k (Z J) | v (Z J)]``, each head-major (at Z = H
    and J = D / H, the layout of the model before grouped-query attention: its checkpoints load).
    ``qkv_bias`` gives it a bias (Qwen2-MoE; the output projection has none). ``qk_norm``:
    RMSNorm of queries and keys before the rotation, per head over J (``head``, Qwen3-MoE) or over
    the whole projection, ``H J`` for queries and ``Z J`` for keys (``proj``, OLMoE)."""

    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.attn_head_dim
        self.qk_norm, self.rope_interleave = cfg.qk_norm, cfg.rope_interleave
        H, Z, J = self.n_heads, self.n_kv_heads, self.head_dim
        self.qkv = nn.Linear(cfg.d_model, (H + 2 * Z) * J, bias=cfg.qkv_bias)
        self.proj = nn.Linear(H * J, cfg.d_model, bias=False)
        if cfg.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(J, cfg.norm_eps), RMSNorm(J, cfg.norm_eps)
        elif cfg.qk_norm == "proj":
            self.q_norm, self.k_norm = RMSNorm(H * J, cfg.norm_eps), RMSNorm(Z * J, cfg.norm_eps)

    def forward(self, x_BLD, cos, sin, mask_B1LL=None):
        H, Z, J = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.qkv(x_BLD).split([H * J, Z * J, Z * J], dim=-1)  # [B, L, H J], [B, L, Z J] x 2
        if self.qk_norm == "proj":
            q, k = self.q_norm(q), self.k_norm(k)
        q_BHLJ = split_heads(q, H)
        k_BZLJ = split_heads(k, Z)
        v_BZLJ = split_heads(v, Z)
        if self.qk_norm == "head":
            q_BHLJ, k_BZLJ = self.q_norm(q_BHLJ), self.k_norm(k_BZLJ)
        q_BHLJ = apply_rotary(q_BHLJ, cos, sin, self.rope_interleave)
        k_BZLJ = apply_rotary(k_BZLJ, cos, sin, self.rope_interleave)
        y_BHLJ = attend(q_BHLJ, k_BZLJ, v_BZLJ, mask_B1LL)
        return self.proj(merge_heads(y_BHLJ))


class LatentAttention(nn.Module):
    """DeepSeek-V2/V3's multi-head latent attention.

    Queries: ``q_proj`` (``q_lora_rank`` None), or down to a rank-``q_lora_rank`` latent
    (``q_a_proj``), RMSNorm (``q_a_norm``), up to the heads (``q_b_proj``). Keys and values:
    ``kv_a_proj`` gives a rank-``kv_lora_rank`` latent and one rotary key shared by every head
    (``qk_rope_head_dim`` wide); the latent, RMSNormed (``kv_a_norm``), goes up (``kv_b_proj``) to
    each head's unrotated key part (``qk_nope_head_dim``) and value (``v_head_dim``). Each head's
    query and key are ``[nope | rope]`` (J = nope + rope, only the rope part rotated); the output
    projection is ``proj`` (``H O -> D``). Softmax scale ``J^-1/2``, times
    ``mscale(factor, mscale_all_dim)^2`` under yarn when ``rope_mscale_all_dim`` is set (DeepSeek's
    ``yarn_get_mscale``)."""

    def __init__(self, cfg):
        super().__init__()
        D, H = cfg.d_model, cfg.n_heads
        self.n_heads, self.rope_interleave = H, cfg.rope_interleave
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank, self.q_lora = cfg.kv_lora_rank, cfg.q_lora_rank is not None
        J = self.nope + self.rope
        if not self.q_lora:
            self.q_proj = nn.Linear(D, H * J, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, cfg.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * J, bias=False)
        self.kv_a_proj = nn.Linear(D, self.kv_rank + self.rope, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_rank, cfg.norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, H * (self.nope + self.v_dim), bias=False)
        self.proj = nn.Linear(H * self.v_dim, D, bias=False)
        self.scale = cfg.mla_softmax_scale

    def forward(self, x_BLD, cos, sin, mask_B1LL=None):
        H = self.n_heads
        if self.q_lora:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x_BLD)))
        else:
            q = self.q_proj(x_BLD)
        q_BHLJ = split_heads(q, H)
        q_nope, q_rope = q_BHLJ.split([self.nope, self.rope], dim=-1)
        # the latent [B, L, kv_lora_rank] and the shared rotary key
        kv_lat, k_rope_BLY = self.kv_a_proj(x_BLD).split([self.kv_rank, self.rope], dim=-1)
        kv = split_heads(self.kv_b_proj(self.kv_a_norm(kv_lat)), H)
        k_nope, v_BHLO = kv.split([self.nope, self.v_dim], dim=-1)
        q_rope = apply_rotary(q_rope, cos, sin, self.rope_interleave)
        k_rope_B1LY = apply_rotary(k_rope_BLY[:, None], cos, sin, self.rope_interleave)
        q_BHLJ = torch.cat([q_nope, q_rope], dim=-1)
        k_BHLJ = torch.cat([k_nope, k_rope_B1LY.expand(-1, H, -1, -1)], dim=-1)
        y_BHLO = attend(q_BHLJ, k_BHLJ, v_BHLO, mask_B1LL, scale=self.scale)
        return self.proj(merge_heads(y_BHLO))
