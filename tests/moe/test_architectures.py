"""The open MoE families as ``TransformerConfig``s: each against transformers' own modeling code
(logits and every weight's gradient), the dense/MoE placement rules, document masking as an
oracle (a packed sequence computes each document as if alone), the pipeline stage's documents,
parameter and FLOP accounting, and the refusals.

transformers builds tiny random models from its config classes (nothing is downloaded); the
weights move into ours by a mapping written here (the adapter tables live in ``moe/hf`` and
are not used). Tolerance: ``max |ours - theirs| / max |theirs| <= 1e-5`` per tensor, fp32 on
both sides: the two compute the same formulas in a different order (SDPA against transformers'
eager matmul-softmax, our grouped experts against its loop), rounding at 6e-8 relative over
~10^2-10^3 dependent flops (measured: logits <= 1.1e-6, gradients <= 4.6e-6, the worst a norm
gain's, a sum over every token and head); a wrong detail (an eps, a rotary layout, a scale) moves
it by 1e-3 or more.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe import DenseFFN, MoEConfig, MoELayer
from moe.model import Transformer, TransformerConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

V, D, L, B = 29, 24, 11, 2  # odd vocabulary and length on purpose
TOL = 1e-5
NO_AUX = dict(aux_loss_coef=0.0, z_loss_coef=0.0, seq_aux_loss_coef=0.0, capacity_factor=None)


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


# ---------------------------------------------------------------- the five families


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


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_transformers(family):
    hf, ours = build_pair(family)
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
    assert errors[worst] <= TOL, f"{worst}: {errors[worst]:.2e}"
    # the placement transformers chose is ours
    hf_moe = [type(layer.mlp).__name__.endswith(("MoE", "SparseMoeBlock")) for layer in hf.model.layers]
    assert [isinstance(b.ffn, MoELayer) for b in ours.blocks] == hf_moe


# ---------------------------------------------------------------- placement


def _cfg(**kw):
    base = dict(vocab_size=V, d_model=D, n_layers=6, n_heads=4, d_ff=20, max_seq_len=16)
    base.update(kw)
    if base.get("moe_every", 1) and "moe" not in base:
        base["moe"] = MoEConfig(d_model=D, d_ff=8, num_experts=4, top_k=2)
    return TransformerConfig(**base)


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


# ---------------------------------------------------------------- documents


# the balancing losses are statistics of the whole batch, so they are off: packing changes the batch
DOC_CASES = {
    "gqa_qknorm_moe": dict(
        n_layers=2,
        n_kv_heads=2,
        head_dim=10,
        qk_norm="head",
        qkv_bias=True,
        moe=MoEConfig(d_model=D, d_ff=8, num_experts=4, top_k=2, **NO_AUX),
    ),
    "mla_yarn_moe": dict(
        _OURS_DEEPSEEK,
        q_lora_rank=10,
        rope_interleave=True,
        rope_scaling="yarn",
        rope_factor=4.0,
        rope_original_max_seq_len=8,
        rope_mscale_all_dim=1.0,
    ),
}


def _doc_model(case):
    torch.manual_seed(0)
    model = Transformer(_cfg(max_seq_len=16, **DOC_CASES[case]))
    randomize_(model, seed=3)
    return model


@pytest.mark.parametrize("case", list(DOC_CASES))
def test_packed_documents_compute_as_if_alone(case):
    model = _doc_model(case)
    torch.manual_seed(2)
    a, b = torch.randint(0, V, (1, 6)), torch.randint(0, V, (1, 9))
    w_a, w_b = torch.randn(1, 6, V), torch.randn(1, 9, V)
    packed = torch.cat([a, b], 1)
    doc_ids = torch.tensor([[3] * 6 + [8] * 9])

    def grads_of(loss_fn):
        model.zero_grad()
        loss_fn().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    out = model(packed, doc_ids=doc_ids)
    alone_a, alone_b = model(a), model(b)
    assert rel_err(out[:, :6], alone_a) <= TOL
    assert rel_err(out[:, 6:], alone_b) <= TOL
    for part, (lo, hi), alone, w in (("A", (0, 6), a, w_a), ("B", (6, 15), b, w_b)):
        g_packed = grads_of(lambda: (model(packed, doc_ids=doc_ids)[:, lo:hi] * w).sum())
        g_alone = grads_of(lambda: (model(alone) * w).sum())
        assert set(g_packed) == set(g_alone), part
        for name in g_alone:
            assert rel_err(g_packed[name], g_alone[name]) <= TOL, (part, name)


def test_one_document_is_the_causal_kernel():
    model = _doc_model("gqa_qknorm_moe")
    idx = torch.randint(0, V, (2, 13))
    same = torch.zeros(2, 13, dtype=torch.long)
    assert rel_err(model(idx, doc_ids=same), model(idx)) <= TOL
    # documents change the answer (positions restart, attention stops)
    docs = torch.tensor([[0] * 5 + [1] * 8, [0] * 13])
    out = model(idx, doc_ids=docs)
    assert rel_err(out[1:], model(idx[1:])) <= TOL
    assert rel_err(out[:1, 5:], model(idx[:1, 5:])) <= TOL
    assert not torch.allclose(out[:1, 5:], model(idx)[:1, 5:], atol=1e-3)


def test_pipeline_stages_take_documents():
    model = _doc_model("mla_yarn_moe")
    idx = torch.randint(0, V, (2, 12))
    docs = torch.tensor([[0] * 4 + [1] * 8, [2] * 7 + [0] * 5])
    n = model.num_pipeline_layers
    first, second = model.pipeline_stage(0, 2), model.pipeline_stage(2, n)
    staged = second(first(idx, doc_ids=docs), doc_ids=docs)
    assert rel_err(staged, model(idx, doc_ids=docs)) <= TOL


def test_doc_ids_shape_is_checked():
    model = _doc_model("gqa_qknorm_moe")
    with pytest.raises(ValueError, match="doc_ids"):
        model(torch.zeros(2, 5, dtype=torch.long), doc_ids=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="doc_ids"):
        model(torch.zeros(2, 5, dtype=torch.long), doc_ids=torch.zeros(2, 5))


def test_checkpointed_blocks_take_documents():
    model = _doc_model("gqa_qknorm_moe")
    idx = torch.randint(0, V, (2, 12))
    docs = torch.tensor([[0] * 4 + [1] * 8, [2] * 7 + [0] * 5])
    grads = []
    for ckpt in (False, True):
        model.cfg.checkpoint_activations = ckpt
        model.zero_grad()
        model(idx, doc_ids=docs).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    model.cfg.checkpoint_activations = False
    assert all(rel_err(a, b) <= TOL for a, b in zip(grads[1], grads[0]))


# ---------------------------------------------------------------- refusals


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
