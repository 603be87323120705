"""Expert parallelism on 2 and 4 gloo ranks against the single-process run of the same global batch.

Tolerances: fp32 throughout; the sharded run does the same arithmetic per row but sums gradients
in a different order (all-reduce, per-rank matmul blocking), so results agree to ~1e-6 relative,
and to ~1e-5 after 20 Adam steps, whose normalisation amplifies last-bit differences of tiny
gradients.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from moe import MoEConfig, MoELayer
from tests.support.dist import RankExited, run_distributed
from tests.support.ep_cases import (
    TinyMoENet,
    copy_full_into_sharded,
    dead_rank_fn,
    ep_rank_fn,
    global_batch,
    skew_router,
)

RTOL, ATOL = 1e-5, 1e-6


def cfg(**kw):
    base = dict(d_model=12, d_ff=20, num_experts=8, top_k=2, z_loss_coef=1e-3, aux_loss_coef=1e-2)
    base.update(kw)
    return MoEConfig(**base)


def reference_layer(c: MoEConfig, T: int, skew=None):
    torch.manual_seed(0)
    layer = MoELayer(c)
    if skew is not None:
        skew_router(layer, skew)
    x, _ = global_batch(T, c.d_model)
    if skew is not None:
        x = x.abs() * torch.sign(torch.arange(c.d_model) % 2 - 0.5)
    x.requires_grad_(True)
    y = layer(x)
    loss = (y * torch.linspace(-1, 1, c.d_model)).sum(-1).square().mean()
    loss.backward()
    return {
        "y": y.detach(),
        "dx": x.grad,
        "grads": {n: p.grad for n, p in layer.named_parameters()},
        "stats": layer.stats.as_dict(),
    }


def check_layer(results, ref, num_local):
    torch.testing.assert_close(torch.cat([r["y"] for r in results]), ref["y"], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(torch.cat([r["dx"] for r in results]), ref["dx"], rtol=RTOL, atol=ATOL)
    for name, g_ref in ref["grads"].items():
        for r in results:
            g = r["grads"][name]
            if name.startswith("experts."):
                off = r["expert_offset"]
                g_ref_local = g_ref[off : off + num_local]
            else:
                g_ref_local = g_ref
            torch.testing.assert_close(g, g_ref_local, rtol=RTOL, atol=ATOL, msg=f"gradient of {name}")
    for r in results:
        assert r["stats"]["tokens_per_expert"] == ref["stats"]["tokens_per_expert"]
        assert r["stats"]["dropped_fraction"] == pytest.approx(ref["stats"]["dropped_fraction"])
        assert r["stats"]["aux_loss"] == pytest.approx(ref["stats"]["aux_loss"], rel=1e-5)
        assert r["stats"]["z_loss"] == pytest.approx(ref["stats"]["z_loss"], rel=1e-5)


LAYER_CASES_2 = [
    ("dropless", cfg(), 13, None),
    ("capacity_probs", cfg(capacity_factor=1.0, drop_policy="probs"), 11, None),
    ("capacity_position", cfg(capacity_factor=0.75, drop_policy="position"), 11, None),
    # every token to experts 0 and 1, both on rank 0: rank 1 receives nothing, 6 experts empty
    ("all_to_one_rank", cfg(), 9, [0, 1]),
    ("k_equals_E_gelu_shared", cfg(num_experts=4, top_k=4, activation="gelu", num_shared_experts=1), 5, None),
    ("sigmoid_groups_bias", cfg(score_func="sigmoid", num_groups=4, topk_groups=2, expert_bias=True), 7, None),
    ("expert_choice", cfg(router="expert_choice", capacity_factor=1.0), 10, None),
    ("one_token_per_rank", cfg(), 1, None),
]


@pytest.mark.distributed
def test_ep2_layer_and_training_match_single_process_and_bad_input_fails_on_every_rank():
    # one launch of ranks runs many cases: spawning ranks costs seconds of imports each time
    train_cfg = cfg(d_model=8, d_ff=12, num_experts=4)
    plan = [("layer", dict(ep=2, cfg=c, T_local=T, skew=skew)) for _, c, T, skew in LAYER_CASES_2]
    plan += [
        ("train", dict(ep=2, cfg=train_cfg, steps=20, global_bs=16, max_norm=0.5)),
        ("bad_layout", dict(ep=2, num_experts=5)),
        ("mismatch", {}),
    ]
    results = run_distributed(ep_rank_fn, 2, plan)
    n = len(LAYER_CASES_2)
    check_training([r[n] for r in results], train_cfg, 20, 16, 0.5)
    for r in results:
        assert r[n + 1] is not None and "num_experts=5" in r[n + 1]
        assert r[n + 2] is not None and "ranks [1]" in r[n + 2]
    for i, (name, c, T, skew) in enumerate(LAYER_CASES_2):
        ref = reference_layer(c, 2 * T, skew)
        per_rank = [results[r][i] for r in range(2)]
        try:
            check_layer(per_rank, ref, c.num_experts // 2)
        except AssertionError as e:
            raise AssertionError(f"case {name}: {e}") from e
    # the skewed case really did starve rank 1
    skew_idx = [n for n, *_ in LAYER_CASES_2].index("all_to_one_rank")
    assert results[0][skew_idx]["stats"]["tokens_per_expert"][2:] == [0] * 6


@pytest.mark.distributed
def test_ep4_and_ep2_in_dp4_layer_and_training():
    c = cfg()
    train_cfg = cfg(d_model=8, d_ff=12, num_experts=4)
    plan = [
        ("bad_layout", dict(ep=3, num_experts=8)),
        ("layer", dict(ep=4, cfg=c, T_local=6, skew=None)),
        ("layer", dict(ep=4, cfg=cfg(capacity_factor=1.0), T_local=6, skew=None)),
        ("layer", dict(ep=2, cfg=c, T_local=6, skew=None)),
        ("train", dict(ep=2, cfg=train_cfg, steps=20, global_bs=16, max_norm=0.5)),
        # capacity decides over the whole dp batch, not only the ep group's tokens
        ("layer", dict(ep=2, cfg=cfg(capacity_factor=1.0, drop_policy="position"), T_local=6, skew=None)),
        ("init", dict(ep=2, cfg=train_cfg)),
    ]
    raw = run_distributed(ep_rank_fn, 4, copy.deepcopy(plan))
    # a layout that does not divide stops every rank with the numbers, before any collective
    for r in raw:
        assert r[0] is not None and "ep=3" in r[0] and "dp=4" in r[0]
    results = [r[1:] for r in raw]
    check_layer([results[r][0] for r in range(4)], reference_layer(c, 24), 2)
    check_layer([results[r][1] for r in range(4)], reference_layer(cfg(capacity_factor=1.0), 24), 2)
    check_layer([results[r][2] for r in range(4)], reference_layer(c, 24), 4)
    check_training([results[r][3] for r in range(4)], train_cfg, steps=20, global_bs=16, max_norm=0.5)
    check_layer(
        [results[r][4] for r in range(4)], reference_layer(cfg(capacity_factor=1.0, drop_policy="position"), 24), 4
    )
    assert results[0][4]["stats"]["dropped_fraction"] > 0  # the capacity case really dropped
    check_same_init([results[r][5] for r in range(4)], train_cfg)


NODE_CASES_4 = [
    # (name, cfg, tokens per rank, skew, ep, node_size)
    ("dropless_2x2", cfg(), 7, None, 4, 2),
    ("capacity_2x2", cfg(capacity_factor=0.75, drop_policy="position"), 6, None, 4, 2),
    # the groups are the nodes: every token goes to one node only
    ("groups_are_nodes_2x2", cfg(score_func="sigmoid", num_groups=2, topk_groups=1, top_k=3), 6, None, 4, 2),
    ("all_to_one_node_2x2", cfg(), 5, [0, 1], 4, 2),
    ("k_equals_E_shared_2x2", cfg(num_experts=4, top_k=4, num_shared_experts=1), 3, None, 4, 2),
    ("one_token_per_rank_2x2", cfg(), 1, None, 4, 2),
    # one rank a node: the node's experts run where the token lands (no exchange inside the node)
    ("dropless_4x1", cfg(), 6, None, 4, 1),
    ("dropless_ep2_in_dp4_2x1", cfg(), 6, None, 2, 1),
]


@pytest.mark.distributed
def test_node_dispatch_matches_single_process_and_sends_each_token_to_a_node_once():
    train_cfg = cfg(d_model=8, d_ff=12, num_experts=4)
    plan = [
        # the ep group inside one node, or not whole nodes: refused with the numbers before any group
        ("bad_layout", dict(ep=2, num_experts=8, node_size=2, ep_dispatch="node")),
        ("bad_layout", dict(ep=4, num_experts=8, node_size=4, ep_dispatch="node")),
        ("bad_layout", dict(ep=4, num_experts=8, node_size=2, ep_dispatch="nodes")),
    ]
    plan += [
        ("layer", dict(ep=ep, node_size=ns, dispatch="node", cfg=c, T_local=T, skew=skew))
        for _, c, T, skew, ep, ns in NODE_CASES_4
    ]
    # the flat dispatch of the first case on the same nodes, for its rows off the node
    plan += [("layer", dict(ep=4, node_size=2, dispatch="flat", cfg=cfg(), T_local=7, skew=None))]
    plan += [("train", dict(ep=4, node_size=2, dispatch="node", cfg=train_cfg, steps=20, global_bs=16, max_norm=0.5))]
    raw = run_distributed(ep_rank_fn, 4, plan)
    for r in raw:
        assert "ep_dispatch=node" in r[0] and "ep=2, node_size=2" in r[0]
        assert "ep_dispatch=node" in r[1] and "ep=4, node_size=4" in r[1]
        assert "ep_dispatch='nodes' is invalid" in r[2] and "'flat'" in r[2]
    results = [r[3:] for r in raw]
    for i, (name, c, T, skew, ep, _) in enumerate(NODE_CASES_4):
        per_rank = [results[r][i] for r in range(4)]
        try:
            check_layer(per_rank, reference_layer(c, 4 * T, skew), c.num_experts // ep)
        except AssertionError as e:
            raise AssertionError(f"case {name}: {e}") from e
        # each token crossed to each other node it needs exactly once
        for r in per_rank:
            assert r["sent_off_node"] == r["one_per_node"], (name, r["sent_off_node"], r["one_per_node"])
            assert r["one_per_node"] <= r["slots_off_node"]
    n = len(NODE_CASES_4)
    node, flat = [results[r][0] for r in range(4)], [results[r][n] for r in range(4)]
    # the flat dispatch sends a row per slot; node dispatch fewer, here where a token's two slots share a node
    assert [r["sent_off_node"] for r in flat] == [r["slots_off_node"] for r in flat]
    assert sum(r["sent_off_node"] for r in node) < sum(r["sent_off_node"] for r in flat)
    groups = [results[r][2] for r in range(4)]
    # 3 slots on one node: a row where the flat dispatch sends 3 (2 or 3: a slot may land on the sender)
    assert 2 * sum(r["one_per_node"] for r in groups) <= sum(r["slots_off_node"] for r in groups)
    assert sum(r["one_per_node"] for r in groups) > 0
    check_training([results[r][n + 1] for r in range(4)], train_cfg, steps=20, global_bs=16, max_norm=0.5)


def check_same_init(results, c):
    # a seed gives the same model on every layout: each rank's experts are its slice of the
    # single-process experts, and every other weight (built after the experts) is identical
    torch.manual_seed(0)
    full = dict(TinyMoENet(c, 8).named_parameters())
    for r in results:
        L = r["params"]["moe.experts.w1"].shape[0]
        for name, p in r["params"].items():
            ref = full[name].detach()
            if name.startswith("moe.experts."):
                ref = ref[r["expert_offset"] : r["expert_offset"] + L]
            assert torch.equal(p, ref), name


def single_process_training(c, steps, global_bs, max_norm, d_in=8):
    torch.manual_seed(0)
    model = TinyMoENet(c, d_in)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses, norms = [], []
    for step in range(steps):
        x, t = global_batch(global_bs, d_in, seed=100 + step)
        loss = (model(x) - t).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if max_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        losses.append(loss.item())
    return losses, norms, {n: p.detach() for n, p in model.named_parameters()}


def check_training(results, c, steps, global_bs, max_norm):
    ref_losses, ref_norms, ref_params = single_process_training(c, steps, global_bs, max_norm)
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5)
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-5)
        L = r["params"]["moe.experts.w1"].shape[0]
        for name, p in r["params"].items():
            ref = ref_params[name]
            if name.startswith("moe.experts."):
                ref = ref[r["expert_offset"] : r["expert_offset"] + L]
            torch.testing.assert_close(p, ref, rtol=1e-4, atol=1e-5, msg=f"final {name}")
    # the loss went down: the comparison is not between two frozen runs
    assert ref_losses[-1] < ref_losses[0]


DEAD_RANK_TIMEOUT_S = 5.0  # the collective timeout under test: seconds, well above a loaded machine's scheduling delays


@pytest.mark.distributed
@pytest.mark.parametrize("how,group_kind", [("dies", "world"), ("stalls", "world"), ("stalls", "ep")])
def test_dead_rank_ends_collective_with_error(how, group_kind):
    # run_distributed returns only once every rank has returned or exited: had the project's path
    # not ended rank 0's wait, its own timeout (120 s, far above what is asserted) would have
    # raised TimeoutError instead. "ep": a group Layout.build made (torch's default for a new group
    # would be 30 minutes)
    out = run_distributed(
        dead_rank_fn, 2, how, DEAD_RANK_TIMEOUT_S, group_kind, init=False, allow_exit=True, timeout=120
    )
    survivor = out[0]
    assert survivor["error"] is not None, f"rank 0's collective returned although rank 1 {how}"
    if how == "dies":
        assert isinstance(out[1], RankExited) and out[1].exitcode == 1, out[1]
        # gloo sees the closed connection: the error names the dead peer, before the timeout
        assert re.search(r"closed by peer|Connection reset|remote worker crash", survivor["error"]), survivor["error"]
        assert survivor["after_s"] < DEAD_RANK_TIMEOUT_S, survivor
    else:
        assert out[1] == "stalled"
        # only the project's collective timeout can end this wait, and it does, on time (the upper
        # bound leaves a loaded machine seconds to schedule the waiting thread)
        assert re.search(r"[Tt]imed out|[Tt]imeout", survivor["error"]), survivor["error"]
        assert 0.9 * DEAD_RANK_TIMEOUT_S <= survivor["after_s"] < 30, survivor


def test_unsharded_copy_helper_is_identity_for_one_process():
    c = cfg()
    torch.manual_seed(0)
    a = TinyMoENet(c, 8)
    torch.manual_seed(1)
    b = TinyMoENet(c, 8)
    copy_full_into_sharded(b, a)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
