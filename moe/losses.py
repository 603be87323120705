"""Router auxiliary losses.

Shapes follow the project's legend (docs/design.md): T tokens, K routing slots, E experts,
B sequences, L tokens per sequence.

Global-batch balancing: with a data-parallel group, ``f_e`` (fraction of assignments) and the
reported value use the whole batch, while the differentiable term uses the local mean of the
router probabilities. Each rank's gradient is then the global-batch gradient times dp, which the
usual averaging over dp turns into exactly the single-process gradient (Megatron-Core does the same).
"""

from __future__ import annotations

import torch


def load_balancing_loss(probs_TE: torch.Tensor, counts_E: torch.Tensor, top_k: int, num_tokens: int) -> torch.Tensor:
    """Switch/GShard ``E * sum_e f_e * P_e``.

    ``counts_E`` are the assignments per expert over ``num_tokens`` tokens (both global under data
    parallelism), ``f_e = counts_e / (K * num_tokens)``; ``P_e`` is the mean of ``probs_TE`` over its
    rows. Equals 1 when routing is uniform.
    """
    E = probs_TE.shape[-1]
    f_E = counts_E.to(probs_TE.dtype) / (top_k * num_tokens)
    P_E = probs_TE.mean(0)
    return E * torch.dot(f_E, P_E)


def sequence_load_balancing_loss(probs_BLE: torch.Tensor, expert_ids_BLK: torch.Tensor) -> torch.Tensor:
    """The balancing loss computed within each sequence, then averaged over sequences (DeepSeek-V3)."""
    B, L, E = probs_BLE.shape
    K = expert_ids_BLK.shape[-1]
    one_hot_BE = torch.zeros(B, E, dtype=probs_BLE.dtype, device=probs_BLE.device)
    one_hot_BE.scatter_add_(
        1, expert_ids_BLK.reshape(B, L * K), torch.ones(B, L * K, dtype=probs_BLE.dtype, device=probs_BLE.device)
    )
    f_BE = one_hot_BE / (K * L)
    P_BE = probs_BLE.mean(1)
    return E * (f_BE * P_BE).sum(-1).mean()


def router_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE's ``mean(logsumexp(logits)^2)``: keeps router logits small."""
    if logits_TE.shape[0] == 0:
        return logits_TE.sum() * 0.0
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


def routing_entropy(probs_TE: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of the entropy (nats) of each token's distribution over experts."""
    if probs_TE.shape[0] == 0:
        return probs_TE.sum() * 0.0
    p = probs_TE.clamp_min(1e-20)
    return -(probs_TE * p.log()).sum(-1).mean()
