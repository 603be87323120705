"""Parallel layout and process groups, gradient reduction and clipping, ZeRO sharding."""
from .grad_sync import clip_grad_norm_, grad_norm, split_params, sync_gradients
from .layout import Layout, check_same_on_all_ranks, init_distributed, validate_layout

__all__ = [
    "Layout", "validate_layout", "init_distributed", "check_same_on_all_ranks",
    "sync_gradients", "clip_grad_norm_", "grad_norm", "split_params",
]
