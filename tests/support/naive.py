"""Deliberately naive references for the MoE layer: Python loops over tokens and their experts.

Nothing here is vectorised or shares code with ``moe/``: each routing rule is written the way a
paper states it (sort this token's scores, take the top k, ...) and each expert is plain torch
ops on one token row. Slow on purpose; the tests keep shapes small.

Shapes follow the project's legend (docs/design.md).
"""

from __future__ import annotations

import math

import torch


def silu(h):
    return h * torch.sigmoid(h)


def gelu(h):
    # exact (erf) GELU, F.gelu's default
    return 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))


def expert_ffn(x_D, w1_DF, w3_DF, w2_FD, activation: str):
    """One expert on one token row."""
    if activation == "swiglu":
        return (silu(x_D @ w1_DF) * (x_D @ w3_DF)) @ w2_FD
    return gelu(x_D @ w1_DF) @ w2_FD


def naive_params(layer, dtype=torch.float64) -> dict:
    """Leaf copies of the layer's parameters (in ``dtype``) so the reference owns its gradients.

    Keys follow ``layer.named_parameters()``; nn.Linear weights of the shared expert are
    transposed into the [in, out] layout the loops use.
    """
    out = {}
    for name, p in layer.named_parameters():
        out[name] = p.detach().to(dtype).clone().requires_grad_(True)
    return out


def naive_token_choice(cfg, logits_E: torch.Tensor, bias_E: torch.Tensor | None = None):
    """One token's routing: ``(expert ids, combine weights)`` as Python lists / a tensor of K.

    The weights stay differentiable functions of ``logits_E``; the choice itself is not.
    """
    E, K = cfg.num_experts, cfg.top_k
    if cfg.score_func == "sigmoid":
        scores = torch.sigmoid(logits_E)
    else:
        scores = torch.exp(logits_E - logits_E.max())
        scores = scores / scores.sum()
    if cfg.softmax_before_topk:
        select = [float(s) for s in scores.detach()]
    else:
        select = [float(v) for v in logits_E.detach()]
    if bias_E is not None:
        select = [s + float(b) for s, b in zip(select, bias_E)]
    allowed = list(range(E))
    if cfg.num_groups is not None:
        per = E // cfg.num_groups
        group_scores = []
        for g in range(cfg.num_groups):
            members = sorted((select[e] for e in range(g * per, (g + 1) * per)), reverse=True)
            group_scores.append((sum(members[: min(2, per)]), g))
        # highest group score first; on a tie the lower group index
        kept_groups = [g for _, g in sorted(group_scores, key=lambda sg: (-sg[0], sg[1]))[: cfg.topk_groups]]
        allowed = [e for e in range(E) if e // per in kept_groups]
    ranked = sorted(allowed, key=lambda e: (-select[e], e))
    ids = ranked[:K]
    if cfg.softmax_before_topk:
        w = torch.stack([scores[e] for e in ids])
        if cfg.normalize_topk:
            w = w / w.sum()
    else:
        chosen = torch.stack([logits_E[e] for e in ids])
        w = torch.exp(chosen - chosen.max())
        w = w / w.sum()
    return ids, w * cfg.route_scale


def naive_router(cfg, weight_ED: torch.Tensor, x_TD: torch.Tensor, bias_E=None):
    """Token-choice routing token by token: ``(ids_TK long, weights_TK)`` with weights
    differentiable in ``weight_ED`` and ``x_TD`` (no capacity)."""
    ids, ws = [], []
    for t in range(x_TD.shape[0]):
        logits_E = weight_ED @ x_TD[t]
        i, w = naive_token_choice(cfg, logits_E, bias_E)
        ids.append(i)
        ws.append(w)
    K = cfg.top_k
    if not ids:
        return torch.empty(0, K, dtype=torch.long), weight_ED.new_empty(0, K)
    return torch.tensor(ids, dtype=torch.long), torch.stack(ws)


def naive_weights_for(cfg, weight_ED, x_TD, ids_TK):
    """Combine weights of a *given* token-choice decision ``ids_TK`` (-1 = dropped), computed
    token by token from the router weight, so gradients reach ``weight_ED`` and ``x_TD``."""
    rows = []
    for t in range(x_TD.shape[0]):
        logits_E = weight_ED @ x_TD[t]
        if cfg.score_func == "sigmoid":
            scores = torch.sigmoid(logits_E)
        else:
            scores = torch.softmax(logits_E, dim=0)
        ids = [int(e) for e in ids_TK[t]]
        # weights are fixed before capacity drops anything: pass the pre-capacity selection here,
        # and the decision with -1 for dropped slots to naive_moe, which skips them
        if cfg.softmax_before_topk:
            w = torch.stack([scores[e] for e in ids])
            if cfg.normalize_topk:
                w = w / w.sum()
        else:
            w = torch.softmax(torch.stack([logits_E[e] for e in ids]), dim=0)
        rows.append(w * cfg.route_scale)
    return torch.stack(rows) if rows else weight_ED.new_empty(0, ids_TK.shape[1])


def naive_capacity_keep(cfg, ids_TK, weights_TK):
    """Which assignments survive capacity ``ceil(cf*k*T/E)``, expert by expert."""
    T, K = ids_TK.shape
    cap = math.ceil(cfg.capacity_factor * K * T / cfg.num_experts)
    keep = torch.zeros(T, K, dtype=torch.bool)
    for e in range(cfg.num_experts):
        slots = [(t, k) for t in range(T) for k in range(K) if int(ids_TK[t, k]) == e]
        if cfg.drop_policy == "probs":
            # largest weight first, earlier (t, k) first on a tie
            slots = sorted(slots, key=lambda tk: -float(weights_TK[tk[0], tk[1]]))
        for t, k in slots[:cap]:
            keep[t, k] = True
    return keep


def naive_expert_choice(cfg, probs_TE):
    """Each expert takes its top-C tokens by probability: ``chosen_TE`` bool."""
    T, E = probs_TE.shape
    cap = min(math.ceil(cfg.capacity_or_default * cfg.top_k * T / E), T)
    chosen = torch.zeros(T, E, dtype=torch.bool)
    for e in range(E):
        tokens = sorted(range(T), key=lambda t: -float(probs_TE[t, e]))
        for t in tokens[:cap]:
            chosen[t, e] = True
    return chosen


def naive_moe(cfg, params: dict, x_TD, ids_TK, weights_TK):
    """``out[t] = sum_k w[t,k] * expert_{ids[t,k]}(x[t]) (+ shared(x[t]))``, skipping ids < 0."""
    w1, w2 = params["experts.w1"], params["experts.w2"]
    w3 = params.get("experts.w3")
    rows = []
    for t in range(x_TD.shape[0]):
        acc = torch.zeros_like(x_TD[t])
        for k in range(ids_TK.shape[1]):
            e = int(ids_TK[t, k])
            if e < 0:
                continue
            acc = acc + weights_TK[t, k] * expert_ffn(
                x_TD[t], w1[e], None if w3 is None else w3[e], w2[e], cfg.activation
            )
        if "shared_experts.w1.weight" in params:
            sw3 = params.get("shared_experts.w3.weight")
            acc = acc + expert_ffn(
                x_TD[t],
                params["shared_experts.w1.weight"].t(),
                None if sw3 is None else sw3.t(),
                params["shared_experts.w2.weight"].t(),
                cfg.activation,
            )
        rows.append(acc)
    return torch.stack(rows) if rows else x_TD.clone()
