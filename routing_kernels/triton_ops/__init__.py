"""Triton kernels for token routing and the optimizer step.

Shapes follow the project's legend (docs/design.md): T tokens, K routing slots per token, D model
dim, E experts, S rows in expert order, A = T * K flat assignments, N elements of a flat optimizer
buffer, U blocks of assignments (the programs of a launch, NU of them).

Each op has three layers: a private ``@triton.jit`` kernel, a launcher (``_*_launch``)
that validates shapes and dtypes, makes inputs contiguous and picks block sizes, and the public
function with the signature of its torch reference in ``reference.py`` (autograd-aware where the op
has a backward). ``dispatch.py`` imports this module lazily, so ``import triton`` only happens once
a Triton path is actually taken.

All row moves are one program per tile of [BLOCK_T tokens, BLOCK_D columns]; a token's K
destinations are read from ``dest_TK``, so every op runs in token order and needs no inverse index
and no atomics (``dest_TK`` is a bijection from kept assignments onto the rows [0, S)).

The kernels live by op: ``routing`` (metadata), ``rows`` (permute, unpermute-and-combine), ``adamw``,
``quant``; ``_common`` holds what they share. The kernel tests reach the launchers through these
modules, which importing the package binds (``triton_ops.rows._permute_launch``).
"""

from ._common import INTERPRETED
from .adamw import fused_adamw
from .quant import dequantize_blockwise, quantize_blockwise
from .routing import routing_metadata
from .rows import permute, unpermute_combine

__all__ = [
    "INTERPRETED",
    "routing_metadata",
    "permute",
    "unpermute_combine",
    "fused_adamw",
    "quantize_blockwise",
    "dequantize_blockwise",
]
