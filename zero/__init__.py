"""Parallel layout and process groups, gradient reduction and clipping, ZeRO sharding."""
from .engine import ZeroEngine, default_blocks
from .flat import ParamSlice
from .grad_sync import clip_grad_norm_, grad_norm, split_params, sync_gradients
from .layout import Layout, check_same_on_all_ranks, init_distributed, validate_layout
from .memory import count_params, measure_memory, predict_memory

__all__ = [
    "Layout", "validate_layout", "init_distributed", "check_same_on_all_ranks",
    "sync_gradients", "clip_grad_norm_", "grad_norm", "split_params",
    "ZeroEngine", "default_blocks", "ParamSlice", "predict_memory", "measure_memory", "count_params",
]
