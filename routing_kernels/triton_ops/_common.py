"""What every kernel module shares: whether kernels run interpreted, loop bounds from runtime
arguments, tile sizes for row moves and the launchers' input checks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl  # noqa: F401  (a jit function must see it in its globals, interpreted too)

# ---------------------------------------------------------------------------------------------
# compiled or interpreted; loop bounds from runtime arguments
# ---------------------------------------------------------------------------------------------


@triton.jit
def _loop_bound(n):
    return n


# kernels decorated while TRITON_INTERPRET=1 run on CPU tensors; tests check this flag
INTERPRETED = type(_loop_bound).__name__ == "InterpretedFunction"

if INTERPRETED:
    # Every range() over a runtime int argument takes its bound through _loop_bound: compiled, it is
    # the identity above (the kernels' sm_90 SASS is the same as with the bare argument). Interpreted,
    # that argument is a 1-element array, and Triton <= 3.6 takes a range() bound with int() of it,
    # which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars";
    # triton-lang/triton#9171, fixed in 3.7), so here the Python int is read out of the array.
    @triton.jit
    def _loop_bound(n):
        return n.handle.data.item()


_ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _row_blocks(T: int, D: int, elem_bytes: int, block_t=None, block_d=None):
    # a tile row of 16 bytes per thread over 4 warps (1024 bf16 / 512 fp32 columns) keeps loads
    # vectorised; a few tokens per tile give each program ~8-16 KB in flight
    if block_d is None:
        block_d = min(triton.next_power_of_2(max(D, 1)), 2048 // elem_bytes)
    if block_t is None:
        block_t = max(1, min(triton.next_power_of_2(max(T, 1)), 4096 // block_d))
    return block_t, block_d


def _check_device(*tensors):
    dev = tensors[0].device
    for t in tensors:
        if t.device != dev:
            raise ValueError(f"all inputs must be on one device, got {t.device} and {dev}")
    if dev.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            f"Triton kernels got {dev.type} tensors; they need CUDA tensors, or TRITON_INTERPRET=1 set "
            "before routing_kernels.triton_ops is first imported"
        )


def _check_dest(dest_TK: torch.Tensor, T: int):
    if dest_TK.dim() != 2 or dest_TK.shape[0] != T:
        raise ValueError(f"dest_TK must be [T={T}, K], got shape {tuple(dest_TK.shape)}")
    if dest_TK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"dest_TK must be int32 or int64, got {dest_TK.dtype}")
