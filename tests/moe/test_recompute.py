"""``moe.recompute.checkpoint_once``: checkpointed blocks recomputed once for every backward pass
over the graph, against the model without checkpointing (the naive reference: nothing
recomputed), forward and every gradient, under a plain backward and under the split backward of
``torch.distributed.pipelining``'s zero-bubble schedules (the input pass, then the weight pass,
one ``autograd.grad`` per parameter group)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as nnf
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

import routing_kernels as rk
from moe import MoEConfig
from moe.model import Block, Transformer, TransformerConfig
from moe.recompute import checkpoint_once

V, D, B, L = 61, 32, 3, 16


def _cfg(**kw) -> TransformerConfig:
    m = MoEConfig(d_model=D, d_ff=40, num_experts=4, top_k=2)
    return TransformerConfig(vocab_size=V, d_model=D, d_ff=48, max_seq_len=32, n_layers=3, n_heads=4, moe=m, **kw)


MLA = dict(attention="mla", q_lora_rank=16, kv_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=10)


def _counted(monkeypatch) -> dict:
    """Block forwards run, the recomputations among them."""
    seen = {"n": 0}
    forward = Block.forward

    def counting(self, *args, **kwargs):
        seen["n"] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Block, "forward", counting)
    return seen


def _models(cfg: TransformerConfig, once: bool):
    """The reference (no checkpointing) and the blocks-only stage of the checkpointed model, on the
    same weights."""
    torch.manual_seed(0)
    ref = Transformer(cfg)
    ckpt = Transformer(dataclasses.replace(cfg, checkpoint_activations=True))
    ckpt.load_state_dict(ref.state_dict())
    stage = ckpt.pipeline_stage(1, cfg.n_layers + 1)  # the blocks: activations in, activations out
    stage.recompute_once = once
    return ref, ckpt, stage


def _reference(ref: Transformer, x_BLD: torch.Tensor, g_BLD: torch.Tensor):
    x = x_BLD.clone().requires_grad_(True)
    out = ref.pipeline_stage(1, ref.cfg.n_layers + 1)(x)
    out.backward(g_BLD)
    grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


def _split_backward(stage, out, g_BLD, x):
    """The zero-bubble schedules' backward: the input pass, then the weight pass."""
    params = [p for p in stage.parameters() if p.requires_grad]
    (dx,), groups = stage_backward_input([out], [g_BLD], [x], iter(params))
    stage_backward_weight(iter(params), groups)
    return dx


@pytest.mark.parametrize("attention", ["mha", "mla"])
@pytest.mark.parametrize("backward", ["plain", "split"])
def test_one_recomputation_serves_every_pass_and_matches_no_checkpointing(monkeypatch, attention, backward):
    cfg = _cfg(**(MLA if attention == "mla" else {}))
    ref, ckpt, stage = _models(cfg, once=True)
    torch.manual_seed(1)
    x_BLD, g_BLD = torch.randn(B, L, D), torch.randn(B, L, D)
    want_out, want_dx, want = _reference(ref, x_BLD, g_BLD)
    seen = _counted(monkeypatch)
    x = x_BLD.clone().requires_grad_(True)
    out = stage(x)
    assert seen["n"] == cfg.n_layers
    if backward == "plain":
        out.backward(g_BLD)
        dx = x.grad
    else:
        dx = _split_backward(stage, out, g_BLD, x)
    assert seen["n"] == 2 * cfg.n_layers  # each block recomputed once
    # the same operators on the same values in the same order: bit for bit
    assert torch.equal(out, want_out) and torch.equal(dx, want_dx)
    got = {n: p.grad for n, p in ckpt.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), n


def test_torchs_checkpoint_recomputes_once_per_pass_of_a_split_backward(monkeypatch):
    # why checkpoint_once exists: the same split backward under torch.utils.checkpoint re-runs each
    # block once per graph task (the input pass, and every parameter group of the weight pass)
    cfg = _cfg()
    _, _, stage = _models(cfg, once=False)
    seen = _counted(monkeypatch)
    x = torch.randn(B, L, D, requires_grad=True)
    _split_backward(stage, stage(x), torch.randn(B, L, D), x)
    assert seen["n"] > 2 * cfg.n_layers


def test_the_cpu_expert_kernel_and_the_recomputed_collectives_record_under_it(monkeypatch):
    # the fused CPU kernel's pooled buffers and the recompute context's replay (one recomputation:
    # the replayed statistics are taken back once) under a split backward, against no checkpointing
    cfg = _cfg()
    with rk.use_expert_backend("cpu_blocks"):
        ref, ckpt, stage = _models(cfg, once=True)
        torch.manual_seed(2)
        x_BLD, g_BLD = torch.randn(B, L, D), torch.randn(B, L, D)
        want_out, want_dx, want = _reference(ref, x_BLD, g_BLD)
        x = x_BLD.clone().requires_grad_(True)
        out = stage(x)
        dx = _split_backward(stage, out, g_BLD, x)
    assert torch.equal(out, want_out) and torch.equal(dx, want_dx)
    for n, p in ckpt.named_parameters():
        if p.grad is not None:
            assert torch.equal(p.grad, want[n]), n


def test_a_tensor_saved_once_is_freed_with_the_graph():
    # a holder lives as long as autograd keeps its saved tensor: a plain backward releases them
    # node by node, and nothing of the recomputation outlives the backward
    import gc
    import weakref

    recomputed = []

    def fn(a):
        b = a.sin()
        recomputed.append(weakref.ref(b))
        return (b * a).sum()

    a = torch.randn(64, requires_grad=True)
    checkpoint_once(fn, a).backward()
    gc.collect()
    assert len(recomputed) == 2 and all(r() is None for r in recomputed)
    assert torch.allclose(a.grad, (a.sin() + a * a.cos()).detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("rerun", ["fewer", "other"])
def test_a_recomputation_that_saves_other_tensors_is_named(rerun):
    calls = {"n": 0}

    def fn(a):
        calls["n"] += 1
        if calls["n"] == 1:
            return (a * a).sum()  # saves a twice
        return (a.sin()).sum() if rerun == "fewer" else (a.double() * a.double()).sum()

    a = torch.randn(8, requires_grad=True)
    out = checkpoint_once(fn, a)
    match = "the re-run saved fewer tensors" if rerun == "fewer" else r"saved tensor 0 was \(\(8,\), torch.float32\)"
    with pytest.raises(RuntimeError, match=match):
        out.backward()


def test_autocast_and_random_state_are_the_forwards():
    # the re-run sees the forward's autocast state and random numbers, whatever the backward's
    def fn(a):
        noise = torch.rand_like(a)  # a dropout-like draw: the recomputation must draw the same
        return ((a @ a.T) * noise[:, :1]).float().sum()  # autocast runs the product in bf16

    torch.manual_seed(3)
    a = torch.randn(8, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(4)
        want = torch.autograd.grad(fn(a), a)[0]
        torch.manual_seed(4)
        out = checkpoint_once(fn, a)
    torch.manual_seed(99)  # the backward's random state differs
    (got,) = torch.autograd.grad(out, a)
    assert torch.equal(got, want)


def test_without_grad_nothing_is_checkpointed():
    cfg = _cfg()
    _, ckpt, stage = _models(cfg, once=True)
    with torch.no_grad():
        out = stage(torch.randn(B, L, D))
    assert out.grad_fn is None


def test_the_whole_model_trains_on_a_loss_as_without_checkpointing():
    # the embedding and the head around the checkpointed blocks, the loss's backward through them
    cfg = _cfg()
    ref, ckpt, _ = _models(cfg, once=True)
    ckpt.recompute_once = True
    idx = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(5))
    for model in (ref, ckpt):
        nnf.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    want = dict(ref.named_parameters())
    for n, p in ckpt.named_parameters():
        assert torch.equal(p.grad, want[n].grad), n


@pytest.mark.parametrize("attention", ["mha", "mla"])
@pytest.mark.parametrize("once", [False, True])
def test_the_input_pass_captures_what_the_planner_counts(attention, once):
    """What a split backward's input pass keeps for the weight pass beyond the saved tensors: torch
    captures the gradient of every weight operator's output (``stage_backward_input``'s param
    groups). The planner keeps them, per block and token ``BlockCost.wgrad_captured_bytes``, from the
    input pass to the weight pass; for a checkpointed block they come on top of what it recomputed.
    Counted here off the groups themselves, each tensor once, against the planner's figure for the
    blocks (the CPU's fused expert kernel: its weight pass takes its output's gradient)."""
    from moe.costs import model_costs

    cfg = _cfg(**(MLA if attention == "mla" else {}))
    _, _, stage = _models(cfg, once)
    torch.manual_seed(1)
    x = torch.randn(B, L, D, requires_grad=True)
    out = stage(x)
    params = [p for p in stage.parameters() if p.requires_grad]
    _, groups = stage_backward_input([out], [torch.randn(B, L, D)], [x], iter(params))
    seen = {}
    for g in groups:
        for grads in g.get("grads") or []:
            for t in grads or ():
                if isinstance(t, torch.Tensor):
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    captured = sum(seen.values())
    costs = model_costs(cfg, L, experts="fused")
    want = sum(b.wgrad_captured_bytes for b in costs.blocks[1:-1]) * B * L
    assert captured == want, (captured, want)
