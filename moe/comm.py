"""Collectives the MoE layer needs, each a no-op for ``group=None`` (one process).

The All-to-All is an autograd function whose backward is the same exchange with the split sizes
swapped (STYLE.md 4).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def gather_rows(t: torch.Tensor, group) -> tuple[torch.Tensor, int]:
    """Concatenate every rank's rows in rank order (sizes may differ); also returns where this
    rank's rows start. Not differentiable: used for routing decisions, not values."""
    if group_size(group) == 1:
        return t, 0
    n = group_size(group)
    sizes = torch.zeros(n, dtype=torch.long, device=t.device)
    sizes[group_rank(group)] = t.shape[0]
    dist.all_reduce(sizes, group=group)
    sizes_l = sizes.tolist()
    pad = max(sizes_l)
    buf = t.new_zeros((pad,) + tuple(t.shape[1:]))
    buf[: t.shape[0]] = t
    out = t.new_empty((n * pad,) + tuple(t.shape[1:]))
    _all_gather(out, buf.contiguous(), group)
    parts = [out[i * pad : i * pad + s] for i, s in enumerate(sizes_l)]
    start = sum(sizes_l[: group_rank(group)])
    return torch.cat(parts), start


def _all_gather(out, t, group):
    # all_gather_single replaces all_gather_into_tensor in newer torch; keep both working
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, t, group=group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.group = group
        ctx.output_splits = output_splits
        ctx.input_splits = input_splits
        x = x.contiguous()
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = grad.new_empty((sum(ctx.input_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad, ctx.input_splits, ctx.output_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Rows ``x[sum(input_splits[:r]) : ...]`` go to rank r; returns the rows received, by source rank."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group)
