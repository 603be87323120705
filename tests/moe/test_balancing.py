"""The MoELayer's balancing: the auxiliary losses reaching the router through the layer's output,
the router statistics, aux-loss-free expert biases, and activation checkpointing counting each
forward once.

Shapes follow the project's legend (docs/design.md).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import moe
from moe import MoEConfig, MoELayer
from tests.support.layer_cases import (
    assert_close,
    make,
    no_aux,
    run_layer,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def explicit_aux(cfg, weight_ED, x_TD, counts_E, seq_len):
    """The three losses written out: Switch/GShard, per-sequence, z-loss."""
    E, K = cfg.num_experts, cfg.top_k
    T = x_TD.shape[0]
    logits = x_TD @ weight_ED.t()
    probs = torch.softmax(logits, dim=-1)
    lb = E * torch.sum(counts_E.double() / (K * T) * probs.mean(0))
    routing_ids = torch.topk(probs.detach(), K, dim=-1).indices
    seq_terms = []
    for s in range(T // seq_len):
        rows = slice(s * seq_len, (s + 1) * seq_len)
        c = torch.bincount(routing_ids[rows].reshape(-1), minlength=E).double()
        seq_terms.append(E * torch.sum(c / (K * seq_len) * probs[rows].mean(0)))
    seq = torch.stack(seq_terms).mean()
    z = torch.logsumexp(logits, dim=-1).square().mean()
    return cfg.aux_loss_coef * lb + cfg.seq_aux_loss_coef * seq + cfg.z_loss_coef * z, (lb, seq, z)


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_aux_loss_reaches_router_through_output(scale):
    B, S, D = 3, 11, 16
    cfg = MoEConfig(
        d_model=D, d_ff=20, num_experts=6, top_k=2, aux_loss_coef=0.3, seq_aux_loss_coef=0.2, z_loss_coef=0.05
    )
    layer = make(cfg)
    moe.scale_aux_losses(layer, scale)
    torch.manual_seed(6)
    x = torch.randn(B, S, D)
    g = torch.randn(B, S, D)
    # the layer: only the task loss is backpropagated; the aux losses ride on the output
    _, _, grads = run_layer(layer, x, g * scale)
    counts_E = layer.stats.tokens_per_expert
    # the reference: the same forward with the losses off, plus the losses added to the loss by hand
    plain = copy.deepcopy(layer)
    plain.cfg = no_aux(d_model=D, d_ff=20, num_experts=6, top_k=2)
    plain.router.cfg = plain.cfg
    plain.zero_grad()
    x_TD = x.reshape(-1, D)
    out = plain(x)
    aux, (lb, seq, z) = explicit_aux(cfg, plain.router.weight.double(), x_TD.double(), counts_E, S)
    (scale * ((out * g).sum() + aux)).backward()
    assert_close(grads["router.weight"], plain.router.weight.grad, torch.float32, "router grad")
    for name in ("experts.w1", "experts.w2"):
        assert_close(grads[name], dict(plain.named_parameters())[name].grad, torch.float32, name)
    # the reported values are the losses themselves, not scaled by coefficient or by ``scale``
    assert layer.stats.aux_loss.item() == pytest.approx(lb.item(), rel=1e-5)
    assert layer.stats.seq_aux_loss.item() == pytest.approx(seq.item(), rel=1e-5)
    assert layer.stats.z_loss.item() == pytest.approx(z.item(), rel=1e-5)


def test_router_statistics():
    cfg = MoEConfig(d_model=16, d_ff=8, num_experts=4, top_k=2)
    layer = make(cfg)
    torch.manual_seed(7)
    x = torch.randn(25, 16)
    layer(x)
    probs = torch.softmax(x.double() @ layer.router.weight.detach().double().t(), -1)
    ids = torch.topk(probs, 2, -1).indices
    assert layer.stats.tokens_per_expert.tolist() == torch.bincount(ids.reshape(-1), minlength=4).tolist()
    entropy = -(probs * probs.log()).sum(-1).mean()
    assert layer.stats.router_entropy.item() == pytest.approx(entropy.item(), rel=1e-5)
    assert layer.stats.dropped_fraction.item() == 0.0
    d = layer.stats.as_dict()
    assert set(d) == {"aux_loss", "seq_aux_loss", "z_loss", "tokens_per_expert", "dropped_fraction", "router_entropy"}


def load_imbalance(counts):
    counts = counts.double()
    return (counts.max() / counts.mean()).item()


def test_expert_bias_moves_load_toward_uniform():
    E = 8
    cfg = MoEConfig(
        d_model=16, d_ff=8, num_experts=E, top_k=2, expert_bias=True, bias_update_rate=0.02, aux_loss_coef=0.0
    )
    torch.manual_seed(8)
    layer = MoELayer(cfg)
    x = torch.randn(256, 16) + 0.5
    with torch.no_grad():
        # experts 0 and 1 lean toward the input mean, so they take most tokens
        layer.router.weight[:2] += 0.4
    layer.train()
    with torch.no_grad():
        layer(x)
    start = load_imbalance(layer.stats.tokens_per_expert)
    assert start > 2.0
    layer.update_expert_bias()
    history = []
    for _ in range(60):
        with torch.no_grad():
            layer(x)
        history.append(load_imbalance(layer.stats.tokens_per_expert))
        moe.update_expert_biases(layer)
    # sign updates of a fixed size oscillate around balance on a fixed batch, so look at the best of
    # the last steps: the max/mean load must have at least halved
    assert min(history[-10:]) < 0.5 * start
    # the overloaded experts' biases went down, the bias update resets the running load
    assert layer.router.expert_bias[:2].max() < 0 and torch.all(layer.load_since_update == 0)


def test_expert_bias_selects_but_does_not_weight():
    cfg = no_aux(d_model=16, d_ff=8, num_experts=6, top_k=2, expert_bias=True)
    layer = make(cfg)
    torch.manual_seed(9)
    x = torch.randn(40, 16)
    before = layer.router(x)
    with torch.no_grad():
        layer.router.expert_bias.zero_()
        layer.router.expert_bias[5] = 10.0  # expert 5 is now everyone's pick
    after = layer.router(x)
    assert torch.all((after.expert_ids_TK == 5).any(1))
    assert not torch.equal(before.expert_ids_TK, after.expert_ids_TK)
    # the weights are still the (renormalised) softmax probabilities of the chosen experts
    probs = torch.softmax(x @ layer.router.weight.detach().t(), -1)
    w = probs.gather(1, after.expert_ids_TK)
    torch.testing.assert_close(after.weights_TK, w / w.sum(1, keepdim=True), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("reentrant,early_stop", [(True, True), (False, True), (False, False)])
def test_activation_checkpointing_counts_once(reentrant, early_stop):
    # non-reentrant recompute normally stops after the last saved tensor, before the statistics;
    # early_stop=False makes it re-run the whole forward, statistics included
    cfg = MoEConfig(
        d_model=16,
        d_ff=20,
        num_experts=5,
        top_k=2,
        aux_loss_coef=0.1,
        z_loss_coef=0.01,
        seq_aux_loss_coef=0.05,
        expert_bias=True,
    )
    layer = make(cfg)
    layer.train()
    torch.manual_seed(10)
    x = torch.randn(2, 13, 16)
    g = torch.randn(2, 13, 16)
    out, gx, grads = run_layer(layer, x, g)
    stats, load = layer.stats, layer.load_since_update.clone()

    ck = copy.deepcopy(layer)
    ck.load_since_update.zero_()
    ck.zero_grad(set_to_none=True)
    xc = x.clone().requires_grad_(True)
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        out_c = checkpoint(ck, xc, use_reentrant=reentrant)
        out_c.backward(g)
    assert torch.equal(out_c.detach(), out)
    torch.testing.assert_close(xc.grad, gx, rtol=0, atol=0)
    for name, p in ck.named_parameters():
        # recompute runs the same ops in the same order: identical bits, so an aux loss counted
        # twice (a router gradient off by coef * dloss) cannot hide in a tolerance
        torch.testing.assert_close(p.grad, grads[name], rtol=0, atol=0, msg=name)
    assert torch.equal(ck.load_since_update, load)
    assert torch.equal(ck.stats.tokens_per_expert, stats.tokens_per_expert)
    assert ck.stats.aux_loss.item() == stats.aux_loss.item()
