"""The compute ops of an MoE layer and their backends: routing metadata, token permutation,
unpermute-and-combine, the grouped expert FFN and fused AdamW; Triton kernels and device-specific
paths beside the pure-torch references.

Import the ops from here; ``routing_kernels.dispatch`` decides which implementation runs.
``routing_kernels.runtime`` holds what ``moe`` and ``zero`` both need (collectives over optional
groups, the expert-parameter mark).
"""

from .dispatch import (
    expert_backend,
    expert_ffn,
    fused_adamw,
    get_backend,
    get_expert_backend,
    permute,
    routing_metadata,
    set_backend,
    set_expert_backend,
    unpermute_combine,
    use_backend,
    use_expert_backend,
)
from .optim import FusedAdamW
from .reference import source_tokens

__all__ = [
    "routing_metadata",
    "permute",
    "unpermute_combine",
    "expert_ffn",
    "expert_backend",
    "fused_adamw",
    "FusedAdamW",
    "source_tokens",
    "get_backend",
    "set_backend",
    "use_backend",
    "get_expert_backend",
    "set_expert_backend",
    "use_expert_backend",
]
