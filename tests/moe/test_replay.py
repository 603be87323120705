"""Activation checkpointing's recomputation takes back the MoE statistics' all-reduce its forward
ran (``routing_kernels.runtime.replayed``): no collective in the backward, the same gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import moe.layer
from moe import MoEConfig
from moe.model import Transformer, TransformerConfig
from routing_kernels import runtime
from routing_kernels.runtime import in_backward, recompute_context, replayed
from tests.support.dist import run_distributed

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_a_recomputation_takes_back_what_its_forward_collective_returned():
    calls = []

    def collective(t):  # stands for an all-reduce: a function of its input, run once a call
        calls.append(in_backward())
        return t * 2.0

    def f(x):
        y = replayed(lambda: collective(x.detach().sum()))
        return torch.sin(x) * y  # saves x and y: the backward recomputes f

    x = torch.randn(5, requires_grad=True)
    (want,) = torch.autograd.grad(f(x).sum(), x)
    assert calls == [False]  # outside a checkpoint it runs
    calls.clear()
    out = checkpoint(f, x, use_reentrant=False, context_fn=recompute_context)
    (got,) = torch.autograd.grad(out.sum(), x)
    assert calls == [False]  # the forward's only: the recomputation took its result back
    assert torch.equal(got, want)
    # a checkpoint without the context recomputes it (in the backward)
    calls.clear()
    out = checkpoint(f, x, use_reentrant=False)
    torch.autograd.grad(out.sum(), x)
    assert calls == [False, True]
    assert not getattr(runtime._replays, "stack", [])  # every context left


def _cfg(ckpt: bool) -> TransformerConfig:
    moe_cfg = MoEConfig(d_model=16, d_ff=32, num_experts=4, top_k=2, aux_loss_coef=0.01, z_loss_coef=0.001)
    return TransformerConfig(
        vocab_size=32,
        d_model=16,
        n_layers=2,
        n_heads=2,
        d_ff=32,
        max_seq_len=8,
        moe=moe_cfg,
        checkpoint_activations=ckpt,
    )


def _counting(monkeypatch):
    """Calls of the statistics' all-reduce, by whether autograd was running a backward."""
    seen = []
    original = moe.layer._all_reduce_fields

    def counted(fields, group):
        seen.append(in_backward())
        return original(fields, group)

    monkeypatch.setattr(moe.layer, "_all_reduce_fields", counted)
    return seen


def _grads(model, idx, tgt):
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_checkpointed_model_reduces_its_statistics_in_the_forward_only(monkeypatch):
    seen = _counting(monkeypatch)
    torch.manual_seed(0)
    plain = Transformer(_cfg(False))
    ckpt = Transformer(_cfg(True))
    ckpt.load_state_dict(plain.state_dict())
    idx, tgt = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    want_loss, want = _grads(plain, idx, tgt)
    seen.clear()
    got_loss, got = _grads(ckpt, idx, tgt)
    assert seen == [False, False]  # one a layer, in the forward; none in the recomputation
    assert torch.equal(got_loss, want_loss)
    for name, g in want.items():
        # the recomputation's arithmetic is the forward's: exact but for summation order
        torch.testing.assert_close(got[name], g, rtol=1e-6, atol=1e-7, msg=name)


def test_a_split_backward_recomputes_twice_and_reduces_nothing(monkeypatch):
    """A zero-bubble schedule's input pass and weight pass each recompute the checkpointed blocks:
    both take the forward's statistics back (each from the first)."""
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

    seen = _counting(monkeypatch)
    torch.manual_seed(0)
    model = Transformer(_cfg(True))
    blocks = list(model.blocks)
    L = 8
    cos, sin = model.rope_cos[:L], model.rope_sin[:L]
    params = list(torch.nn.ModuleList(blocks).parameters())
    h0, grad = torch.randn(2, L, 16), torch.randn(2, L, 16)

    def forward():
        x = h0.clone().requires_grad_()
        y = x
        for b in blocks:
            y = checkpoint(b, y, cos, sin, None, use_reentrant=False, context_fn=recompute_context)
        return x, y

    x, y = forward()
    stage_backward(y, grad, [x])
    whole = {id(p): p.grad.clone() for p in params}
    for p in params:
        p.grad = None
    seen.clear()
    x, y = forward()
    _, groups = stage_backward_input([y], [grad], [x], iter(params))
    stage_backward_weight(iter(params), groups)
    assert seen == [False, False]
    for p in params:
        torch.testing.assert_close(p.grad, whole[id(p)], rtol=1e-6, atol=1e-7)


def _ranks_rank(rank, world, state, idx, tgt):
    """One of 2 data-parallel ranks, its half of the batch, statistics over both; the model with
    and without checkpointing: (calls of the statistics' all-reduce in the backward, the loss, the
    gradients summed over the ranks)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    rows = slice(rank * idx.shape[0] // world, (rank + 1) * idx.shape[0] // world)
    out = {}
    for ckpt in (False, True):
        model = Transformer(_cfg(ckpt), dp_group=dist.group.WORLD)
        model.load_state_dict(state)
        calls = []
        original = dist.all_reduce

        def counted(t, *a, **k):
            calls.append(in_backward())
            return original(t, *a, **k)

        dist.all_reduce = counted
        try:
            loss = F.cross_entropy(model(idx[rows]).flatten(0, 1), tgt[rows].flatten())
            loss.backward()
        finally:
            dist.all_reduce = original
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g)
            grads[n] = g / world
        out[ckpt] = (calls, loss.detach(), grads)
    return out


@pytest.mark.distributed
def test_two_ranks_checkpointed_run_no_collective_in_the_backward_and_train_like_one_process():
    torch.manual_seed(0)
    one = Transformer(_cfg(False))
    idx, tgt = torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))
    _, want = _grads(one, idx, tgt)
    results = run_distributed(_ranks_rank, 2, {k: v.clone() for k, v in one.state_dict().items()}, idx, tgt)
    for rank, out in enumerate(results):
        plain_calls, plain_loss, plain = out[False]
        calls, loss, got = out[True]
        assert plain_calls == [False, False], (rank, plain_calls)  # the statistics, one a layer
        assert calls == [False, False], (rank, calls)  # and none in the recomputation
        assert torch.equal(loss, plain_loss), rank
        for name, g in want.items():
            # against one process of the whole batch: the ranks' halves summed (rounding only)
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
            torch.testing.assert_close(got[name], plain[name], rtol=1e-6, atol=1e-7, msg=f"rank {rank} {name}")


def test_the_replay_is_per_checkpoint():
    """Two checkpoints in one forward keep their own records: each recomputation takes back its own."""
    calls = []

    def collective(t):
        calls.append(in_backward())
        return t + 1.0

    def f(x):
        return x * replayed(lambda: collective(x.detach().sum()))

    x = torch.randn(3, requires_grad=True)
    a = checkpoint(f, x, use_reentrant=False, context_fn=recompute_context)
    b = checkpoint(f, a * 3.0, use_reentrant=False, context_fn=recompute_context)
    (got,) = torch.autograd.grad(b.sum(), x)
    assert calls == [False, False]
    (want,) = torch.autograd.grad(f(f(x) * 3.0).sum(), x)
    assert torch.equal(got, want)
