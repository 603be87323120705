"""ZeRO++'s lossy parts: the block quantizer's per-element error within its stated bound, the wire
format, and qwZ and qgZ on 4 ranks (tests/support/zeropp_runs.py): their first-step gradients and
50-step loss curves held to a tolerance of fp32 stage 3 whose reason is written beside it
(``GRAD_RTOL``, ``CURVE_ATOL``); and the benchmark's on-paper model."""

from __future__ import annotations

import math

import pytest
import torch

from routing_kernels import reference as ref
from tests.support.dist import run_distributed
from tests.support.zeropp_runs import CURVE_STEPS, WORLD, curve_rank
from zero.zeropp import row_bytes

# --- single process: the quantizer ----------------------------------------------------------

# |x - deq| <= scale / 2 in exact arithmetic; fp32's division and product add at most
# 2 * 2**-24 * qmax * scale (qmax <= 127 < 2**7): 2**-16 * scale, inside the 2**-14 relative slack
BOUND_SLACK = 1 + 2**-14


def _check_bound(x, bits, block):
    q, s = ref.quantize_blockwise(x, bits, block)
    deq = ref.dequantize_blockwise(q, s, block)
    qmax = 2 ** (bits - 1) - 1
    n = x.shape[-1]
    scale = s.repeat_interleave(block, dim=-1)[..., :n]
    err = (x.float() - deq).abs()
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert q.shape == x.shape and s.shape == x.shape[:-1] + (math.ceil(n / block),)
    assert int(q.abs().max()) <= qmax
    assert torch.all(err <= scale / 2 * BOUND_SLACK), (err / scale).max()
    # the stated bound in absmax terms: absmax / (2 * qmax)
    absmax = torch.nn.functional.pad(x.float().abs(), (0, -n % block)).view(*x.shape[:-1], -1, block).amax(-1)
    assert torch.allclose(s, absmax / qmax)
    return q, s, deq


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n, block", [(1, 256), (7, 256), (255, 256), (257, 256), (1001, 256), (100, 1), (33, 8)])
def test_quantizer_error_within_bound(bits, n, block):
    g = torch.Generator().manual_seed(n + block)
    x = torch.randn(3, n, generator=g) * torch.tensor([[1.0], [1e-3], [50.0]])
    _check_bound(x, bits, block)
    _check_bound(x.to(torch.bfloat16), bits, block)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantizer_zeros_and_one_huge_value(bits):
    block = 16
    x = torch.randn(5 * block + 3)
    x[block : 2 * block] = 0.0  # an all-zero block
    x[3 * block + 5] = 1e6  # one huge value: its block's other elements round to 0, within the bound
    q, s, deq = _check_bound(x, bits, block)
    assert s[1] == 0 and torch.all(deq[block : 2 * block] == 0)
    assert deq[3 * block + 5] == x[3 * block + 5]  # the absmax element is +-qmax * scale exactly
    others = torch.cat([torch.arange(0, 3 * block), torch.arange(4 * block, x.numel())])
    # the huge value changes no other block
    q2, s2, _ = _check_bound(x.clone().index_fill_(0, torch.tensor([3 * block + 5]), 0.0), bits, block)
    assert torch.equal(q[others], q2[others])
    # everything of that block but the huge value quantizes to 0 (|x| < scale / 2 = 1e6 / (2 qmax))
    blk = torch.arange(3 * block, 4 * block)
    assert torch.all(q[blk[blk != 3 * block + 5]] == 0)


def test_quantizer_all_zero_and_empty():
    for bits in (4, 8):
        q, s = ref.quantize_blockwise(torch.zeros(2, 300), bits, 256)
        assert torch.all(q == 0) and torch.all(s == 0)
        assert torch.equal(ref.dequantize_blockwise(q, s, 256), torch.zeros(2, 300))
        q, s = ref.quantize_blockwise(torch.zeros(3, 0), bits, 256)
        assert q.shape == (3, 0) and s.shape == (3, 0)


def test_quantizer_keeps_nonfinite_visible():
    # a NaN or inf gradient must reach the step's finiteness check through qgZ
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(40)
        x[13] = bad
        q, s = ref.quantize_blockwise(x, 4, 16)
        deq = ref.dequantize_blockwise(q, s, 16)
        assert torch.all(torch.isnan(deq[:16]))  # the whole block: its scale is not finite
        assert torch.all(torch.isfinite(deq[16:]))


def test_int4_packing_round_trip():
    for n in (1, 2, 15, 16, 17):
        q = torch.arange(n, dtype=torch.int64).remainder(16).sub(8).to(torch.int8)  # every value -8..7
        p = ref.pack_int4(q)
        assert p.dtype == torch.uint8 and p.shape == (math.ceil(n / 2),)
        assert torch.equal(ref.unpack_int4(p, n), q)
    q = torch.randint(-7, 8, (3, 5), dtype=torch.int8)
    assert torch.equal(ref.unpack_int4(ref.pack_int4(q), 5), q)


def test_quantizer_refuses_bad_bits_and_block():
    x = torch.randn(10)
    with pytest.raises(ValueError, match=r"bits=3 is not supported: valid bit widths are \(4, 8\)"):
        ref.quantize_blockwise(x, 3)
    with pytest.raises(ValueError, match="block=0 must be a positive integer"):
        ref.quantize_blockwise(x, 8, 0)


def test_wire_format_size():
    # what the byte model charges per quantized row: values (two int4 a byte) then fp32 scales
    assert row_bytes(100, 8, 32) == 100 + 4 * 4
    assert row_bytes(101, 4, 32) == 51 + 4 * 4
    assert row_bytes(64, 4, 256) == 32 + 4


# --- distributed ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def curves():
    return run_distributed(curve_rank, WORLD, timeout=600)


# --- the lossy options: first-step gradients and 50-step curves -----------------------------

# The first step's synchronised gradient (full_gradients(), before any quantized weight has moved
# the trajectory), relative L2 error against fp32 stage 3's over the whole model. Rounding to the
# nearest of 2 qmax + 1 levels errs by at most absmax / (2 qmax) per element, uniformly (rms
# absmax / (qmax sqrt(12))); qgZ rounds twice (inside the node, then the node's partial sums), and a
# small tensor sharing a block with large gradients rounds to zero. Measured here: int4 0.133,
# int8 0.0071 (the ratio ~ 127 / 7, as the levels predict), qwZ 0.0071 (its int8 weights perturb
# the forward), bf16 compute 0.0048 for scale. A broken reduction (a node or chunk missing, a wrong
# sign) errs by O(1). Bounds: ~1.5-3x the measured values.
GRAD_RTOL = {"qwz": 0.02, "qgz8": 0.02, "qgz4": 0.25, "zeropp": 0.25}

# The curves: 50 AdamW steps (lr 1e-2, clip 1.0) on the teacher task, loss falling ~0.9 -> ~0.06.
# A lossy step changes the trajectory as any small perturbation does: measured (2 data seeds),
# the largest |loss - fp32 loss| over the 50 steps as a fraction of the first loss: qwZ 0.006-0.009,
# qgZ int4 0.023-0.031, all three 0.027-0.036; an fp32 run with a 10% smaller lr deviates
# 0.032-0.046, bf16 compute 0.005-0.008. The tolerance lets these perturbations through (~2.5x
# measured) while a step that stops learning (loss stuck near its start) is far outside it; the
# mean of the last 10 steps must be within 10% of fp32's (measured within 3%).
CURVE_ATOL = {"qwz": 0.025, "qgz4": 0.08, "zeropp": 0.08}
TAIL_RTOL = 0.10


def _rel_l2(got: dict, want: dict) -> float:
    num = sum(((got[n].float() - want[n]) ** 2).sum() for n in want)
    return float((num / sum((w**2).sum() for w in want.values())).sqrt())


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(GRAD_RTOL))
def test_quantized_first_step_gradients(curves, name):
    for out in curves:
        err = _rel_l2(out[name]["grads"], out["fp32"]["grads"])
        assert err <= GRAD_RTOL[name], err


@pytest.mark.distributed
def test_qgz_error_scales_with_its_levels(curves):
    # int4 and int8 err as their levels: 2 * 7 + 1 against 2 * 127 + 1 (a reduction that loses or
    # misplaces a contribution errs by the same O(1) at either width)
    base = curves[0]["fp32"]["grads"]
    ratio = _rel_l2(curves[0]["qgz4"]["grads"], base) / _rel_l2(curves[0]["qgz8"]["grads"], base)
    assert 127 / 7 / 1.5 < ratio < 127 / 7 * 1.5, ratio


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["fp32", "qwz", "zeropp"])
def test_forward_weights_same_on_every_replica(curves, name):
    # qwZ: every replica computes with the same dequantized weights (its own chunk dequantized too),
    # each within absmax / 254 of the master weights (absmax of its block, at most the model's)
    bound = max(w.abs().max() for w in curves[0][name]["initial"].values()) / 254 * (1 + 2**-14)
    for rank, out in enumerate(curves):
        seen, initial = out[name]["seen"], out[name]["initial"]
        assert seen.keys() == initial.keys()
        twin = curves[(rank + 2) % WORLD][name]["seen"]  # the other node's rank at the same ep position
        for n, w in seen.items():
            assert torch.equal(w, curves[0][name]["seen"][n] if "experts" not in n else twin[n]), (rank, n)
            err = (w - initial[n]).abs().max()
            assert err == 0 if name == "fp32" else err <= bound, (rank, n, err)


@pytest.mark.distributed
def test_qgz_stages_1_2_reduce_as_stage_3(curves):
    for out in curves:
        want = out["qgz4"]["grads"]
        for name in ("qgz4_stage1", "qgz4_stage2"):
            got = out[name]["grads"]
            assert all(torch.equal(got[n], want[n]) for n in want), name


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CURVE_ATOL))
def test_quantized_curves_follow_fp32(curves, name):
    base, got = curves[0]["fp32"]["losses"], curves[0][name]["losses"]
    assert len(got) == CURVE_STEPS
    dev = max(abs(a - b) for a, b in zip(got, base)) / base[0]
    assert dev <= CURVE_ATOL[name], dev
    assert abs(sum(got[-10:]) / sum(base[-10:]) - 1) <= TAIL_RTOL
    for out in curves[1:]:  # every rank reports the same dp-mean loss
        assert out[name]["losses"] == got
    assert base[-1] < 0.2 * base[0]  # the task is learnt


# --- the benchmark's on-paper model ---------------------------------------------------------


def test_bench_paper_model():
    from experiments.bench.zeropp import contenders, paper_step_times

    names = list(contenders())
    assert names[0] == "ZeRO-3" and len(names) == len(set(names)) == 12  # 8 combinations, qgZ at 4 and 8 bits
    t = paper_step_times(18e9, 40, 1024)
    (c3, z3), (cp, zp) = t["ZeRO-3"], t["ZeRO++"]
    assert c3 == cp == 8 * 18e9 * 1024 / 62.5e12
    assert zp < z3 / 2
    # with free links inside the node and no latency, the model's communication is the inter-node
    # bytes alone: 4x fewer, up to the scales (8 bytes per 256 elements over 1.5 bytes per element)
    t = paper_step_times(18e9, 40, 1024, intra_gbs=1e12, alpha_inter_us=0, alpha_intra_us=0)
    ratio = t["ZeRO-3"][1] / t["ZeRO++"][1]
    assert 4 / (1 + 8 / 256 / 1.5) - 1e-3 < ratio <= 4
