"""The expert FFN on the CPU (``routing_kernels.cpu.blocks``)."""

from .blocks import expert_ffn, routed_expert_ffn

__all__ = ["expert_ffn", "routed_expert_ffn"]
