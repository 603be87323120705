"""MoEConfig validates itself: a bad value fails with a ValueError naming it and the valid range."""

from __future__ import annotations

import pytest

from moe import MoEConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

BASE = dict(d_model=16, d_ff=32)

BAD = [
    # (overrides, words the message must contain)
    (dict(num_experts=4, top_k=5), ["top_k=5", "num_experts=4"]),
    (dict(top_k=0), ["top_k=0", "[1, num_experts=8]"]),
    (dict(num_experts=0, top_k=1), ["num_experts=0", ">= 1"]),
    (dict(capacity_factor=0.0), ["capacity_factor=0.0", "> 0"]),
    (dict(capacity_factor=-1.5), ["capacity_factor=-1.5", "> 0"]),
    (dict(num_experts=8, num_groups=3, topk_groups=1), ["num_groups=3", "divisor of num_experts=8"]),
    (dict(num_experts=8, num_groups=4, topk_groups=5), ["topk_groups=5", "[1, num_groups=4]"]),
    (dict(num_experts=8, num_groups=4), ["num_groups=4", "together"]),
    (dict(num_experts=8, top_k=5, num_groups=4, topk_groups=2), ["top_k=5", "4"]),
    (dict(score_func="relu"), ["score_func='relu'", "softmax", "sigmoid"]),
    (dict(score_func="sigmoid", softmax_before_topk=False), ["softmax_before_topk", "softmax"]),
    (dict(activation="relu"), ["activation='relu'", "swiglu"]),
    (dict(router="hash"), ["router='hash'", "expert_choice"]),
    (dict(drop_policy="random"), ["drop_policy='random'", "position"]),
    (dict(d_model=0), ["d_model=0", "positive"]),
    (dict(d_ff=-4), ["d_ff=-4", "positive"]),
    (dict(route_scale=0.0), ["route_scale=0.0", "> 0"]),
    (dict(aux_loss_coef=-0.1), ["aux_loss_coef=-0.1", ">= 0"]),
    (dict(num_shared_experts=-1), ["num_shared_experts=-1", ">= 0"]),
    (dict(router="expert_choice", expert_bias=True), ["expert_bias", "token_choice"]),
]


@pytest.mark.parametrize("overrides,words", BAD, ids=[str(o) for o, _ in BAD])
def test_bad_value_raises_and_names_it(overrides, words):
    with pytest.raises(ValueError) as info:
        MoEConfig(**{**BASE, **overrides})
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{w!r} missing from: {msg}"


def test_good_configs_pass():
    MoEConfig(**BASE, num_experts=1, top_k=1)
    MoEConfig(**BASE, num_experts=6, top_k=6)
    MoEConfig(**BASE, num_experts=16, top_k=4, num_groups=8, topk_groups=2, score_func="sigmoid")
    MoEConfig(**BASE, capacity_factor=0.01, drop_policy="position")


def test_from_dict_round_trip_and_unknown_keys():
    cfg = MoEConfig(**BASE, num_experts=4, top_k=1, capacity_factor=1.25)
    assert MoEConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown MoEConfig keys \\['topk'\\]"):
        MoEConfig.from_dict({**BASE, "topk": 2})
