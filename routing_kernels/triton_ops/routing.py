"""Routing metadata: a histogram per block of assignments, a scan over blocks per expert, then
each assignment's destination row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import _check_device, _loop_bound

# ---------------------------------------------------------------------------------------------
# routing metadata: histogram per block -> scan over blocks per expert -> destination rows
# ---------------------------------------------------------------------------------------------


@triton.jit
def _block_histogram_kernel(ids_ptr, rank_ptr, counts_EU_ptr, A, E, NU, BLOCK_A: tl.constexpr, E_PAD: tl.constexpr):
    b = tl.program_id(0)
    a = b * BLOCK_A + tl.arange(0, BLOCK_A)
    in_range = a < A
    e = tl.load(ids_ptr + a, mask=in_range, other=-1).to(tl.int32)
    # ids >= E break the contract; treating them as dropped keeps every later access in bounds
    kept = (e >= 0) & (e < E)
    cols = tl.arange(0, E_PAD)
    # experts on the rows, assignments along the last axis, so the scan runs along the last axis
    onehot_EA = (cols[:, None] == e[None, :]) & kept[None, :]
    onehot_i = onehot_EA.to(tl.int32)
    tl.store(counts_EU_ptr + cols * NU + b, tl.sum(onehot_i, axis=1), mask=cols < E)
    # stable rank within the block: how many earlier assignments of this block chose the same expert
    before = tl.cumsum(onehot_i, axis=1) - onehot_i
    rank = tl.sum(tl.where(onehot_EA, before, 0), axis=0)
    tl.store(rank_ptr + a, tl.where(kept, rank, -1).to(tl.int64), mask=in_range)


@triton.jit
def _expert_scan_kernel(counts_EU_ptr, counts_E_ptr, NU, BLOCK_U: tl.constexpr):
    # one program per expert: exclusive scan of its per-block counts, in place, and its total
    e = tl.program_id(0)
    row_ptr = counts_EU_ptr + e.to(tl.int64) * NU
    carry = tl.sum(tl.zeros([BLOCK_U], dtype=tl.int32), axis=0)
    for start in range(0, _loop_bound(NU), BLOCK_U):
        bb = start + tl.arange(0, BLOCK_U)
        m = bb < NU
        c = tl.load(row_ptr + bb, mask=m, other=0)
        tl.store(row_ptr + bb, carry + tl.cumsum(c, axis=0) - c, mask=m)
        carry += tl.sum(c, axis=0)
    tl.store(counts_E_ptr + e, carry.to(tl.int64))


@triton.jit
def _dest_kernel(
    ids_ptr, dest_ptr, base_EU_ptr, counts_E_ptr, offsets_E1_ptr, A, E, NU, BLOCK_A: tl.constexpr, E_PAD: tl.constexpr
):
    b = tl.program_id(0)
    cols = tl.arange(0, E_PAD)
    cm = cols < E
    counts = tl.load(counts_E_ptr + cols, mask=cm, other=0)
    ends = tl.cumsum(counts, axis=0)
    if b == 0:
        # offsets_E1 = [0, ends...]
        tl.store(offsets_E1_ptr + 1 + cols, ends, mask=cm)
        tl.store(offsets_E1_ptr + cols, tl.zeros([E_PAD], dtype=tl.int64), mask=cols == 0)
    # first row of this block's share of each expert's segment
    start_E = (ends - counts) + tl.load(base_EU_ptr + cols * NU + b, mask=cm, other=0).to(tl.int64)
    a = b * BLOCK_A + tl.arange(0, BLOCK_A)
    in_range = a < A
    e = tl.load(ids_ptr + a, mask=in_range, other=-1).to(tl.int32)
    kept = (e >= 0) & (e < E)
    start = tl.sum(tl.where(cols[:, None] == e[None, :], start_E[:, None], 0), axis=0)
    rank = tl.load(dest_ptr + a, mask=in_range, other=0)
    tl.store(dest_ptr + a, tl.where(kept, start + rank, -1), mask=in_range)


def _routing_metadata_launch(expert_ids_TK: torch.Tensor, num_experts: int, block_a=None, block_b=None):
    if expert_ids_TK.dim() != 2:
        raise ValueError(f"expert_ids_TK must be [T, K], got shape {tuple(expert_ids_TK.shape)}")
    if expert_ids_TK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_ids_TK must be int32 or int64, got {expert_ids_TK.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    _check_device(expert_ids_TK)
    T, K = expert_ids_TK.shape
    A = T * K
    ids_A = expert_ids_TK.contiguous().view(-1)
    dev = ids_A.device
    E = num_experts
    E_PAD = triton.next_power_of_2(E)
    # the one-hot tile is E_PAD x BLOCK_A; 4k int32 lanes (32 per thread) stay in registers
    # (16k spilled on sm_90), and more blocks only lengthen the cheap per-expert scan
    BLOCK_A = block_a or max(16, min(1024, 4096 // E_PAD))
    NU = max(1, triton.cdiv(A, BLOCK_A))
    BLOCK_U = block_b or min(1024, triton.next_power_of_2(NU))
    dest_A = torch.empty(A, dtype=torch.int64, device=dev)
    counts_EU = torch.empty(E, NU, dtype=torch.int32, device=dev)
    counts_E = torch.empty(E, dtype=torch.int64, device=dev)
    offsets_E1 = torch.empty(E + 1, dtype=torch.int64, device=dev)
    _block_histogram_kernel[(NU,)](ids_A, dest_A, counts_EU, A, E, NU, BLOCK_A=BLOCK_A, E_PAD=E_PAD)
    _expert_scan_kernel[(E,)](counts_EU, counts_E, NU, BLOCK_U=BLOCK_U)
    _dest_kernel[(NU,)](ids_A, dest_A, counts_EU, counts_E, offsets_E1, A, E, NU, BLOCK_A=BLOCK_A, E_PAD=E_PAD)
    return counts_E, offsets_E1, dest_A.view(T, K)


def routing_metadata(expert_ids_TK: torch.Tensor, num_experts: int):
    """Same contract as ``reference.routing_metadata``; bit-identical output."""
    return _routing_metadata_launch(expert_ids_TK, num_experts)
