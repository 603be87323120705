"""Sparse upcycling: an MoE model started from a dense checkpoint (Komatsuzaki et al. 2022,
"Sparse Upcycling"; Megatron-Core's ``upcycling``). Every dense block becomes an MoE block of
``num_experts`` experts with softmax top-``top_k`` routing renormalised over the k picked experts.
Everything but the FFNs (attention, norms, embedding, head) is the dense checkpoint's, unchanged.

``granularity`` G = 1: each expert is a copy of the block's SwiGLU (``w1``/``w3``/``w2``, in our
``[E, D, F]`` layout). The router starts from its own initialisation (``init_std``): whatever it
picks, the k weights sum to 1 and the k experts are the same function, so step 0's output is the
dense model's (to fp32 rounding of the weighted sum); the experts drift apart as they see different
tokens, and then the router has something to learn.

G > 1, the granular split (fine-grained upcycling: He et al. 2024, "Upcycling Large Language Models
into Mixture of Experts", Megatron-Core's ``upcycling_utils``): the dense hidden width F is cut
into G slices of F/G (slice i: rows ``i F/G .. (i+1) F/G`` of ``gate_proj``/``up_proj``, the same
columns of ``down_proj``), and SwiGLU is a sum over its hidden units, so the G slice outputs add up
to the dense FFN exactly. There are C = E/G copies of the G slices; expert ``e = c G + i`` is slice
``i`` of copy ``c`` (each expert of width F/G). Routing (Megatron-Core's "virtual groups"): the
router's row of expert ``c G + i`` is row ``c`` of its initial weight, for every i, so a token's G
logits of one copy are equal and its top-``top_k`` (``top_k = G k'``) takes every slice of its k'
best copies: softmax over the E, the G k' kept weights renormalised to sum to 1, so copy c's slices
each weigh ``p_c / (G sum_kept p)`` and each slice's total over the kept copies is 1/G; the
``route_scale = G`` makes that 1, and step 0 is the dense FFN (to fp32 rounding: the F-sum cut into
G partial sums, the weights' softmax). What is exact is the function at step 0, for any router
values with this tying but those where two copies' logits tie (measure zero; top-k could then split
a copy); nothing keeps the tie afterwards, and a token may then take slices of different copies.
Megatron-Core folds the scale into the expert weights instead (each of the three by ``G^(1/3)``,
exact only for a homogeneous activation; SiLU is not), so the experts here are the dense slices bit
for bit and the scale is the router's; Mixtral and Qwen3-MoE carry no routing scale, so such a model
does not export to them (``moe.hf.export_model`` names ``moe.route_scale``).
"""

from __future__ import annotations

import dataclasses
import re

import torch

from ..config import MoEConfig
from ..model import Transformer, TransformerConfig
from .arch import architecture

_FFN = re.compile(r"blocks\.(\d+)\.ffn\.(w[123])\.weight")

# the routing under which copies (or slices) of one FFN compute the dense FFN: the k weights sum to
# 1 (``route_scale``: the granularity, set by ``upcycled_config``)
UPCYCLE_ROUTING = dict(
    activation="swiglu",
    router="token_choice",
    score_func="softmax",
    softmax_before_topk=True,
    normalize_topk=True,
    num_shared_experts=0,
    expert_bias=False,
)


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"model.upcycle.{name}={value!r} is invalid: expected a positive integer")


def _check_granular(d_ff: int, num_experts: int, top_k: int, granularity: int) -> None:
    """The split's three conditions, each refusal naming the value and what would be valid."""
    G = granularity
    if d_ff % G:
        divisors = [g for g in range(1, min(d_ff, 64) + 1) if d_ff % g == 0]
        raise ValueError(
            f"model.upcycle.granularity={G} is invalid: the dense FFN's width d_ff={d_ff} (intermediate_size) "
            f"does not split into {G} equal slices; expected a divisor of {d_ff} (e.g. {divisors})"
        )
    if num_experts % G:
        raise ValueError(
            f"model.upcycle.num_experts={num_experts} is invalid with model.upcycle.granularity={G}: expected a "
            f"multiple of {G} (copies x {G} slices of the dense FFN), e.g. {G * max(1, num_experts // G)} or "
            f"{G * (num_experts // G + 1)}"
        )
    if top_k % G:
        raise ValueError(
            f"model.upcycle.top_k={top_k} is invalid with model.upcycle.granularity={G}: expected a multiple of "
            f"{G} up to model.upcycle.num_experts={num_experts} (a token takes all {G} slices of each copy it "
            f"picks), e.g. {G}"
        )


def upcycled_config(
    dense: TransformerConfig, num_experts: int, top_k: int, granularity: int = 1, **moe_kw
) -> TransformerConfig:
    """The MoE config of ``dense`` upcycled: every block MoE, ``num_experts`` experts of width
    ``d_ff / granularity``, top-``top_k``, ``route_scale=granularity`` (``moe_kw``: training-time
    MoEConfig fields; a capacity is refused, since dropped tokens would not compute the dense
    model). Every value is checked here, before a model exists."""
    if dense.moe_every != 0 or dense.moe is not None:
        raise ValueError(
            "model.upcycle.num_experts: the checkpoint is already an MoE model; upcycling starts from a dense one"
        )
    if moe_kw.get("capacity_factor") is not None:
        raise ValueError(
            f"moe.capacity_factor={moe_kw['capacity_factor']!r}: an upcycled model starts as the dense one only "
            "dropless (a dropped token would skip its FFN); set moe.capacity_factor=null"
        )
    for name, value in (("num_experts", num_experts), ("top_k", top_k), ("granularity", granularity)):
        _positive_int(name, value)
    if top_k > num_experts:
        raise ValueError(f"model.upcycle.top_k={top_k} is invalid: at most model.upcycle.num_experts={num_experts}")
    _check_granular(dense.d_ff, num_experts, top_k, granularity)
    moe = MoEConfig(
        d_model=dense.d_model,
        d_ff=dense.d_ff // granularity,
        num_experts=num_experts,
        top_k=top_k,
        route_scale=float(granularity),
        **UPCYCLE_ROUTING,
        **moe_kw,
    )
    return dataclasses.replace(dense, moe_every=1, first_k_dense=0, dense_layers=None, moe=moe)


def granularity_of(dense: TransformerConfig, moe: TransformerConfig) -> int:
    """G of an upcycled config: the dense width over the expert width."""
    return dense.d_ff // moe.moe.d_ff


@torch.no_grad()
def tie_router(weight: torch.Tensor, granularity: int) -> torch.Tensor:
    """The router of the split, in place: expert ``c G + i``'s row is row ``c`` of ``weight`` (the
    first E/G rows of its initialisation, Megatron-Core's), so a copy's G slices score alike."""
    if granularity > 1:
        E = weight.shape[0]
        weight.copy_(weight[: E // granularity].repeat_interleave(granularity, dim=0).clone())
    return weight


@torch.no_grad()
def load_upcycled(model: Transformer, adapter, hf_cfg, files, layers: set[int] | None = None) -> Transformer:
    """Fill ``model`` (of ``upcycled_config``) from a dense checkpoint (``adapter``'s family,
    ``files`` its tensors): the dense tensors as they are, each block's FFN (granularity 1) or its
    slice ``e % G`` (G > 1) copied into every expert ``e`` this rank holds; the routers keep their
    initial weights, tied per copy (``tie_router``) when G > 1. ``layers``: only those pipeline
    layers."""
    dense_cfg = adapter.transformer_config(hf_cfg, max_seq_len=model.cfg.max_seq_len)
    G = granularity_of(dense_cfg, model.cfg)
    want = upcycled_config(dense_cfg, model.cfg.moe.num_experts, model.cfg.moe.top_k, G)
    if architecture(model.cfg) != architecture(want):
        raise ValueError(f"the model's config is not the checkpoint's upcycled one: {want}")
    dense = adapter.read(files, dense_cfg, 0, 0, layers)
    own = model.state_dict()
    experts = model.moe_layers()[0].experts
    X, offset, Fs = experts.num_local, experts.expert_offset, want.moe.d_ff
    for name, t in dense.items():
        ffn = _FFN.fullmatch(name)
        if ffn is None:
            own[name].copy_(t)
            continue
        # nn.Linear's [F, D] (w1, w3) or [D, F] (w2), transposed to ours, sliced along F per expert
        ours, F_dim = t.t(), 0 if ffn[2] == "w2" else 1
        dst = own[f"blocks.{ffn[1]}.ffn.experts.{ffn[2]}"]
        for x in range(X):
            dst[x].copy_(ours.narrow(F_dim, ((offset + x) % G) * Fs, Fs))
    for layer in model.moe_layers():
        tie_router(layer.router.weight, G)
    return model
