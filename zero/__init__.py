"""Parallel layout and process groups; ``ZeroEngine``: data parallelism for every ZeRO stage, 0 (plain
replicated data parallelism) to 3, with gradient reduction, clipping and any elementwise optimizer;
``zero.pipeline``: pipeline stages on torch.distributed.pipelining, composed with the engine."""

from .admission import check_elementwise
from .engine import ZeroEngine
from .flat import ParamSlice
from .layout import (
    EP_DISPATCH,
    Layout,
    check_same_on_all_ranks,
    init_distributed,
    join_process_group,
    slurm_environment,
    validate_ep_dispatch,
    validate_layout,
    validate_node_size,
)
from .units import default_blocks

__all__ = [
    "Layout",
    "validate_layout",
    "validate_node_size",
    "validate_ep_dispatch",
    "EP_DISPATCH",
    "init_distributed",
    "slurm_environment",
    "join_process_group",
    "check_same_on_all_ranks",
    "ZeroEngine",
    "default_blocks",
    "check_elementwise",
    "ParamSlice",
    "predict_memory",
    "measure_memory",
    "count_params",
]


def __getattr__(name):
    # lazily, so ``python -m zero.memory`` does not import its own module twice
    if name in ("predict_memory", "measure_memory", "count_params"):
        from . import memory

        return getattr(memory, name)
    raise AttributeError(f"module 'zero' has no attribute {name!r}")
