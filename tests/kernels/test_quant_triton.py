"""The block-wise quantizer's Triton kernels (``routing_kernels.triton_ops.quantize_blockwise`` and
``dequantize_blockwise``) against their torch references, on the CPU under TRITON_INTERPRET=1, as
tests/kernels/test_triton_ops.py runs the routing kernels (the same import dance, the same fresh
process when triton was imported earlier without the interpreter).

Bit for bit: the scale is an IEEE division (``tl.div_rn``), the rounding half to even as
``torch.round``; a dequantized fp32 value is one IEEE product. Only a bf16 output may differ, by
one bf16 ulp: the interpreter truncates fp32 -> bf16 where the GPU (and torch) round to nearest.
Sizes: rows not a multiple of the block, blocks that are not powers of two, one block, many rows,
an empty row, all-zero blocks and a block with one huge value.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch


def _set_interpret(value):
    previous = os.environ.get("TRITON_INTERPRET")
    if value is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = value
    return previous


# see tests/kernels/test_triton_ops.py: the interpreter is chosen when triton is first imported
_previous = _set_interpret("1")
try:
    triton_ops = importlib.import_module("routing_kernels.triton_ops")
    import triton.language.standard as _tl_standard

    IN_PROCESS = triton_ops.INTERPRETED and type(_tl_standard.sum).__name__ == "InterpretedFunction"
finally:
    _set_interpret(_previous)

from routing_kernels import reference as ref  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    previous = _set_interpret("1")
    yield
    _set_interpret(previous)


@pytest.fixture(autouse=True)
def _interpreted_only(request):
    if not IN_PROCESS and request.node.originalname != "test_in_fresh_process":
        pytest.skip("triton was imported earlier without TRITON_INTERPRET=1; test_in_fresh_process runs this")


def _data(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    flat = x.view(-1)
    if flat.numel() >= 40:
        flat[8:16] = 0.0  # an all-zero stretch (a whole block where block <= 8)
        flat[30] = 3e4  # one huge value
    return x.to(dtype)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape, block", [((1000,), 256), ((3, 257), 256), ((5, 33), 8), ((2, 3, 19), 5), ((7,), 256), ((4, 0), 4)]
)
def test_quantize_matches_reference(shape, block, dtype, bits):
    x = _data(shape, dtype)
    q, s = triton_ops.quantize_blockwise(x, bits, block)
    q_ref, s_ref = ref.quantize_blockwise(x, bits, block)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    out = triton_ops.dequantize_blockwise(q, s, block, torch.float32)
    assert torch.equal(out, ref.dequantize_blockwise(q_ref, s_ref, block, torch.float32))
    out16 = triton_ops.dequantize_blockwise(q, s, block, torch.bfloat16)
    want16 = ref.dequantize_blockwise(q_ref, s_ref, block, torch.bfloat16)
    assert torch.allclose(out16.float(), want16.float(), rtol=2**-7, atol=0)


def test_rounding_half_to_even():
    # exact halves and the float just below one half (floor(y + 0.5) would round it up)
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 127.0, 0.49999997, -3.5])
    for bits in (4, 8):
        q, s = triton_ops.quantize_blockwise(x * (2 ** (bits - 1) - 1) / 127, bits, 8)
        q_ref, s_ref = ref.quantize_blockwise(x * (2 ** (bits - 1) - 1) / 127, bits, 8)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="bits=3 is not supported"):
        triton_ops.quantize_blockwise(torch.randn(4), 3, 4)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        triton_ops.quantize_blockwise(torch.ones(4, dtype=torch.int32), 8, 4)
    with pytest.raises(ValueError, match="scales has shape"):
        triton_ops.dequantize_blockwise(torch.zeros(10, dtype=torch.int8), torch.zeros(2), 4)


@pytest.mark.distributed  # a fresh interpreter
@pytest.mark.skipif(IN_PROCESS, reason="the tests above ran in this process")
def test_in_fresh_process():
    # this module's tests, run where triton is first imported with the interpreter on
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__)],
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
