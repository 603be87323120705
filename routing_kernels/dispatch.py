"""The one place that picks an implementation: Triton on CUDA tensors, the torch reference elsewhere.

Override with the environment variable ``SWITCHYARD_KERNELS`` (``auto``, ``triton``,
``reference``) or, in code and tests, with ``use_backend(...)``. ``triton`` on CPU tensors runs
the kernels under ``TRITON_INTERPRET=1`` (which must be set before triton is imported).
"""
from __future__ import annotations

import contextlib
import os

from . import reference

_VALID = ("auto", "triton", "reference")
_backend = os.environ.get("SWITCHYARD_KERNELS", "auto")
if _backend not in _VALID:
    raise ValueError(f"SWITCHYARD_KERNELS={_backend!r} is not one of {_VALID}")


def get_backend() -> str:
    return _backend


def set_backend(name: str) -> None:
    global _backend
    if name not in _VALID:
        raise ValueError(f"kernel backend {name!r} is not one of {_VALID}")
    _backend = name


@contextlib.contextmanager
def use_backend(name: str):
    previous = get_backend()
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def _use_triton(t) -> bool:
    if _backend == "reference":
        return False
    if _backend == "triton":
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
