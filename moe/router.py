"""Routers: which experts each token goes to, and with what weight.

Shapes follow the project's legend (docs/design.md): T tokens, K routing slots, E experts, G expert
groups.

The router always computes in fp32 (its softmax is where bf16 hurts). Its output is a ``Routing``
whose ``expert_ids_TK`` is -1 for an assignment dropped at capacity (or, for expert choice, a slot
no expert took); every downstream op skips those.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn as nn
import torch.nn.functional as nnf

from routing_kernels.runtime import gather_rows

from .config import MoEConfig


@dataclass
class Routing:
    expert_ids_TK: torch.Tensor  # long, -1 where dropped
    weights_TK: torch.Tensor  # fp32 combine weights, 0 where dropped (differentiable)
    logits_TE: torch.Tensor  # fp32 router logits
    probs_TE: torch.Tensor  # per-token distribution over experts (softmax, or normalised sigmoid)
    selected_TK: torch.Tensor  # experts chosen before capacity (token choice), for load statistics
    num_dropped: torch.Tensor  # assignments dropped at capacity (local, long scalar)
    # a bound on the kept assignments known from shapes alone (T*K dropless; at most E*cap under a
    # capacity), so the rows in expert order have a static size: no host read of the counts
    max_kept: int = -1

    def __post_init__(self):
        if self.max_kept < 0:
            self.max_kept = self.expert_ids_TK.numel()


def capacity(capacity_factor: float, top_k: int, num_tokens: int, num_experts: int) -> int:
    """Assignments each expert accepts: ``ceil(cf * k * T / E)``, computed exactly.

    ``cf`` is taken as the decimal it was written as (``str(float(cf))``: the shortest decimal that
    gives back the same float, e.g. 1.1), and the product and the ceiling are exact rational
    arithmetic. In floats, 1.1 * 1 * 50 / 5 is 11.000000000000002 (1.1 is stored a little above
    11/10) and the ceiling gave 12; the float's exact binary value (``Fraction(1.1)``) has the same
    excess, so only the written decimal gives 11."""
    q = Fraction(str(float(capacity_factor))) * top_k * num_tokens / num_experts
    return -(-q.numerator // q.denominator)


def capacity_keep_mask(
    expert_ids_TK: torch.Tensor, weights_TK: torch.Tensor, num_experts: int, cap: int, policy: str
) -> torch.Tensor:
    """Which assignments an expert of capacity ``cap`` keeps.

    ``position``: the first ``cap`` in token order. ``probs``: the ``cap`` with the largest weight,
    ties broken by token order. Computed on the whole batch of the expert-parallel group so that
    every layout keeps the same set.
    """
    flat_ids = expert_ids_TK.reshape(-1)
    A = flat_ids.numel()
    if policy == "position":
        order = torch.argsort(flat_ids, stable=True)
    else:
        by_weight = torch.argsort(-weights_TK.reshape(-1).detach(), stable=True)
        order = by_weight[torch.argsort(flat_ids[by_weight], stable=True)]
    # a scatter-add, not bincount: its output size is known from the shapes (torch.compile)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat_ids.device).scatter_add_(
        0, flat_ids, torch.ones_like(flat_ids)
    )
    starts = torch.cumsum(counts, 0) - counts
    rank_sorted = torch.arange(A, device=flat_ids.device) - starts[flat_ids[order]]
    # rank[order] = rank_sorted as a gather by the inverse permutation: no write into an empty tensor
    # under torch.compile (routing_kernels.reference.routing_metadata)
    rank = rank_sorted[torch.argsort(order)]
    return (rank < cap).view_as(expert_ids_TK)


class Router(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.d_model))
        # selection-only bias of aux-loss-free balancing; a buffer so checkpoints carry it
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts), persistent=True)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.weight, std=self.cfg.d_model**-0.5)

    def forward(self, x_TD: torch.Tensor, group=None) -> Routing:
        """``group``: the processes whose tokens form the batch that capacity and expert choice
        decide over (the data-parallel group); None is this process's tokens."""
        logits_TE = nnf.linear(x_TD.float(), self.weight.float())
        if self.cfg.router == "expert_choice":
            return self._expert_choice(logits_TE, group)
        return self._token_choice(logits_TE, group)

    def _token_choice(self, logits_TE, group) -> Routing:
        cfg = self.cfg
        E, K = cfg.num_experts, cfg.top_k
        if cfg.score_func == "sigmoid":
            scores_TE = torch.sigmoid(logits_TE)
            probs_TE = scores_TE / scores_TE.sum(-1, keepdim=True)
        else:
            scores_TE = probs_TE = torch.softmax(logits_TE, dim=-1)
        select_TE = scores_TE if cfg.softmax_before_topk else logits_TE
        select_TE = select_TE.detach()
        if cfg.expert_bias:
            select_TE = select_TE + self.expert_bias
        if cfg.num_groups is not None:
            select_TE = self._limit_groups(select_TE)
        ids_TK = torch.topk(select_TE, K, dim=-1, sorted=True).indices
        if cfg.softmax_before_topk:
            weights_TK = scores_TE.gather(1, ids_TK)
            if cfg.normalize_topk:
                weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
        else:
            weights_TK = torch.softmax(logits_TE.gather(1, ids_TK), dim=-1)
        if cfg.route_scale != 1.0:
            weights_TK = weights_TK * cfg.route_scale

        selected_TK = ids_TK
        num_dropped = torch.zeros((), dtype=torch.long, device=ids_TK.device)
        max_kept = ids_TK.numel()
        if cfg.capacity_factor is not None:
            all_ids, start = gather_rows(ids_TK, group)
            all_w, _ = gather_rows(weights_TK.detach(), group)
            cap = capacity(cfg.capacity_factor, K, all_ids.shape[0], E)
            keep_TK = capacity_keep_mask(all_ids, all_w, E, cap, cfg.drop_policy)[start : start + ids_TK.shape[0]]
            num_dropped = (~keep_TK).sum()
            ids_TK = torch.where(keep_TK, ids_TK, torch.full_like(ids_TK, -1))
            weights_TK = weights_TK * keep_TK
            max_kept = min(max_kept, E * cap)
        return Routing(ids_TK, weights_TK, logits_TE, probs_TE, selected_TK, num_dropped, max_kept)

    def _limit_groups(self, select_TE):
        # DeepSeek-V3: a group's score is the sum of its top-2 experts; keep topk_groups groups
        cfg = self.cfg
        T, E = select_TE.shape
        G = cfg.num_groups
        per_group = select_TE.view(T, G, E // G)
        group_score_TG = per_group.topk(min(2, E // G), dim=-1).values.sum(-1)
        top_groups = group_score_TG.topk(cfg.topk_groups, dim=-1).indices
        keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter_(1, top_groups, True)
        return select_TE.masked_fill(~keep_TG.repeat_interleave(E // G, dim=1), float("-inf"))

    def _expert_choice(self, logits_TE, group) -> Routing:
        # each expert takes its top-Q tokens (Q: its capacity) over the whole data-parallel batch; this looks at
        # every token of the batch, so it is not causal (unfit for autoregressive decoding)
        cfg = self.cfg
        E = cfg.num_experts
        probs_TE = torch.softmax(logits_TE, dim=-1)
        all_probs, start = gather_rows(probs_TE.detach(), group)
        T_all = all_probs.shape[0]
        cap = min(capacity(cfg.capacity_or_default, cfg.top_k, T_all, E), T_all)
        chosen_all = torch.zeros_like(all_probs, dtype=torch.bool)
        if cap > 0:
            top_QE = all_probs.topk(cap, dim=0).indices
            chosen_all.scatter_(0, top_QE, True)
        chosen_TE = chosen_all[start : start + probs_TE.shape[0]]
        arange_E = torch.arange(E, device=logits_TE.device).expand_as(chosen_TE)
        ids_TE = torch.where(chosen_TE, arange_E, torch.full_like(arange_E, -1))
        weights_TE = probs_TE * chosen_TE * cfg.route_scale
        num_dropped = torch.zeros((), dtype=torch.long, device=logits_TE.device)
        return Routing(ids_TE, weights_TE, logits_TE, probs_TE, ids_TE, num_dropped, min(ids_TE.numel(), E * cap))

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor, rate: float) -> None:
        """Aux-loss-free step: ``b_e += rate * sign(mean load - load_e)``."""
        load = load_E.float()
        self.expert_bias.add_(rate * torch.sign(load.mean() - load))
