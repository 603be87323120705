"""What the moe.hf.patch tests share: a tiny randomly initialised transformers model per
architecture (built from its config class, nothing downloaded), and stock vs patched comparisons:
logits, loss (with the balancing loss where the model computes one), router logits, every
weight's gradient, within 1e-5 relative in fp32.

Relative means ``||a - b|| / ||b||`` per tensor (an elementwise ratio is meaningless where a
gradient element is ~0)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moe.hf as hf  # noqa: E402
from moe import MoELayer  # noqa: E402
from moe.hf.tables import ours_to_fused  # noqa: E402

RTOL = 1e-5


VOCAB, B, L = 97, 2, 12


COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    hidden_act="silu",
    attention_dropout=0.0,
)


def _mixtral(**kw):
    cfg = transformers.MixtralConfig(
        **COMMON,
        intermediate_size=24,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
        **kw,
    )
    return transformers.MixtralForCausalLM, cfg


def _qwen2(norm_topk_prob=False, **kw):
    cfg = transformers.Qwen2MoeConfig(
        **COMMON,
        intermediate_size=40,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=True,
        router_aux_loss_coef=0.1,
        **kw,
    )
    return transformers.Qwen2MoeForCausalLM, cfg


def _qwen3(norm_topk_prob, **kw):
    cfg = transformers.Qwen3MoeConfig(
        **COMMON,
        intermediate_size=40,
        moe_intermediate_size=24,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        head_dim=8,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
        **kw,
    )
    return transformers.Qwen3MoeForCausalLM, cfg


def _olmoe(**kw):
    cfg = transformers.OlmoeConfig(
        **COMMON,
        intermediate_size=24,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
        **kw,
    )
    return transformers.OlmoeForCausalLM, cfg


def _deepseek_v3(**kw):
    # first_k_dense_replace=1: layer 0 keeps its dense MLP, layer 1 is MoE (only MoE blocks change)
    common = {k: v for k, v in COMMON.items() if k != "num_key_value_heads"}
    cfg = transformers.DeepseekV3Config(
        **common,
        num_key_value_heads=4,
        intermediate_size=40,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        output_router_logits=True,
        **kw,
    )
    return transformers.DeepseekV3ForCausalLM, cfg


ARCHS = {
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2,
    "qwen2_moe_norm": lambda **kw: _qwen2(True, **kw),
    "qwen3_moe_norm": lambda **kw: _qwen3(True, **kw),
    "qwen3_moe_nonorm": lambda **kw: _qwen3(False, **kw),
    "olmoe": _olmoe,
    "deepseek_v3": _deepseek_v3,
}


def _build(arch, **kw):
    cls, cfg = ARCHS[arch](**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg).float()
    router_cls = type(_moe_blocks(model)[0].gate)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, router_cls):
                # logits of std ~3 rather than ~0.1: each token's choice depends on the token, so a
                # wrong selection rule (group limit, bias, top-k) changes the outputs
                m.weight.normal_(0.0, 0.5)
            if hasattr(m, "e_score_correction_bias"):  # a bias that changes which experts are picked
                m.e_score_correction_bias.uniform_(-0.3, 0.3)
    return model


def _moe_blocks(model):
    return [m for m in model.modules() if type(m).__name__ == hf._BLOCKS[model.config.model_type][0]]


def _stock_grad(name: str, patched: dict[str, torch.nn.Parameter]) -> tuple[list[str], torch.Tensor | None]:
    """The patched parameters that hold the stock parameter ``name``, and their gradient in the stock layout."""
    if name in patched:  # untouched (attention, norms, embeddings, dense MLPs)
        return [name], patched[name].grad
    prefix, _, leaf = name.rpartition("mlp.")
    mlp = prefix + "mlp."
    remap = {
        "gate.weight": "router.weight",
        "shared_expert.gate_proj.weight": "shared_experts.w1.weight",
        "shared_expert.up_proj.weight": "shared_experts.w3.weight",
        "shared_expert.down_proj.weight": "shared_experts.w2.weight",
        "shared_experts.gate_proj.weight": "shared_experts.w1.weight",
        "shared_experts.up_proj.weight": "shared_experts.w3.weight",
        "shared_experts.down_proj.weight": "shared_experts.w2.weight",
        "shared_expert_gate.weight": "shared_expert_gate.weight",
    }
    if leaf in ("experts.gate_up_proj", "experts.down_proj"):  # the mapping table's expert layouts
        names = [mlp + f"experts.{w}" for w in ("w1", "w3", "w2")]
        gate_up, down = ours_to_fused(*(patched[n].grad for n in names))
        return (names[:2], gate_up) if leaf == "experts.gate_up_proj" else (names[2:], down)
    if leaf in remap:
        return [mlp + remap[leaf]], patched[mlp + remap[leaf]].grad
    raise KeyError(f"no mapping for the stock parameter {name}")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _close(a, b, what):
    assert a is not None and b is not None, what
    err = _rel(a, b)
    assert err <= RTOL, f"{what}: relative error {err:.3g} > {RTOL}"


def _compare(stock, patched, train: bool, n_moe: int):
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, L))
    stock.train(train)
    patched.train(train)
    a = stock(ids, labels=ids)
    b = patched(ids, labels=ids)
    _same_outputs(a, b, n_moe)
    return a, b


def _same_outputs(a, b, n_moe: int | None, what: str = ""):
    """``b``'s logits, loss, aux loss and router logits equal ``a``'s (``n_moe``: how many router
    logits each holds; None: not checked)."""
    _close(b.logits, a.logits, f"{what}logits")
    _close(b.loss, a.loss, f"{what}loss")
    if getattr(a, "aux_loss", None) is not None:  # DeepSeek-V3 computes no balancing loss
        _close(b.aux_loss, a.aux_loss, f"{what}aux_loss")
    if not hasattr(a, "router_logits"):  # DeepSeek-V3 in transformers 5.17 returns none
        return
    if n_moe is not None:
        assert len(b.router_logits) == len(a.router_logits) == n_moe
    for i, (ra, rb) in enumerate(zip(a.router_logits, b.router_logits)):
        _close(rb, ra, f"{what}router_logits[{i}]")


def _check(arch, **kw):
    stock = _build(arch, **kw)
    patched = hf.patch(copy.deepcopy(stock))
    n_moe = len(_moe_blocks(stock))
    assert n_moe >= 1
    assert len([m for m in patched.modules() if isinstance(m, MoELayer)]) == n_moe
    assert not _moe_blocks(patched)

    # training step: forward, backward, every gradient, then one SGD step on both
    a, b = _compare(stock, patched, train=True, n_moe=n_moe)
    a.loss.backward()
    b.loss.backward()
    pp = dict(patched.named_parameters())
    covered = set()
    for name, p in stock.named_parameters():
        pnames, g = _stock_grad(name, pp)
        _close(g, p.grad, f"grad of {name} (patched {pnames})")
        covered.update(pnames)
    assert covered == set(pp), sorted(set(pp) ^ covered)  # every patched weight checked, none extra
    for model in (stock, patched):
        torch.optim.SGD(model.parameters(), lr=0.5).step()
        model.zero_grad(set_to_none=True)

    # eval after the step: the patched weights moved exactly as the stock ones
    with torch.no_grad():
        _compare(stock, patched, train=False, n_moe=n_moe)
    return stock, patched


def _scaled(model):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)  # exact in fp32, and the same whatever layout holds the weight
    return model


def _load_stock(cls, path):
    model, info = cls.from_pretrained(path, attn_implementation="eager", dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    return model.state_dict()


def _assert_same_state(got: dict, want: dict, what):
    assert list(got) == list(want), what
    for name, t in want.items():
        assert torch.equal(got[name], t), (what, name)


def _mixtral_gelu():
    _, cfg = _mixtral()
    cfg.hidden_act = "gelu"
    return cfg


class _Grad:
    def __init__(self, grad):
        self.grad = grad
