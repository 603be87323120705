"""Parallel layout and process groups, gradient reduction and clipping, ZeRO sharding."""
from .engine import ZeroEngine, default_blocks
from .flat import ParamSlice
from .grad_sync import clip_grad_norm_, grad_norm, split_params, sync_gradients
from .layout import Layout, check_same_on_all_ranks, init_distributed, validate_layout

__all__ = [
    "Layout", "validate_layout", "init_distributed", "check_same_on_all_ranks",
    "sync_gradients", "clip_grad_norm_", "grad_norm", "split_params",
    "ZeroEngine", "default_blocks", "ParamSlice", "predict_memory", "measure_memory", "count_params",
]


def __getattr__(name):
    # lazily, so ``python -m zero.memory`` does not import its own module twice
    if name in ("predict_memory", "measure_memory", "count_params"):
        from . import memory

        return getattr(memory, name)
    raise AttributeError(f"module 'zero' has no attribute {name!r}")
