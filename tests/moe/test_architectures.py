"""The open MoE families as ``TransformerConfig``s: each against transformers' own modeling code
(logits and every weight's gradient; tests/moe/architectures.py holds the pairs, the naive mapping
and the tolerance), the dense/MoE placement rules, parameter and FLOP accounting, and the
refusals."""

from __future__ import annotations

import pytest

from moe import DenseFFN, MoEConfig, MoELayer
from moe.model import Transformer
from tests.moe.architectures import (
    _OURS_DEEPSEEK,
    FAMILIES,
    TOL,
    B,
    D,
    L,
    V,
    _cfg,
    build_pair,
    worst_error,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_transformers(family):
    hf, ours = build_pair(family)
    worst, err = worst_error(hf, ours, V, B, L)
    assert err <= TOL, f"{worst}: {err:.2e}"
    # the placement transformers chose is ours
    hf_moe = [type(layer.mlp).__name__.endswith(("MoE", "SparseMoeBlock")) for layer in hf.model.layers]
    assert [isinstance(b.ffn, MoELayer) for b in ours.blocks] == hf_moe


@pytest.mark.parametrize("step", [1, 2, 3])
@pytest.mark.parametrize("mlp_only", [[], [0], [2, 5], [1, 3]])
def test_placement_is_qwens_rule(step, mlp_only):
    # Qwen2/3-MoE: MoE iff (i not in mlp_only_layers) and (i + 1) % decoder_sparse_step == 0
    want = [i not in mlp_only and (i + 1) % step == 0 for i in range(6)]
    if not any(want):
        return
    cfg = _cfg(moe_every=step, dense_layers=mlp_only)
    assert [cfg.is_moe_block(i) for i in range(6)] == want


@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_placement_is_deepseeks_rule(k):
    cfg = _cfg(first_k_dense=k)  # DeepSeek: MoE iff layer_idx >= first_k_dense_replace
    assert [cfg.is_moe_block(i) for i in range(6)] == [i >= k for i in range(6)]


def test_dense_blocks_use_d_ff_and_experts_moe_d_ff():
    model = Transformer(_cfg(first_k_dense=2, d_ff=20))
    for i, block in enumerate(model.blocks):
        if i < 2:
            assert isinstance(block.ffn, DenseFFN) and block.ffn.w1.weight.shape == (20, D)
        else:
            assert isinstance(block.ffn, MoELayer) and block.ffn.experts.w1.shape == (4, D, 8)


def test_param_counts_and_attention_flops():
    moe = MoEConfig(d_model=D, d_ff=8, num_experts=6, top_k=2, num_shared_experts=2)
    for kw in (
        dict(n_kv_heads=2, head_dim=10, qk_norm="head", qkv_bias=True, first_k_dense=1),
        dict(_OURS_DEEPSEEK, q_lora_rank=10, moe=moe),
    ):
        kw = {**dict(n_layers=3, n_heads=4, moe=moe), **kw}
        model = Transformer(_cfg(**kw))
        cfg = model.cfg
        n_moe = sum(cfg.is_moe_block(i) for i in range(cfg.n_layers))
        counts = model.param_counts()
        assert counts["total"] == sum(p.numel() for p in model.parameters())
        assert counts["active"] == counts["total"] - n_moe * (6 - 2) * 3 * D * 8
        qk, v = cfg.attn_head_dim, cfg.value_head_dim
        assert model.attention_flops_per_token(16) == 6 * 16 * cfg.n_layers * cfg.n_heads * (qk + v)
    # the convention of experiments' model_flops for plain multi-head attention
    plain = Transformer(_cfg(n_layers=3))
    assert plain.attention_flops_per_token(16) == 12 * 3 * D * 16


MLA_OK = dict(attention="mla", kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, moe_every=0)


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(n_kv_heads=3), "n_kv_heads"),  # does not divide 4 heads
        (dict(n_kv_heads=0), "n_kv_heads"),
        (dict(head_dim=7), "head_dim"),  # odd: no rotary pairs
        (dict(qk_norm="layer"), "qk_norm"),
        (dict(attention="gqa"), "attention"),
        (dict(qkv_bias=1), "qkv_bias"),
        (dict(kv_lora_rank=8), "kv_lora_rank"),  # an MLA dim without attention="mla"
        (dict(MLA_OK, kv_lora_rank=None), "kv_lora_rank"),
        (dict(MLA_OK, qk_rope_head_dim=5), "qk_rope_head_dim"),
        (dict(MLA_OK, v_head_dim=0), "v_head_dim"),
        (dict(MLA_OK, q_lora_rank=0), "q_lora_rank"),
        (dict(MLA_OK, n_kv_heads=2), "n_kv_heads"),
        (dict(MLA_OK, head_dim=8), "head_dim"),
        (dict(MLA_OK, qk_norm="head"), "qk_norm"),
        (dict(MLA_OK, qkv_bias=True), "qkv_bias"),
        (dict(rope_scaling="dynamic"), "rope_scaling"),
        (dict(rope_scaling="longrope"), "rope_scaling"),
        (dict(rope_factor=2.0), "rope_factor"),  # no scaling reads it
        (dict(rope_scaling="linear", rope_factor=0.0), "rope_factor"),
        (dict(rope_scaling="yarn", rope_factor=4.0), "rope_original_max_seq_len"),
        (dict(rope_scaling="linear", rope_factor=2.0, rope_beta_fast=8.0), "rope_beta_fast"),
        (dict(rope_scaling="linear", rope_factor=2.0, rope_mscale_all_dim=1.0), "rope_mscale_all_dim"),
        (
            dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_seq_len=8, rope_low_freq_factor=2.0),
            "rope_low_freq_factor",
        ),
        (dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_seq_len=8, rope_mscale=-1.0), "rope_mscale"),
        (
            dict(rope_scaling="llama3", rope_factor=8.0, rope_original_max_seq_len=8, rope_high_freq_factor=1.0),
            "rope_high_freq_factor",
        ),
        (dict(rope_theta=0.0), "rope_theta"),
        (dict(first_k_dense=-1), "first_k_dense"),
        (dict(first_k_dense=6), "first_k_dense"),  # no block left MoE
        (dict(dense_layers=[0, 1, 2, 3, 4, 5]), "dense_layers"),
        (dict(moe_every=2, dense_layers=[1, 3, 5]), "dense_layers"),
        (dict(dense_layers=[6]), "dense_layers"),
        (dict(dense_layers=[1, 1]), "dense_layers"),
        (dict(dense_layers="1"), "dense_layers"),
        (dict(moe_every=7), "moe_every"),
    ],
)
def test_refusals_name_the_field(kw, name):
    with pytest.raises(ValueError, match=rf"TransformerConfig\.{name}="):
        _cfg(**kw)
