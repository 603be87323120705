"""The one place that picks an implementation of each op.

Routing ops (``routing_metadata``, ``permute``, ``unpermute_combine``), ``fused_adamw`` and the block-wise
quantizer (``quantize_blockwise``, ``dequantize_blockwise``; ZeRO++'s qwZ and qgZ): Triton on
CUDA tensors, the torch reference elsewhere. Override with the environment variable
``SWITCHYARD_KERNELS`` (``auto``, ``triton``, ``reference``) or, in code and tests,
``use_backend(...)``. ``triton`` on CPU tensors runs the kernels under ``TRITON_INTERPRET=1``
(which must be set before triton is imported).

The expert FFN (``expert_ffn``) has three backends: ``grouped_mm`` (one ``torch._grouped_mm`` per
weight; by default for bf16 on Hopper), ``cpu_blocks`` (the CPU path, ``routing_kernels.cpu``; by default on
the CPU) and ``loop`` (the per-expert reference; everywhere else, and whenever the kernel backend is
``reference``). Override with ``SWITCHYARD_EXPERTS`` (``auto`` or a backend) or
``use_expert_backend(...)``. A forced ``grouped_mm`` whose operands ``_grouped_mm`` does not take
(misaligned, no rows, or a torch without it) runs the loop.
"""

from __future__ import annotations

import contextlib
import os

import torch

from . import cpu, grouped_gemm, reference


class _Choice:
    """A process-wide choice among ``valid`` names: from the environment variable ``env`` at import,
    then ``set`` / ``use`` (a context manager) in code and tests."""

    def __init__(self, env: str, valid: tuple[str, ...], what: str):
        self.valid, self.what = valid, what
        self.value = os.environ.get(env, "auto")
        if self.value not in valid:
            raise ValueError(f"{env}={self.value!r} is not one of {valid}")

    def set(self, name: str) -> None:
        if name not in self.valid:
            raise ValueError(f"{self.what} {name!r} is not one of {self.valid}")
        self.value = name

    @contextlib.contextmanager
    def use(self, name: str):
        previous = self.value
        self.set(name)
        try:
            yield
        finally:
            self.value = previous


_kernels = _Choice("SWITCHYARD_KERNELS", ("auto", "triton", "reference"), "kernel backend")
_experts = _Choice("SWITCHYARD_EXPERTS", ("auto", "grouped_mm", "cpu_blocks", "loop"), "expert backend")


def get_backend() -> str:
    return _kernels.value


def set_backend(name: str) -> None:
    _kernels.set(name)


def use_backend(name: str):
    return _kernels.use(name)


def get_expert_backend() -> str:
    return _experts.value


def set_expert_backend(name: str) -> None:
    _experts.set(name)


def use_expert_backend(name: str):
    return _experts.use(name)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def _use_triton(t) -> bool:
    if _kernels.value == "reference":
        return False
    if _kernels.value == "triton":
        return True
    return t.is_cuda and triton_available()


def _triton_impl():
    # lazy: importing triton costs seconds and is not needed on the CPU path
    from . import triton_ops

    return triton_ops


def routing_metadata(expert_ids_TK, num_experts: int):
    impl = _triton_impl() if _use_triton(expert_ids_TK) else reference
    return impl.routing_metadata(expert_ids_TK, num_experts)


def permute(x_TD, dest_TK, num_rows: int):
    impl = _triton_impl() if _use_triton(x_TD) else reference
    return impl.permute(x_TD, dest_TK, num_rows)


def unpermute_combine(y_SD, dest_TK, weights_TK):
    impl = _triton_impl() if _use_triton(y_SD) else reference
    return impl.unpermute_combine(y_SD, dest_TK, weights_TK)


def fused_adamw(param, grad, exp_avg, exp_avg_sq, **kwargs):
    impl = _triton_impl() if _use_triton(param) else reference
    return impl.fused_adamw(param, grad, exp_avg, exp_avg_sq, **kwargs)


def quantize_blockwise(x, bits: int = 8, block: int = 256):
    """Block-wise symmetric absmax quantization (``reference.quantize_blockwise``): ``(q_int8, scales_fp32)``."""
    impl = _triton_impl() if _use_triton(x) else reference
    return impl.quantize_blockwise(x, bits, block)


def dequantize_blockwise(q, scales, block: int = 256, dtype=torch.float32):
    impl = _triton_impl() if _use_triton(q) else reference
    return impl.dequantize_blockwise(q, scales, block, dtype)


def expert_backend(x: torch.Tensor, w1_XDF: torch.Tensor, w3_XDF: torch.Tensor | None, w2_XFD: torch.Tensor) -> str:
    """The backend ``expert_ffn`` runs for these operands (rows in expert order ``x``)."""
    choice = _experts.value
    if choice == "auto":
        if _kernels.value == "reference":
            choice = "loop"
        elif x.device.type == "cpu":
            choice = "cpu_blocks"
        else:
            choice = "grouped_mm" if grouped_gemm.preferred(x, w1_XDF) else "loop"
    if choice == "grouped_mm" and not grouped_gemm.accepts(x, *[w for w in (w1_XDF, w3_XDF, w2_XFD) if w is not None]):
        return "loop"
    if choice == "cpu_blocks" and x.device.type != "cpu":
        raise ValueError(f"expert backend 'cpu_blocks' runs on the CPU only, got a tensor on {x.device}")
    return choice


def _loop(x_SD, counts_X, w1_XDF, w3_XDF, w2_XFD):
    # the per-expert reference cuts its rows on the host: under torch.compile this read is a graph
    # break (the loop is the reference, not a compile target; see docs/design.md)
    return reference.expert_ffn(x_SD, counts_X.tolist(), w1_XDF, w3_XDF, w2_XFD)


_EXPERT_IMPLS = {"grouped_mm": grouped_gemm.expert_ffn, "cpu_blocks": cpu.expert_ffn, "loop": _loop}


def expert_ffn(x, counts, w1_XDF, w3_XDF, w2_XFD, dest_TK=None, weights_TK=None, num_rows: int | None = None):
    """Every expert's FFN over its rows: SwiGLU ``(silu(x w1[e]) * (x w3[e])) w2[e]``, or GELU
    ``gelu(x w1[e]) w2[e]`` when ``w3_XDF`` is None.

    ``counts``: rows per expert, best a tensor on ``x``'s device as ``routing_metadata`` returns it
    (a list of ints is taken too). No backend reads it on the host except those that must (the CPU
    block path inside its opaque op, the reference loop), so the GPU path has no host sync.

    Rows mode (``dest_TK`` None): ``x`` is ``[S, D]`` in expert order, ``counts[e]`` rows of expert
    e after those of expert e - 1; returns ``[S, D]`` in the same order. Tokens mode: ``x`` is
    ``[T, D]`` in token order and ``dest_TK``/``counts`` come from ``routing_metadata``; returns
    ``unpermute_combine(expert_ffn(permute(x, dest_TK, num_rows)), dest_TK, weights_TK)``, which the
    CPU backend runs as one pass without the expert-ordered buffers. ``num_rows`` is a static bound
    on the kept rows (default T * K, every assignment; the layer passes a tighter one under
    capacity): the intermediate shapes come from it, never from the routing.
    """
    X = w1_XDF.shape[0]
    if len(counts) != X:
        raise ValueError(f"got {len(counts)} segment counts for {X} experts")
    if (dest_TK is None) != (weights_TK is None):
        raise ValueError("dest_TK and weights_TK go together: both for tokens mode, neither for rows mode")
    if not isinstance(counts, torch.Tensor):
        counts = torch.tensor(list(counts), dtype=torch.long, device=x.device)
    backend = expert_backend(x, w1_XDF, w3_XDF, w2_XFD)
    if dest_TK is None:
        return _EXPERT_IMPLS[backend](x, counts, w1_XDF, w3_XDF, w2_XFD)
    S = dest_TK.numel() if num_rows is None else num_rows
    if backend == "cpu_blocks" and _kernels.value != "triton":
        return cpu.routed_expert_ffn(x, dest_TK, weights_TK, counts, w1_XDF, w3_XDF, w2_XFD, S)
    x_SD = permute(x, dest_TK, S)
    y_SD = _EXPERT_IMPLS[expert_backend(x_SD, w1_XDF, w3_XDF, w2_XFD)](x_SD, counts, w1_XDF, w3_XDF, w2_XFD)
    return unpermute_combine(y_SD, dest_TK, weights_TK.to(y_SD.dtype))
