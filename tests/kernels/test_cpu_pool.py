"""The CPU expert path's buffer pool (routing_kernels.cpu.BufferPool): reuse must never change a result.

The pool lends a buffer again only when nothing but the pool refers to its storage. These tests
shrink the pooling threshold so every buffer of a tiny layer is pooled, then check, against a fresh
copy of the layer whose pool is empty (so every buffer is new), that results are bit-identical
(the same ops in the same order) while buffers are in fact reused, and that nothing a caller or
autograd still holds is overwritten: a kept gradient, a kept output, a graph kept for a later
backward, gradients accumulated over two backward passes, a batch that changes shape.
"""

from __future__ import annotations

import copy

import pytest
import torch

from moe import MoEConfig, MoELayer
from routing_kernels.cpu import BufferPool, pool_for

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(autouse=True)
def _pool_everything(monkeypatch):
    monkeypatch.setattr(BufferPool, "min_bytes", 0)


def _layer(**kw):
    torch.manual_seed(0)
    cfg = dict(d_model=16, d_ff=24, num_experts=4, top_k=2)
    cfg.update(kw)
    return MoELayer(MoEConfig(**cfg))


def _data(seed, T=37, D=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)


def _step(layer, x, grad):
    """Forward and backward; returns (output, input grad, {name: param grad}) as clones."""
    x = x.detach().clone().requires_grad_(True)
    out = layer(x)
    out.backward(grad)
    return out.detach().clone(), x.grad.clone(), {n: p.grad.clone() for n, p in layer.named_parameters()}


def _fresh(layer):
    # a deep copy has new weight Parameters, so an empty pool of its own: every buffer it uses is new
    return copy.deepcopy(layer)


def _assert_equal(a, b):
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[2].keys() == b[2].keys()
    for n in a[2]:
        assert torch.equal(a[2][n], b[2][n]), n


@pytest.mark.parametrize("kw", [{}, dict(activation="gelu"), dict(num_experts=6, top_k=3)])
def test_reused_buffers_give_identical_results(kw):
    layer = _layer(**kw)
    template = _fresh(layer)
    ptrs = None
    for seed in range(3):
        x, grad = _data(seed)
        layer.zero_grad(set_to_none=True)
        got = _step(layer, x, grad)
        _assert_equal(got, _step(_fresh(template), x, grad))
        now = {n: p.grad.data_ptr() for n, p in layer.named_parameters() if n.startswith("experts.")}
        if ptrs is not None:
            assert now == ptrs, "dropped expert gradients' buffers were not lent again"
        ptrs = now


def test_kept_gradient_and_output_are_not_overwritten():
    layer = _layer()
    x1, g1 = _data(1)
    x1 = x1.requires_grad_(True)
    out1 = layer(x1)
    out1.backward(g1)
    kept_out, kept_out_val = out1, out1.detach().clone()
    kept_grad = layer.experts.w1.grad  # the caller keeps it, then drops p.grad as zero_grad would
    kept_grad_val = kept_grad.clone()
    layer.zero_grad(set_to_none=True)
    x2, g2 = _data(2)
    layer(x2).backward(g2)
    assert torch.equal(kept_grad, kept_grad_val)
    assert torch.equal(kept_out, kept_out_val)
    assert layer.experts.w1.grad.data_ptr() != kept_grad.data_ptr()


def test_graph_kept_across_another_step():
    # forward A keeps its graph (saved pre-activations) while B runs forward and backward; A's
    # backward afterwards must see its own saved values: p.grad = grad_B + grad_A exactly
    layer = _layer()
    template = _fresh(layer)
    (xa, ga), (xb, gb) = _data(1), _data(2)
    out_a = layer(xa.requires_grad_(True))
    layer(xb).backward(gb)
    out_a.backward(ga)
    ref_a = _step(_fresh(template), xa, ga)
    ref_b = _step(_fresh(template), xb, gb)
    for n, p in layer.named_parameters():
        assert torch.equal(p.grad, ref_b[2][n] + ref_a[2][n]), n


def test_accumulation_and_changing_shapes():
    # two backward passes without zeroing add up; with a capacity limit and a new batch size the
    # expert-ordered row count changes from step to step, so buffers of old shapes are replaced
    layer = _layer(capacity_factor=0.8)
    template = _fresh(layer)
    batches = [_data(s, T=T) for s, T in ((1, 37), (2, 37), (3, 20), (4, 51))]
    for (x, g), (x2, g2) in zip(batches[::2], batches[1::2]):
        layer.zero_grad(set_to_none=True)
        layer(x).backward(g)
        layer(x2).backward(g2)
        ref1, ref2 = _step(_fresh(template), x, g), _step(_fresh(template), x2, g2)
        for n, p in layer.named_parameters():
            assert torch.equal(p.grad, ref1[2][n] + ref2[2][n]), n
    held = pool_for(layer.experts.w1).held()
    assert held <= 40, f"the pool holds {held} buffers: old shapes are piling up"


def test_inference_mode_then_training():
    # an evaluation under torch.inference_mode() before training: a buffer pooled there would be an
    # inference tensor, which the training step could neither fill in place nor save for backward
    layer = _layer()
    template = _fresh(layer)
    x, grad = _data(1)
    with torch.inference_mode():
        evaluated = layer(x)
    _assert_equal(_step(layer, x, grad), _step(_fresh(template), x, grad))
    with torch.inference_mode():
        assert torch.equal(layer(x), evaluated)
