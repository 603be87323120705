"""What the architecture tests share: the open MoE families as pairs of a transformers config
and the same model as our ``TransformerConfig`` (``_families``), a naive mapping of transformers'
tensors (weights or gradients) into ours (``hf_to_ours``, written here, independent of the adapter
tables in ``moe/hf``), weights of unit gain (``randomize_``) and the tolerance.

Tolerance: ``max |ours - theirs| / max |theirs| <= 1e-5`` per tensor, fp32 on both sides: the two
compute the same formulas in a different order (SDPA against transformers' eager matmul-softmax,
our grouped experts against its loop), rounding at 6e-8 relative over ~10^2-10^3 dependent flops
(measured: logits <= 1.1e-6, gradients <= 4.6e-6, the worst a norm gain's, a sum over every token
and head); a wrong detail (an eps, a rotary layout, a scale) moves it by 1e-3 or more."""

from __future__ import annotations

import math

import pytest
import torch

from moe import MoEConfig
from moe.model import Transformer, TransformerConfig

V, D, L, B = 29, 24, 11, 2  # odd vocabulary and length on purpose


TOL = 1e-5


NO_AUX = dict(aux_loss_coef=0.0, z_loss_coef=0.0, seq_aux_loss_coef=0.0, capacity_factor=None)


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _families():
    """name -> (transformers config kwargs, our TransformerConfig kwargs), the same model twice."""
    return {
        # grouped-query attention, every block MoE, softmax top-2 renormalised
        "mixtral": (
            "MixtralConfig",
            dict(
                intermediate_size=20,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_local_experts=4,
                num_experts_per_tok=2,
                rms_norm_eps=1e-5,
                rope_parameters=dict(rope_type="default", rope_theta=1000.0),
            ),
            dict(
                n_heads=4,
                n_kv_heads=2,
                n_layers=2,
                d_ff=20,
                rope_theta=1000.0,
                norm_eps=1e-5,
                moe=MoEConfig(d_model=D, d_ff=20, num_experts=4, top_k=2, **NO_AUX),
            ),
        ),
        # qkv bias, gated shared expert, MoE every 2nd block (decoder_sparse_step) except block 3
        # (mlp_only_layers): blocks 1 and 5 MoE, 0, 2, 3, 4 dense of intermediate_size
        "qwen2_moe": (
            "Qwen2MoeConfig",
            dict(
                intermediate_size=20,
                moe_intermediate_size=8,
                shared_expert_intermediate_size=12,
                num_hidden_layers=6,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_experts=6,
                num_experts_per_tok=2,
                norm_topk_prob=False,
                decoder_sparse_step=2,
                mlp_only_layers=[3],
                qkv_bias=True,
                rms_norm_eps=1e-6,
            ),
            dict(
                n_heads=4,
                n_kv_heads=2,
                n_layers=6,
                d_ff=20,
                qkv_bias=True,
                moe_every=2,
                dense_layers=[3],
                norm_eps=1e-6,
                moe=MoEConfig(
                    d_model=D,
                    d_ff=8,
                    num_experts=6,
                    top_k=2,
                    normalize_topk=False,
                    num_shared_experts=1,
                    shared_d_ff=12,
                    shared_expert_gate=True,
                    **NO_AUX,
                ),
            ),
        ),
        # per-head q/k norm, head_dim 10 != 24 / 4, block 0 dense (mlp_only_layers)
        "qwen3_moe": (
            "Qwen3MoeConfig",
            dict(
                intermediate_size=20,
                moe_intermediate_size=8,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=10,
                num_experts=5,
                num_experts_per_tok=2,
                norm_topk_prob=True,
                mlp_only_layers=[0],
                rms_norm_eps=1e-6,
            ),
            dict(
                n_heads=4,
                n_kv_heads=2,
                head_dim=10,
                qk_norm="head",
                n_layers=3,
                d_ff=20,
                dense_layers=[0],
                norm_eps=1e-6,
                moe=MoEConfig(d_model=D, d_ff=8, num_experts=5, top_k=2, normalize_topk=True, **NO_AUX),
            ),
        ),
        # q/k norm over the whole projections (q: H J = 24, k: Z J = 12)
        "olmoe": (
            "OlmoeConfig",
            dict(
                intermediate_size=8,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_experts=6,
                num_experts_per_tok=3,
                norm_topk_prob=False,
                rms_norm_eps=1e-5,
                eos_token_id=None,
                pad_token_id=None,
            ),
            dict(
                n_heads=4,
                n_kv_heads=2,
                qk_norm="proj",
                n_layers=2,
                d_ff=8,
                norm_eps=1e-5,
                moe=MoEConfig(d_model=D, d_ff=8, num_experts=6, top_k=3, normalize_topk=False, **NO_AUX),
            ),
        ),
        # MLA with a query latent, interleaved rotary, yarn with both mscales (its softmax-scale
        # term and a cos/sin factor != 1), block 0 dense (first_k_dense_replace), two shared
        # experts fused, sigmoid scores with the correction bias, group-limited top-3, x2.5
        "deepseek_v3": (
            "DeepseekV3Config",
            dict(
                _DEEPSEEK,
                q_lora_rank=10,
                rope_interleave=True,
                rope_parameters=dict(
                    rope_type="yarn",
                    rope_theta=50.0,
                    factor=4.0,
                    original_max_position_embeddings=8,
                    beta_fast=8.0,
                    beta_slow=1.0,
                    mscale=0.9,
                    mscale_all_dim=1.1,
                ),
                max_position_embeddings=32,
            ),
            dict(
                _OURS_DEEPSEEK,
                q_lora_rank=10,
                rope_interleave=True,
                rope_theta=50.0,
                rope_scaling="yarn",
                rope_factor=4.0,
                rope_original_max_seq_len=8,
                rope_beta_fast=8.0,
                rope_beta_slow=1.0,
                rope_mscale=0.9,
                rope_mscale_all_dim=1.1,
            ),
        ),
        # MLA without a query latent, half-split rotary, unscaled
        "deepseek_v3_plain": (
            "DeepseekV3Config",
            dict(
                _DEEPSEEK,
                q_lora_rank=None,
                rope_interleave=False,
                rope_parameters=dict(rope_type="default", rope_theta=500.0),
            ),
            dict(_OURS_DEEPSEEK, q_lora_rank=None, rope_interleave=False, rope_theta=500.0),
        ),
    }


_DEEPSEEK = dict(
    intermediate_size=20,
    moe_intermediate_size=8,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=3,
    num_key_value_heads=3,
    n_shared_experts=2,
    n_routed_experts=8,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=3,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    kv_lora_rank=7,
    qk_rope_head_dim=6,
    qk_nope_head_dim=5,
    v_head_dim=9,
    rms_norm_eps=1e-6,  # the latent norms' eps is fixed at 1e-6 in transformers: ours is norm_eps
)


_OURS_DEEPSEEK = dict(
    attention="mla",
    n_heads=3,
    kv_lora_rank=7,
    qk_rope_head_dim=6,
    qk_nope_head_dim=5,
    v_head_dim=9,
    n_layers=3,
    d_ff=20,
    first_k_dense=1,
    norm_eps=1e-6,
    moe=MoEConfig(
        d_model=D,
        d_ff=8,
        num_experts=8,
        top_k=3,
        score_func="sigmoid",
        normalize_topk=True,
        route_scale=2.5,
        num_groups=4,
        topk_groups=2,
        expert_bias=True,
        num_shared_experts=2,  # shared_d_ff defaults to d_ff * 2: DeepSeek's n_shared * moe_intermediate_size
        **NO_AUX,
    ),
)


def hf_to_ours(hf: dict, cfg: TransformerConfig) -> dict:
    """transformers' tensors (weights, or their gradients) in our names and layouts."""
    out = {}
    for name, t in hf.items():
        if name.endswith("rotary_emb.inv_freq") or name.endswith("rotary_emb.original_inv_freq"):
            continue
        n = name.removeprefix("model.")
        n = n.replace("embed_tokens.", "embed.").replace("layers.", "blocks.")
        n = n.replace("input_layernorm", "attn_norm").replace("post_attention_layernorm", "ffn_norm")
        n = n.replace("self_attn.", "attn.").replace("mlp.", "ffn.")
        n = n.replace("attn.o_proj", "attn.proj").replace("q_a_layernorm", "q_a_norm")
        n = n.replace("kv_a_layernorm", "kv_a_norm").replace("kv_a_proj_with_mqa", "kv_a_proj")
        n = n.replace("shared_expert.", "shared_experts.").replace("ffn.gate.weight", "ffn.router.weight")
        n = n.replace("ffn.gate.e_score_correction_bias", "ffn.router.expert_bias")
        for theirs, ours in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            if not n.endswith("experts." + theirs):  # the fused experts' down_proj is not a Linear
                n = n.replace(theirs + ".", ours + ".")
        if n.endswith("experts.gate_up_proj"):  # [E, 2F, D]: gate rows then up rows
            F = t.shape[1] // 2
            out[n.replace("gate_up_proj", "w1")] = t[:, :F].transpose(1, 2)
            out[n.replace("gate_up_proj", "w3")] = t[:, F:].transpose(1, 2)
        elif n.endswith("experts.down_proj"):  # [E, D, F]
            out[n.replace("down_proj", "w2")] = t.transpose(1, 2)
        else:
            out[n] = t
    for i in range(cfg.n_layers):  # q, k, v rows into the fused projection
        p = f"blocks.{i}.attn."
        for kind in ("weight", "bias"):
            if cfg.attention == "mha" and p + f"q_proj.{kind}" in out:
                out[p + f"qkv.{kind}"] = torch.cat([out.pop(p + f"{x}_proj.{kind}") for x in "qkv"])
    return out


def worst_error(hf, ours, V: int, B: int, L: int) -> tuple[str, float]:
    """``(name, rel_err)`` of the worst of the logits and every weight's gradient, ours against
    transformers', after one backward of a random projection of the logits of a random batch."""
    torch.manual_seed(1)
    idx = torch.randint(0, V, (B, L))
    w_out = torch.randn(B, L, V)
    theirs = hf(input_ids=idx).logits
    (theirs * w_out).sum().backward()
    mine = ours(idx)
    (mine * w_out).sum().backward()
    errors = {"logits": rel_err(mine, theirs)}
    grads = hf_to_ours({n: p.grad for n, p in hf.named_parameters()}, ours.cfg)
    for name, p in ours.named_parameters():
        assert p.grad is not None and name in grads, name
        errors[name] = rel_err(p.grad, grads[name])
    worst = max(errors, key=errors.get)
    return worst, errors[worst]


def randomize_(module, seed: int):
    """Weights of unit gain (1/sqrt(fan_in), not transformers' 0.02: scores and router logits of
    order 1, so attention and routing are far from uniform), norm gains and biases away from 1 and
    0, DeepSeek's correction bias nonzero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.3 * r)
            elif name.endswith("bias"):
                p.copy_(0.5 * r)
            else:
                p.copy_(r / math.sqrt(p.shape[-1]))
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def build_pair(family: str):
    transformers = pytest.importorskip("transformers")
    cls_name, hf_kw, our_kw = _families()[family]
    hf_cfg = getattr(transformers, cls_name)(vocab_size=V, hidden_size=D, tie_word_embeddings=False, **hf_kw)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").float()
    randomize_(hf, seed=0)
    cfg = TransformerConfig(vocab_size=V, d_model=D, max_seq_len=16, **our_kw)
    ours = Transformer(cfg)
    state = {k: v.detach() for k, v in list(hf.named_parameters()) + list(hf.named_buffers())}
    mapped = hf_to_ours(state, cfg)
    own = ours.state_dict()
    # every tensor of ours comes from transformers', but the zero expert bias of a model without one
    assert set(mapped) <= set(own), sorted(set(mapped) - set(own))
    missing = sorted(k for k in set(own) - set(mapped) if not k.endswith("router.expert_bias"))
    assert not missing, missing
    ours.load_state_dict({**own, **mapped})
    return hf, ours


FAMILIES = list(_families())


def _cfg(**kw):
    base = dict(vocab_size=V, d_model=D, n_layers=6, n_heads=4, d_ff=20, max_seq_len=16)
    base.update(kw)
    if base.get("moe_every", 1) and "moe" not in base:
        base["moe"] = MoEConfig(d_model=D, d_ff=8, num_experts=4, top_k=2)
    return TransformerConfig(**base)
