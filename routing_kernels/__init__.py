"""Token-routing kernels: Triton on CUDA, pure-torch references everywhere else.

Import the ops from here; ``routing_kernels.dispatch`` decides which implementation runs.
"""
from .dispatch import (
    fused_adamw,
    get_backend,
    permute,
    routing_metadata,
    set_backend,
    unpermute_combine,
    use_backend,
)
from .optim import FusedAdamW
from .reference import source_tokens

__all__ = [
    "routing_metadata",
    "permute",
    "unpermute_combine",
    "fused_adamw",
    "FusedAdamW",
    "source_tokens",
    "get_backend",
    "set_backend",
    "use_backend",
]
