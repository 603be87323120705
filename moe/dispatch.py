"""Dispatchers: move token rows to their experts and the results back.

Legend: T tokens, K slots, D model dim, E global experts, L local experts (E / ep), R ranks in the
expert-parallel group, S rows in expert order.

Local: metadata -> permute into expert order -> grouped experts -> unpermute and combine.
All-to-All: the same, with an exchange of counts and of rows between permute and the experts, and
the reverse exchange before the combine. Rows are never padded to a capacity: split sizes are the
real counts, so a dropless layer moves only the rows it routes.
"""
from __future__ import annotations

import torch

import routing_kernels as rk

from .comm import all_to_all, group_rank, group_size
from .experts import GroupedExperts


class LocalDispatcher:
    """All experts live in this process.

    ``fused``: run permute, experts and combine as one pass per row block
    (``GroupedExperts.forward_tokens``), which never builds the expert-ordered [S, D] buffers; the
    default (None) does so on the CPU unless the Triton backend is forced, and uses the separate
    kernels (``routing_kernels``) on CUDA.
    """

    def __init__(self, fused: bool | None = None):
        self.fused = fused

    def __call__(self, x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, weights_TK: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        counts_E, offsets_E1, dest_TK = rk.routing_metadata(expert_ids_TK, experts.num_local)
        counts = counts_E.tolist()
        fused = self.fused
        if fused is None:
            fused = x_TD.device.type == "cpu" and rk.get_backend() != "triton"
        if fused:
            return experts.forward_tokens(x_TD, dest_TK, weights_TK, counts)
        x_SD = rk.permute(x_TD, dest_TK, sum(counts))
        y_SD = experts(x_SD, counts)
        return rk.unpermute_combine(y_SD, dest_TK, weights_TK.to(y_SD.dtype))


def _chunk_order(counts_RL: torch.Tensor, by_rank_first: bool) -> torch.Tensor:
    """Row permutation between [rank][local expert] and [local expert][rank] chunk orders.

    ``counts_RL[r, l]`` is the number of rows of chunk (r, l). Returns, for each row of the target
    order, its index in the source order; the inverse direction passes ``by_rank_first=False``.
    """
    R, L = counts_RL.shape
    src_counts = counts_RL if by_rank_first else counts_RL.t()
    src_starts = (torch.cumsum(src_counts.reshape(-1), 0) - src_counts.reshape(-1)).view_as(src_counts)
    # target order visits chunks with the other index outermost
    tgt_counts = src_counts.t().reshape(-1)
    tgt_starts = src_starts.t().reshape(-1)
    total = int(tgt_counts.sum())
    chunk_of_row = torch.repeat_interleave(torch.arange(tgt_counts.numel(), device=counts_RL.device), tgt_counts)
    first_row_of_chunk = torch.cumsum(tgt_counts, 0) - tgt_counts
    within = torch.arange(total, device=counts_RL.device) - first_row_of_chunk[chunk_of_row]
    return tgt_starts[chunk_of_row] + within


class _Gather(torch.autograd.Function):
    # a row permutation; its backward is the inverse permutation
    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        out = torch.empty_like(grad)
        out[index] = grad
        return out, None


class AllToAllDispatcher:
    """Experts split evenly over the ranks of ``ep_group``; rank r owns experts [r*L, (r+1)*L)."""

    def __init__(self, ep_group):
        self.group = ep_group

    def __call__(self, x_TD, expert_ids_TK, weights_TK, experts: GroupedExperts):
        R = group_size(self.group)
        L = experts.num_local
        E = L * R
        if experts.num_global != E or experts.expert_offset != group_rank(self.group) * L:
            raise ValueError(f"experts hold [{experts.expert_offset}, +{L}) of {experts.num_global}; expected rank {group_rank(self.group)} of {R} to hold [{group_rank(self.group) * L}, +{L}) of {E}")
        counts_E, _, dest_TK = rk.routing_metadata(expert_ids_TK, E)
        # 1. exchange counts: recv_RL[r, l] = rows rank r sends to my local expert l
        send_RL = counts_E.view(R, L)
        recv_RL = torch.empty_like(send_RL)
        torch.distributed.all_to_all_single(recv_RL, send_RL.contiguous(), group=self.group)
        send_splits = send_RL.sum(1).tolist()
        recv_splits = recv_RL.sum(1).tolist()
        # 2. rows in global-expert order are already grouped by destination rank
        x_SD = rk.permute(x_TD, dest_TK, sum(send_splits))
        x_recv = all_to_all(x_SD, recv_splits, send_splits, self.group)
        # 3. [source rank][local expert] -> [local expert][source rank]; within an expert the rows
        # then follow global token order, as in the single-process layer
        to_expert_order = _chunk_order(recv_RL, by_rank_first=True)
        x_local = _Gather.apply(x_recv, to_expert_order)
        y_local = experts(x_local, recv_RL.sum(0).tolist())
        y_recv = _Gather.apply(y_local, _chunk_order(recv_RL, by_rank_first=False))
        y_SD = all_to_all(y_recv, send_splits, recv_splits, self.group)
        return rk.unpermute_combine(y_SD, dest_TK, weights_TK.to(y_SD.dtype))
