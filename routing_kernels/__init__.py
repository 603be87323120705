"""The compute ops of an MoE layer and their backends: routing metadata, token permutation,
unpermute-and-combine, the grouped expert FFN and fused AdamW; Triton kernels and device-specific
paths beside the pure-torch references; the block-wise int8/int4 quantizer of ZeRO++'s communication.

Import the ops from here; ``routing_kernels.dispatch`` decides which implementation runs.
``routing_kernels.runtime`` holds what ``moe`` and ``zero`` both need (collectives over optional
groups, the expert-parameter mark).
"""

from .dispatch import (
    dequantize_blockwise,
    expert_backend,
    expert_ffn,
    fused_adamw,
    get_backend,
    get_expert_backend,
    permute,
    quantize_blockwise,
    routing_metadata,
    set_backend,
    set_expert_backend,
    unpermute_combine,
    use_backend,
    use_expert_backend,
)
from .optim import FusedAdamW
from .reference import pack_int4, source_tokens, unpack_int4

__all__ = [
    "routing_metadata",
    "permute",
    "unpermute_combine",
    "expert_ffn",
    "expert_backend",
    "fused_adamw",
    "FusedAdamW",
    "quantize_blockwise",
    "dequantize_blockwise",
    "pack_int4",
    "unpack_int4",
    "source_tokens",
    "get_backend",
    "set_backend",
    "use_backend",
    "get_expert_backend",
    "set_expert_backend",
    "use_expert_backend",
]
