"""Router against the naive per-token router of tests/support/naive.py.

Shapes follow the project's legend (docs/design.md).
"""

from __future__ import annotations

import pytest
import torch

from moe import MoEConfig, Router, capacity
from tests.support.naive import naive_router

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

VARIANTS = {
    "softmax_renorm": dict(num_experts=7, top_k=2),
    "softmax_no_renorm_scaled": dict(num_experts=7, top_k=3, normalize_topk=False, route_scale=2.5),
    "topk_then_softmax": dict(num_experts=6, top_k=3, softmax_before_topk=False),
    "sigmoid": dict(num_experts=8, top_k=2, score_func="sigmoid"),
    "sigmoid_no_renorm": dict(num_experts=8, top_k=2, score_func="sigmoid", normalize_topk=False),
    "groups": dict(num_experts=12, top_k=3, num_groups=4, topk_groups=2),
    "sigmoid_groups_deepseek": dict(
        num_experts=16, top_k=4, score_func="sigmoid", num_groups=8, topk_groups=3, route_scale=2.5
    ),
    "one_expert_per_group": dict(num_experts=6, top_k=2, num_groups=6, topk_groups=3),
    "k_eq_E": dict(num_experts=5, top_k=5),
    "E1": dict(num_experts=1, top_k=1),
    "bias": dict(num_experts=8, top_k=2, expert_bias=True),
    "bias_groups_sigmoid": dict(
        num_experts=8, top_k=2, expert_bias=True, score_func="sigmoid", num_groups=4, topk_groups=2
    ),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_token_choice_matches_naive(name):
    cfg = MoEConfig(d_model=16, d_ff=8, **VARIANTS[name])
    torch.manual_seed(0)
    router = Router(cfg)
    bias = None
    if cfg.expert_bias:
        # big enough to change some choices, so the test sees selection follow the bias
        bias = torch.linspace(-0.2, 0.2, cfg.num_experts)
        router.expert_bias.copy_(bias)
    x = torch.randn(41, 16)
    routing = router(x)
    ids, w = naive_router(cfg, router.weight.detach().double(), x.double(), bias)
    # the router may list a token's k experts in any order: compare per token, sorted by expert
    got_ids, order = routing.expert_ids_TK.sort(dim=1)
    want_ids, want_order = ids.sort(dim=1)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(
        routing.weights_TK.gather(1, order).double(), w.gather(1, want_order), rtol=1e-5, atol=1e-6
    )
    assert torch.equal(routing.selected_TK, routing.expert_ids_TK)  # no capacity: nothing dropped
    assert routing.logits_TE.dtype == torch.float32


def test_group_limit_changes_the_choice():
    # without the group limit, some token would pick experts from more than topk_groups groups
    cfg = MoEConfig(d_model=16, d_ff=8, num_experts=12, top_k=4, num_groups=6, topk_groups=2)
    torch.manual_seed(1)
    router = Router(cfg)
    x = torch.randn(64, 16)
    ids = router(x).expert_ids_TK
    groups_used = torch.tensor([len(set((row // 2).tolist())) for row in ids])
    assert groups_used.max() <= 2
    free = Router(MoEConfig(d_model=16, d_ff=8, num_experts=12, top_k=4))
    free.load_state_dict(router.state_dict())
    free_groups = torch.tensor([len(set((row // 2).tolist())) for row in free(x).expert_ids_TK])
    assert free_groups.max() > 2


def test_bias_update_step():
    cfg = MoEConfig(d_model=4, d_ff=4, num_experts=4, top_k=1, expert_bias=True)
    router = Router(cfg)
    router.update_bias(torch.tensor([10, 2, 2, 2]), rate=0.1)  # mean load 4
    assert router.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.1, 0.1])
    router.update_bias(torch.tensor([4, 4, 4, 4]), rate=0.1)  # balanced: sign(0) = 0, no move
    assert router.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.1, 0.1])


def test_bf16_input_routes_in_fp32():
    cfg = MoEConfig(d_model=16, d_ff=8, num_experts=6, top_k=2)
    torch.manual_seed(2)
    router = Router(cfg).bfloat16()
    x = torch.randn(20, 16).bfloat16()
    r = router(x)
    assert r.logits_TE.dtype == torch.float32 and r.weights_TK.dtype == torch.float32
    torch.testing.assert_close(r.logits_TE, x.float() @ router.weight.float().t())


@pytest.mark.parametrize(
    "cf,k,T,E,want",
    [
        (1.0, 2, 10, 4, 5),  # 20 / 4 = 5 exactly: no rounding up
        (1.25, 1, 7, 3, 3),  # 8.75 / 3 = 2.92
        (0.1, 6, 8192, 64, 77),  # 4915.2 / 64 = 76.8
        (2.0, 2, 1, 8, 1),  # 0.5: an expert takes at least one assignment
        (1.0, 2, 0, 4, 0),  # no tokens, no capacity
        # whole numbers that the float product overshoots (1.1 * 50 / 5 = 11.000000000000002)
        (1.1, 1, 50, 5, 11),
        (0.1, 6, 50, 5, 6),  # float: 6.000000000000001
        (0.1, 6, 100, 4, 15),  # float: 15.000000000000002
        (2, 1, 9, 3, 6),  # an int capacity factor
    ],
)
def test_capacity_by_hand(cf, k, T, E, want):
    assert capacity(cf, k, T, E) == want
