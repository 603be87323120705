"""Router losses against values worked out by hand on tiny inputs.

Shapes follow the project's legend (docs/design.md): B sequences, L tokens per sequence.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe import load_balancing_loss, router_z_loss, routing_entropy, sequence_load_balancing_loss

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_load_balancing_by_hand():
    # T=2, E=2, k=1, both tokens sent to expert 0: f = [1, 0], P = [0.55, 0.45]
    # E * sum f_e P_e = 2 * (1 * 0.55 + 0 * 0.45) = 1.1
    probs = torch.tensor([[0.7, 0.3], [0.4, 0.6]], requires_grad=True)
    loss = load_balancing_loss(probs, torch.tensor([2, 0]), top_k=1, num_tokens=2)
    assert loss.item() == pytest.approx(1.1)
    # d loss / d probs[t, e] = E * f_e / T: the gradient pushes down only the overloaded expert
    loss.backward()
    torch.testing.assert_close(probs.grad, torch.tensor([[1.0, 0.0], [1.0, 0.0]]))


def test_load_balancing_uniform_is_one():
    # k=2 of E=4, 4 tokens, each expert gets 2 of the 8 assignments, probabilities uniform
    probs = torch.full((4, 4), 0.25)
    assert load_balancing_loss(probs, torch.tensor([2, 2, 2, 2]), top_k=2, num_tokens=4).item() == pytest.approx(1.0)


def test_load_balancing_global_counts():
    # under data parallelism the counts and token number are global while probs stay local:
    # 3 experts, k=2, 6 global tokens, counts [6, 4, 2] -> f = [.5, 1/3, 1/6]; local P = [.5, .3, .2]
    probs = torch.tensor([[0.6, 0.2, 0.2], [0.4, 0.4, 0.2]])
    loss = load_balancing_loss(probs, torch.tensor([6, 4, 2]), top_k=2, num_tokens=6)
    assert loss.item() == pytest.approx(3 * (0.5 * 0.5 + 0.3 / 3 + 0.2 / 6))


def test_sequence_load_balancing_by_hand():
    # B=2 sequences of L=2 tokens, E=2, k=1
    # seq 0: ids [0, 0] -> f = [1, 0], P = [.75, .25] -> 2 * .75 = 1.5
    # seq 1: ids [1, 0] -> f = [.5, .5], P = [.35, .65] -> 2 * (.175 + .325) = 1.0;  mean 1.25
    probs = torch.tensor([[[0.9, 0.1], [0.6, 0.4]], [[0.2, 0.8], [0.5, 0.5]]])
    ids = torch.tensor([[[0], [0]], [[1], [0]]])
    assert sequence_load_balancing_loss(probs, ids).item() == pytest.approx(1.25)


def test_sequence_loss_differs_from_batch_loss():
    # each sequence sends everything to a different expert: the batch looks balanced (loss 1),
    # every sequence is maximally unbalanced (loss E * 1 * P_own)
    probs = torch.tensor([[[0.8, 0.2]], [[0.2, 0.8]]])
    ids = torch.tensor([[[0]], [[1]]])
    assert load_balancing_loss(probs.view(2, 2), torch.tensor([1, 1]), 1, 2).item() == pytest.approx(1.0)
    assert sequence_load_balancing_loss(probs, ids).item() == pytest.approx(1.6)


def test_z_loss_by_hand():
    # logsumexp([0, 0]) = ln 2, logsumexp([ln 3, 0]) = ln 4; mean of squares
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    want = (math.log(2.0) ** 2 + math.log(4.0) ** 2) / 2
    assert router_z_loss(logits).item() == pytest.approx(want)
    assert router_z_loss(torch.zeros(0, 3)).item() == 0.0


def test_routing_entropy_by_hand():
    probs = torch.tensor([[0.5, 0.5], [1.0, 0.0]])  # ln 2 and 0 nats (0 log 0 = 0)
    assert routing_entropy(probs).item() == pytest.approx(math.log(2.0) / 2)
