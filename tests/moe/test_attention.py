"""Attention and rotary positions against a deliberately naive reference: every option of
``TransformerConfig``'s attention (multi-head, grouped-query, head dims that are no power of two,
q/k norms, qkv bias, MLA with and without a query latent), both rotary layouts, every rope scaling
type and document masking; forward and every parameter's gradient.

The reference shares no code with ``moe/``: a Python loop over heads, an explicit softmax over
explicitly masked scores (each query's allowed keys listed by a loop over tokens), each rotary pair
turned in a loop over pairs, each scaling rule's frequencies in Python floats from its formula, and
it runs in float64, so what the comparison measures is the fp32 model's own rounding.

Tolerance: ``max |ours - ref| / max |ref| <= 1e-5`` per tensor. fp32 rounds at 6e-8 relative; a
logit or gradient here is the end of ~10^2-10^3 dependent flops over two blocks, which keeps the
error near 1e-6 (measured: median 1.3e-6, worst 4e-6, a norm gain's gradient: a sum over every
token with cancellation); a wrong formula moves it by 1e-3 or more.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe.model import Transformer, TransformerConfig
from moe.rope import RopeSpec, inv_frequencies

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

V, L, B = 29, 11, 2  # odd vocabulary and length on purpose
TOL = 1e-5


# ---------------------------------------------------------------- the naive reference (float64)


def naive_inv_freq(cfg: TransformerConfig) -> list[float]:
    """Each rotary pair's angle per position, from the scaling rule's formula, in Python floats."""
    Y = cfg.rope_dim
    base = [cfg.rope_theta ** -(2 * i / Y) for i in range(Y // 2)]
    kind, s = cfg.rope_scaling, cfg.rope_factor
    if kind == "none":
        return base
    if kind == "linear":
        return [f / s for f in base]
    orig = cfg.rope_original_max_seq_len
    if kind == "llama3":
        lo_wl, hi_wl = orig / cfg.rope_low_freq_factor, orig / cfg.rope_high_freq_factor
        out = []
        for f in base:
            wl = 2 * math.pi / f
            if wl < hi_wl:  # high frequency: kept
                out.append(f)
            elif wl > lo_wl:  # low frequency: interpolated
                out.append(f / s)
            else:  # a blend, by where the wavelength sits between the two
                t = (orig / wl - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
                out.append((1 - t) * f / s + t * f)
        return out

    # yarn: pair d keeps its frequency if it turns more than beta_fast times over the original
    # context, takes the interpolated one below beta_slow turns, a linear ramp in d between
    def pair_at(turns):
        return Y * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    lo, hi = pair_at(cfg.rope_beta_fast), pair_at(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, Y - 1)
    if lo == hi:
        hi += 0.001
    out = []
    for d, f in enumerate(base):
        interp = min(max((d - lo) / (hi - lo), 0.0), 1.0)  # 0: original frequency, 1: interpolated
        out.append(f * (1 - interp) + f / s * interp)
    return out


def naive_cos_scale(cfg: TransformerConfig) -> float:
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.rope_attention_factor is not None:
        return cfg.rope_attention_factor

    def m(scale, ms):
        return 1.0 if scale <= 1 else 0.1 * ms * math.log(scale) + 1.0

    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return m(cfg.rope_factor, cfg.rope_mscale) / m(cfg.rope_factor, cfg.rope_mscale_all_dim)
    return m(cfg.rope_factor, 1.0)


def naive_documents(doc_ids, batch, length):
    """Per sequence: each token's document (a run of equal ids) and its position in it."""
    seg, pos = [], []
    for b in range(batch):
        s_b, p_b, cur, start = [], [], 0, 0
        for t in range(length):
            if t > 0 and doc_ids is not None and doc_ids[b][t] != doc_ids[b][t - 1]:
                cur, start = cur + 1, t
            s_b.append(cur)
            p_b.append(t - start)
        seg.append(s_b)
        pos.append(p_b)
    return seg, pos


def naive_rotate(x_LY, pos, inv_freq, scale, interleave):
    """Turn each pair of ``x_LY`` (one head, positions ``pos``) by its angle, pair by pair."""
    Y = x_LY.shape[-1]
    out = x_LY.clone()
    for i in range(Y // 2):
        a, b = (2 * i, 2 * i + 1) if interleave else (i, i + Y // 2)
        ang = torch.tensor([p * inv_freq[i] for p in pos], dtype=x_LY.dtype)
        c, s = torch.cos(ang) * scale, torch.sin(ang) * scale
        out[:, a] = x_LY[:, a] * c - x_LY[:, b] * s
        out[:, b] = x_LY[:, a] * s + x_LY[:, b] * c
    return out


def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def naive_softmax_attention(q_LJ, k_LJ, v_LO, seg, scale):
    """One head of one sequence: each query over the keys it may see (earlier, same document)."""
    Lq = q_LJ.shape[0]
    rows = []
    for t in range(Lq):
        allowed = [s for s in range(Lq) if s <= t and seg[s] == seg[t]]
        scores = torch.stack([(q_LJ[t] * k_LJ[s]).sum() * scale for s in allowed])
        w = torch.exp(scores - scores.max())
        w = w / w.sum()
        rows.append(sum(w[i] * v_LO[s] for i, s in enumerate(allowed)))
    return torch.stack(rows)


def naive_attention(cfg, P, pre, x_BLD, seg, pos):
    """One block's attention; ``P`` the reference's parameters, ``pre`` the block's name prefix."""
    inv_freq, cscale = naive_inv_freq(cfg), naive_cos_scale(cfg)
    H, eps = cfg.n_heads, cfg.norm_eps
    out = []
    for b in range(x_BLD.shape[0]):
        x = x_BLD[b]
        heads = []
        if cfg.attention == "mla":
            n, r, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
            if cfg.q_lora_rank is None:
                q = x @ P[pre + "q_proj.weight"].T
            else:
                lat = rms(x @ P[pre + "q_a_proj.weight"].T, P[pre + "q_a_norm.weight"], eps)
                q = lat @ P[pre + "q_b_proj.weight"].T
            ckv = x @ P[pre + "kv_a_proj.weight"].T
            kv_lat = rms(ckv[:, : cfg.kv_lora_rank], P[pre + "kv_a_norm.weight"], eps)
            k_rope = naive_rotate(ckv[:, cfg.kv_lora_rank :], pos[b], inv_freq, cscale, cfg.rope_interleave)
            kv = kv_lat @ P[pre + "kv_b_proj.weight"].T
            scale = (n + r) ** -0.5
            if cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim:
                scale *= (0.1 * cfg.rope_mscale_all_dim * math.log(cfg.rope_factor) + 1.0) ** 2
            for h in range(H):
                qh = q[:, h * (n + r) : (h + 1) * (n + r)]
                q_rope = naive_rotate(qh[:, n:], pos[b], inv_freq, cscale, cfg.rope_interleave)
                kvh = kv[:, h * (n + vd) : (h + 1) * (n + vd)]
                qh = torch.cat([qh[:, :n], q_rope], -1)
                kh = torch.cat([kvh[:, :n], k_rope], -1)
                heads.append(naive_softmax_attention(qh, kh, kvh[:, n:], seg[b], scale))
        else:
            Z, J = cfg.kv_heads, cfg.attn_head_dim
            W = P[pre + "qkv.weight"]
            bias = P.get(pre + "qkv.bias")
            q_w, k_w, v_w = W[: H * J], W[H * J : (H + Z) * J], W[(H + Z) * J :]
            q, k, v = x @ q_w.T, x @ k_w.T, x @ v_w.T
            if bias is not None:
                q, k, v = q + bias[: H * J], k + bias[H * J : (H + Z) * J], v + bias[(H + Z) * J :]
            if cfg.qk_norm == "proj":
                q, k = rms(q, P[pre + "q_norm.weight"], eps), rms(k, P[pre + "k_norm.weight"], eps)
            for h in range(H):
                g = h // (H // Z)  # the key/value head this query head reads
                qh, kh, vh = q[:, h * J : (h + 1) * J], k[:, g * J : (g + 1) * J], v[:, g * J : (g + 1) * J]
                if cfg.qk_norm == "head":
                    qh, kh = rms(qh, P[pre + "q_norm.weight"], eps), rms(kh, P[pre + "k_norm.weight"], eps)
                qh = naive_rotate(qh, pos[b], inv_freq, cscale, cfg.rope_interleave)
                kh = naive_rotate(kh, pos[b], inv_freq, cscale, cfg.rope_interleave)
                heads.append(naive_softmax_attention(qh, kh, vh, seg[b], J**-0.5))
        out.append(torch.cat(heads, -1) @ P[pre + "proj.weight"].T)
    return torch.stack(out)


def naive_model(cfg, P, idx_BL, doc_ids=None):
    """The dense model (moe_every=0): embedding, pre-norm blocks of attention and SwiGLU, head."""
    Bn, Ln = idx_BL.shape
    seg, pos = naive_documents(None if doc_ids is None else doc_ids.tolist(), Bn, Ln)
    x = P["embed.weight"][idx_BL]
    for i in range(cfg.n_layers):
        p = f"blocks.{i}."
        x = x + naive_attention(cfg, P, p + "attn.", rms(x, P[p + "attn_norm.weight"], cfg.norm_eps), seg, pos)
        h = rms(x, P[p + "ffn_norm.weight"], cfg.norm_eps)
        g = h @ P[p + "ffn.w1.weight"].T
        x = x + ((g * torch.sigmoid(g)) * (h @ P[p + "ffn.w3.weight"].T)) @ P[p + "ffn.w2.weight"].T
    return rms(x, P["norm.weight"], cfg.norm_eps) @ P["lm_head.weight"].T


# ---------------------------------------------------------------- the comparison


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def build(seed=0, scale=1.0, **kw) -> Transformer:
    base = dict(vocab_size=V, d_model=24, n_layers=2, n_heads=4, d_ff=20, max_seq_len=16, moe_every=0, moe=None)
    base.update(kw)
    torch.manual_seed(seed)
    model = Transformer(TransformerConfig(**base))
    # weights of unit gain (1/sqrt(fan_in)): scores of order 1, so attention is far from uniform and a
    # rotary or mask bug moves the output; norm gains and biases away from 1 and 0, so each is used.
    # (At gain 1.5 the norm gains' gradients, sums over every token with cancellation, reach 1e-5.)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * scale / math.sqrt(p.shape[-1]))
    return model


DOCS = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2], [5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7]])


def naive_errors(model: Transformer, doc_ids=None) -> dict[str, float]:
    """The relative error of the logits and of each parameter's gradient against the reference."""
    cfg = model.cfg
    torch.manual_seed(1)
    idx = torch.randint(0, V, (B, L))
    w_out = torch.randn(B, L, V, dtype=torch.float64)
    P = {n: p.detach().double().requires_grad_() for n, p in model.named_parameters()}
    ref = naive_model(cfg, P, idx, doc_ids)
    (ref * w_out).sum().backward()
    out = model(idx, doc_ids=doc_ids)
    (out * w_out.float()).sum().backward()
    errors = {"logits": rel_err(out, ref)}
    for name, p in model.named_parameters():
        errors[name] = rel_err(p.grad, P[name].grad)
    return errors


def check_against_naive(model: Transformer, doc_ids=None):
    errors = naive_errors(model, doc_ids)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, f"{worst}: {errors[worst]:.2e} (all: {errors})"
    return errors


MHA_CASES = {
    "mha_J6": dict(),  # J = 24 / 4 = 6: no power of two
    "gqa1_J6": dict(n_kv_heads=4),
    "gqa2_J10": dict(n_kv_heads=2, head_dim=10),
    "gqa4_J12": dict(n_kv_heads=1, head_dim=12),
    "qknorm_head_gqa2_J10": dict(n_kv_heads=2, head_dim=10, qk_norm="head"),
    "qknorm_proj_gqa2": dict(n_kv_heads=2, qk_norm="proj"),
    "qknorm_proj_J10": dict(head_dim=10, qk_norm="proj"),
    "qkv_bias_gqa2": dict(n_kv_heads=2, qkv_bias=True),
    "interleave_J10": dict(head_dim=10, rope_interleave=True),
    "linear": dict(head_dim=12, rope_scaling="linear", rope_factor=2.5),
    # small theta and original context so the yarn ramp and the llama3 blend fall inside 6 pairs
    "yarn": dict(head_dim=12, rope_theta=50.0, rope_scaling="yarn", rope_factor=4.0, rope_original_max_seq_len=64),
    "yarn_mscales_untruncated": dict(
        head_dim=12,
        rope_theta=50.0,
        rope_scaling="yarn",
        rope_factor=3.0,
        rope_original_max_seq_len=12,
        rope_beta_fast=8.0,
        rope_beta_slow=0.5,
        rope_mscale=0.8,
        rope_mscale_all_dim=1.3,
        rope_truncate=False,
    ),
    "yarn_attention_factor": dict(
        head_dim=12,
        rope_theta=50.0,
        rope_scaling="yarn",
        rope_factor=4.0,
        rope_original_max_seq_len=12,
        rope_attention_factor=1.2,
    ),
    "llama3": dict(
        head_dim=12,
        rope_theta=50.0,
        rope_scaling="llama3",
        rope_factor=6.0,
        rope_original_max_seq_len=32,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=3.0,
    ),
}
MLA = dict(attention="mla", n_heads=3, kv_lora_rank=7, qk_rope_head_dim=6, qk_nope_head_dim=5, v_head_dim=9)
MLA_CASES = {
    "mla": dict(MLA),
    "mla_q_lora": dict(MLA, q_lora_rank=10),
    "mla_interleave": dict(MLA, rope_interleave=True),
    "mla_q_lora_interleave_yarn": dict(
        MLA,
        q_lora_rank=10,
        rope_interleave=True,
        rope_theta=50.0,
        rope_scaling="yarn",
        rope_factor=4.0,
        rope_original_max_seq_len=10,
        rope_mscale=0.9,
        rope_mscale_all_dim=1.1,
    ),
}
CASES = {**MHA_CASES, **MLA_CASES}


@pytest.mark.parametrize("docs", [False, True], ids=["one_doc", "docs"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_naive_reference(case, docs):
    check_against_naive(build(**CASES[case]), DOCS if docs else None)


def test_scaled_tables_are_not_trivial():
    # each scaling case must move some frequencies and keep others, or it tests nothing the
    # unscaled case does not
    for case in ("yarn", "yarn_mscales_untruncated", "llama3"):
        cfg = build(**MHA_CASES[case]).cfg
        plain = naive_inv_freq(TransformerConfig(**{**cfg.__dict__, **_unscaled()}))
        scaled = naive_inv_freq(cfg)
        kept = [abs(a - b) < 1e-12 for a, b in zip(plain, scaled)]
        divided = [abs(a / cfg.rope_factor - b) < 1e-12 for a, b in zip(plain, scaled)]
        between = [not (k or d) for k, d in zip(kept, divided)]
        assert any(kept) and any(divided) and any(between), (case, plain, scaled)


def _unscaled():
    return dict(
        rope_scaling="none",
        rope_factor=1.0,
        rope_original_max_seq_len=None,
        rope_beta_fast=32.0,
        rope_beta_slow=1.0,
        rope_mscale=0.0,
        rope_mscale_all_dim=0.0,
        rope_attention_factor=None,
        rope_truncate=True,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
    )


def test_frequencies_match_transformers():
    """Our tables against transformers' own rope initialisers (modeling_rope_utils), per type."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    dim, theta = 12, 50.0
    cases = [
        (dict(rope_type="linear", factor=2.5), RopeSpec(theta, "linear", 2.5)),
        (
            dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
            RopeSpec(theta, "yarn", 4.0, original_max_seq_len=64),
        ),
        (
            dict(
                rope_type="yarn",
                factor=3.0,
                original_max_position_embeddings=12,
                beta_fast=8.0,
                beta_slow=0.5,
                mscale=0.8,
                mscale_all_dim=1.3,
                truncate=False,
            ),
            RopeSpec(theta, "yarn", 3.0, 12, 8.0, 0.5, 0.8, 1.3, truncate=False),
        ),
        (
            dict(
                rope_type="llama3",
                factor=6.0,
                original_max_position_embeddings=32,
                low_freq_factor=1.0,
                high_freq_factor=3.0,
            ),
            RopeSpec(theta, "llama3", 6.0, 32, low_freq_factor=1.0, high_freq_factor=3.0),
        ),
    ]
    for params, spec in cases:
        hf_cfg = LlamaConfig(
            hidden_size=dim * 2,
            num_attention_heads=2,
            head_dim=dim,
            max_position_embeddings=64,
            rope_parameters=dict(rope_theta=theta, **params),
        )
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_cfg, "cpu")
        torch.testing.assert_close(inv_frequencies(dim, spec), inv_freq, rtol=0, atol=0, msg=str(params))
        assert spec.attention_scale() == pytest.approx(attention_factor, rel=1e-12), params


def test_document_positions_restart():
    # rotary scores depend on position differences only, so a document's logits cannot show
    # whether its positions restart (a shift changes rounding, not values): checked here directly
    from moe.rope import document_positions

    docs = torch.cat([DOCS, torch.tensor([[1, 1, 2, 1, 1, 1, 3, 3, 3, 3, 0]])])  # a reused id is a new document
    seg, pos = naive_documents(docs.tolist(), 3, L)
    segment_BL, pos_BL = document_positions(docs)
    assert segment_BL.tolist() == seg and pos_BL.tolist() == pos
    assert pos_BL[2].tolist() == [0, 1, 0, 0, 1, 2, 0, 1, 2, 3, 0]


@pytest.mark.parametrize(
    "x_dtype,w_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
@pytest.mark.parametrize("shape", [(3, 5, 64), (2, 4, 7, 16)])
def test_rmsnorm_is_autograd_over_its_operators_bit_for_bit_keeping_less(x_dtype, w_dtype, shape):
    # the autograd.Function keeps the input and the fp32 reciprocal root only and recomputes the
    # rest: forward and both gradients equal autograd over the same operators exactly (bf16
    # weights under an fp32 gain included), and what it keeps is those two
    from moe.attention import RMSNorm

    def over_operators(x, w, eps):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)).to(x.dtype) * w

    torch.manual_seed(0)
    norm = RMSNorm(shape[-1]).to(w_dtype)
    with torch.no_grad():
        norm.weight.mul_(torch.randn(shape[-1]).to(w_dtype) * 0.1 + 1)
    x = torch.randn(shape).to(x_dtype).requires_grad_(True)
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() != norm.weight.untyped_storage().data_ptr():
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = norm(x)
    want = over_operators(x, norm.weight, norm.eps)
    g = torch.randn(got.shape).to(got.dtype)
    assert got.dtype == want.dtype and torch.equal(got, want)
    for a, b in zip(torch.autograd.grad(got, (x, norm.weight), g), torch.autograd.grad(want, (x, norm.weight), g)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    rows = x.numel() // shape[-1]
    assert sum(saved.values()) == x.numel() * x.element_size() + 4 * rows
