"""Sparse upcycling: an MoE model started from a dense checkpoint (Komatsuzaki et al. 2022,
"Sparse Upcycling"; Megatron-Core's ``upcycling``). Every dense block becomes an MoE block of
``num_experts`` experts, each a copy of the block's SwiGLU (``w1``/``w3``/``w2``, in our
``[E, D, F]`` layout), with softmax top-``top_k`` routing renormalised over the k picked experts.
The router starts from its own initialisation (``init_std``): whatever it picks, the k weights sum
to 1 and the k experts are the same function, so step 0's output is the dense model's (to fp32
rounding of the weighted sum); the experts drift apart as they see different tokens, and then the
router has something to learn.

Everything but the FFNs (attention, norms, embedding, head) is the dense checkpoint's, unchanged.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from ..config import MoEConfig
from ..model import Transformer, TransformerConfig
from .arch import architecture

_FFN = re.compile(r"blocks\.(\d+)\.ffn\.(w[123])\.weight")

# the routing under which copies of one FFN compute the dense FFN: the k weights sum to 1
UPCYCLE_ROUTING = dict(
    activation="swiglu",
    router="token_choice",
    score_func="softmax",
    softmax_before_topk=True,
    normalize_topk=True,
    route_scale=1.0,
    num_shared_experts=0,
    expert_bias=False,
)


def upcycled_config(dense: TransformerConfig, num_experts: int, top_k: int, **moe_kw) -> TransformerConfig:
    """The MoE config of ``dense`` upcycled: every block MoE, ``num_experts`` experts of the dense
    width ``d_ff``, top-``top_k`` (``moe_kw``: training-time MoEConfig fields; a capacity is
    refused, since dropped tokens would not compute the dense model)."""
    if dense.moe_every != 0 or dense.moe is not None:
        raise ValueError(
            "model.upcycle.num_experts: the checkpoint is already an MoE model; upcycling starts from a dense one"
        )
    if moe_kw.get("capacity_factor") is not None:
        raise ValueError(
            f"moe.capacity_factor={moe_kw['capacity_factor']!r}: an upcycled model starts as the dense one only "
            "dropless (a dropped token would skip its FFN); set moe.capacity_factor=null"
        )
    for name, value in (("num_experts", num_experts), ("top_k", top_k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"model.upcycle.{name}={value!r} is invalid: expected a positive integer")
    if top_k > num_experts:
        raise ValueError(f"model.upcycle.top_k={top_k} is invalid: at most model.upcycle.num_experts={num_experts}")
    moe = MoEConfig(
        d_model=dense.d_model, d_ff=dense.d_ff, num_experts=num_experts, top_k=top_k, **UPCYCLE_ROUTING, **moe_kw
    )
    return dataclasses.replace(dense, moe_every=1, first_k_dense=0, dense_layers=None, moe=moe)


@torch.no_grad()
def load_upcycled(model: Transformer, adapter, hf_cfg, files, layers: set[int] | None = None) -> Transformer:
    """Fill ``model`` (of ``upcycled_config``) from a dense checkpoint (``adapter``'s family,
    ``files`` its tensors): the dense tensors as they are, each block's FFN copied into every expert
    this rank holds; the routers keep their initial weights. ``layers``: only those pipeline
    layers."""
    dense_cfg = adapter.transformer_config(hf_cfg, max_seq_len=model.cfg.max_seq_len)
    want = upcycled_config(dense_cfg, model.cfg.moe.num_experts, model.cfg.moe.top_k)
    if architecture(model.cfg) != architecture(want):
        raise ValueError(f"the model's config is not the checkpoint's upcycled one: {want}")
    dense = adapter.read(files, dense_cfg, 0, 0, layers)
    own = model.state_dict()
    X = model.moe_layers()[0].experts.num_local
    for name, t in dense.items():
        ffn = _FFN.fullmatch(name)
        if ffn is None:
            own[name].copy_(t)
        else:  # nn.Linear's [F, D] (w1, w3) or [D, F] (w2), transposed into each of this rank's experts
            own[f"blocks.{ffn[1]}.ffn.experts.{ffn[2]}"].copy_(t.t().expand(X, *t.t().shape))
    return model
