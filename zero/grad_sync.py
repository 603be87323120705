"""Gradient reduction and clipping for data + expert parallelism without sharding (ZeRO stage 0).

The rule that makes every layout train like one process on the global batch (each rank's loss is
the mean over its own micro-batch, all micro-batches the same size):
- dense gradients are averaged over ``dp``;
- an expert's gradient already sums every rank of its ep group (the All-to-All backward brings it
  home), so it is summed over its ``edp`` replicas and divided by ``dp`` (not by edp: that is the
  classic "expert gradients ep-times too large" bug).
The clipping norm counts each parameter once: dense gradients are identical on every dp rank after
the reduction, expert gradients differ across an ep group and are summed over it; pipeline stages
hold disjoint parameters and are summed over pp.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from routing_kernels.runtime import is_expert_param

from .layout import Layout


def _params(model_or_params):
    if isinstance(model_or_params, torch.nn.Module):
        return [p for p in model_or_params.parameters() if p.requires_grad]
    return [p for p in model_or_params if p.requires_grad]


def split_params(model_or_params):
    """(dense, expert) parameter lists, in a stable order."""
    params = _params(model_or_params)
    return [p for p in params if not is_expert_param(p)], [p for p in params if is_expert_param(p)]


def _all_reduce_flat(grads: list[torch.Tensor], group, divide_by: int) -> None:
    # one collective per dtype instead of one per parameter
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = _flatten_dense_tensors(same)
        if group is not None:
            dist.all_reduce(flat, group=group)
        if divide_by != 1:
            flat.div_(divide_by)
        for g, synced in zip(same, _unflatten_dense_tensors(flat, same)):
            g.copy_(synced)


@torch.no_grad()
def sync_gradients(model_or_params, layout: Layout | None) -> None:
    """Reduce gradients in place so each rank holds what one process would on the global batch."""
    if layout is None or layout.dp == 1:
        return
    dense, expert = split_params(model_or_params)
    for p in dense + expert:
        if p.grad is None:  # a parameter unused this step still takes part in the collective
            p.grad = torch.zeros_like(p)
    _all_reduce_flat([p.grad for p in dense], layout.dp_group, layout.dp)
    _all_reduce_flat([p.grad for p in expert], layout.edp_group, layout.dp)


@torch.no_grad()
def grad_norm(model_or_params, layout: Layout | None, norm_type: float = 2.0) -> torch.Tensor:
    """Global 2-norm of the (already reduced) gradients, each parameter counted once."""
    if norm_type != 2.0:
        raise ValueError(f"norm_type={norm_type} is not supported; only the 2-norm is")
    dense, expert = split_params(model_or_params)
    device = (dense + expert)[0].device if dense + expert else torch.device("cpu")
    zero = torch.zeros((), device=device)
    sq_dense = sum((p.grad.float().square().sum() for p in dense if p.grad is not None), zero)
    sq_expert = sum((p.grad.float().square().sum() for p in expert if p.grad is not None), zero.clone())
    if layout is not None:
        if layout.ep_group is not None:
            dist.all_reduce(sq_expert, group=layout.ep_group)
        total = sq_dense + sq_expert
        if layout.pp_group is not None:
            dist.all_reduce(total, group=layout.pp_group)
    else:
        total = sq_dense + sq_expert
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm_(model_or_params, max_norm: float, layout: Layout | None) -> torch.Tensor:
    """Like ``torch.nn.utils.clip_grad_norm_`` but over the whole layout; returns the norm before clipping."""
    total = grad_norm(model_or_params, layout)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in _params(model_or_params):
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))
    return total
