"""Rank functions for the expert-parallel tests (module level so spawned ranks can import them).

Every case builds the single-process layer from a seed, builds the sharded layer on the layout and
copies the same weights into it (experts sliced by ep rank), runs the rank's slice of one global
batch and returns what the test compares with the single-process run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from moe import MoEConfig, MoELayer
from routing_kernels.runtime import expert_shard
from zero import Layout, ZeroEngine


def copy_full_into_sharded(sharded: nn.Module, full: nn.Module) -> None:
    """Load a single-process model's weights into its expert-parallel twin."""
    full_state = full.state_dict()
    with torch.no_grad():
        for name, p in sharded.named_parameters():
            src = full_state[name]
            mark = expert_shard(p)
            if mark is not None:
                src = src[mark.offset : mark.offset + p.shape[0]]
            p.copy_(src)


def global_batch(n, d, seed=1):
    # inputs vary with the seed; targets come from one fixed teacher, so there is something to learn
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    teacher = torch.linspace(-1, 1, d).unsqueeze(1)
    return x, torch.tanh(x @ teacher) + 0.5 * torch.sin(2 * x[:, :1])


def skew_router(layer: MoELayer, experts: list[int]) -> None:
    # logits of the chosen experts dominate for every token: extreme routing on purpose
    with torch.no_grad():
        w = layer.router.weight
        w.mul_(0.01)
        for e in experts:
            w[e] += 5.0 * torch.sign(torch.arange(w.shape[1], dtype=w.dtype) % 2 - 0.5)
    # inputs of the skew cases are positive in odd dims, negative in even dims


def _rows_sent_off_node(layout: Layout, calls: list) -> int:
    """Rows the layer's first All-to-All (the dispatch: over the inter group under
    ``ep_dispatch="node"``, else the ep group) sent to ranks on other nodes."""
    x, splits, group = calls[0]
    ranks = dist.get_process_group_ranks(group)
    return sum(n for r, n in zip(ranks, splits) if r // layout.node_size != layout.node_rank)


def _rows_one_per_node(layout: Layout, expert_ids_TK: torch.Tensor, num_experts: int) -> int:
    """Naively, what node dispatch must send off-node: each token once to each other node holding
    one of its kept slots."""
    per_node = num_experts // (layout.ep // layout.node_size)
    total = 0
    for ids in expert_ids_TK.tolist():
        nodes = {e // per_node for e in ids if e >= 0}
        total += len(nodes - {layout.node_rank % (layout.ep // layout.node_size)})
    return total


def layer_case(layout: Layout, cfg: MoEConfig, T_local: int, skew: list[int] | None = None):
    import moe.dispatch

    torch.manual_seed(0)
    full = MoELayer(cfg)
    if skew is not None:
        skew_router(full, skew)
    layer = MoELayer(cfg, ep_group=layout.ep_group, dp_group=layout.dp_group, ep_node_groups=layout.ep_node_groups)
    copy_full_into_sharded(layer, full)
    routed, calls = [], []
    layer.router.register_forward_hook(lambda m, a, out: routed.append(out.expert_ids_TK.clone()))
    original = moe.dispatch.all_to_all

    def recording(x, output_splits, input_splits, group):
        calls.append((x, list(input_splits), group))
        return original(x, output_splits, input_splits, group)

    moe.dispatch.all_to_all = recording
    # stage 0: the plain data-parallel reduction (dense mean over dp, experts summed over edp / dp)
    engine = ZeroEngine(layer, layout, stage=0)
    x, _ = global_batch(layout.dp * T_local, cfg.d_model)
    if skew is not None:
        x = x.abs() * torch.sign(torch.arange(cfg.d_model) % 2 - 0.5)
    r = layout.dp_rank
    x_local = x[r * T_local : (r + 1) * T_local].clone().requires_grad_(True)
    try:
        y = layer(x_local)
    finally:
        moe.dispatch.all_to_all = original
    # each rank's loss is the mean over its own tokens; with dp-averaged gradients this is the
    # global mean, the single-process loss
    c = torch.linspace(-1, 1, cfg.d_model)
    loss = (y * c).sum(-1).square().mean()
    engine.backward(loss)
    # dx of a rank's own tokens is unaffected by averaging: scale back to the global-mean loss
    return {
        "y": y.detach(),
        "dx": x_local.grad / layout.dp,
        "grads": engine.full_gradients(),  # what one process would hold on the global batch
        "expert_offset": layer.experts.expert_offset,
        "stats": layer.stats.as_dict(),
        "sent_off_node": _rows_sent_off_node(layout, calls) if calls else 0,
        "one_per_node": _rows_one_per_node(layout, routed[0], cfg.num_experts) if layout.ep_dispatch == "node" else 0,
        "slots_off_node": _rows_one_per_slot_off_node(layout, routed[0], cfg.num_experts) if layout.ep > 1 else 0,
    }


def _rows_one_per_slot_off_node(layout: Layout, expert_ids_TK: torch.Tensor, num_experts: int) -> int:
    """What the flat dispatch sends off-node: a row for each kept slot whose expert lies there."""
    per_rank = num_experts // layout.ep
    ep_base = layout.rank - layout.ep_rank
    owner = [(ep_base + e // per_rank) // layout.node_size for e in range(num_experts)]
    return sum(1 for ids in expert_ids_TK.tolist() for e in ids if e >= 0 and owner[e] != layout.node_rank)


class TinyMoENet(nn.Module):
    def __init__(self, cfg: MoEConfig, d_in: int, ep_group=None, dp_group=None, ep_node_groups=None):
        super().__init__()
        self.inp = nn.Linear(d_in, cfg.d_model)
        self.moe = MoELayer(cfg, ep_group=ep_group, dp_group=dp_group, ep_node_groups=ep_node_groups)
        self.out = nn.Linear(cfg.d_model, 1)

    def forward(self, x):
        h = self.inp(x)
        return self.out(h + self.moe(h))


def train_case(layout: Layout, cfg: MoEConfig, steps: int, global_bs: int, max_norm: float | None, d_in: int = 8):
    torch.manual_seed(0)
    full = TinyMoENet(cfg, d_in)
    model = TinyMoENet(cfg, d_in, layout.ep_group, layout.dp_group, layout.ep_node_groups)
    copy_full_into_sharded(model, full)
    # the stage-0 engine (plain data parallelism) with the reference's optimizer
    engine = ZeroEngine(
        model,
        layout,
        stage=0,
        max_grad_norm=max_norm,
        optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.01),
    )
    local = global_bs // layout.dp
    losses, norms = [], []
    for step in range(steps):
        x, t = global_batch(global_bs, d_in, seed=100 + step)
        r = layout.dp_rank
        x, t = x[r * local : (r + 1) * local], t[r * local : (r + 1) * local]
        loss = (model(x) - t).square().mean()
        loss.backward()
        norm = engine.step()  # reduce, clip, AdamW; the norm before clipping
        if max_norm is not None:
            norms.append(norm)
        reported = loss.detach().clone()
        if layout.dp_group is not None:
            dist.all_reduce(reported, group=layout.dp_group)
        losses.append(reported.item() / layout.dp)
    return {
        "losses": losses,
        "norms": norms,
        "params": engine.full_parameters(),
        "expert_offset": model.moe.experts.expert_offset,
    }


def ep_rank_fn(rank, world, plan):
    """Runs every (kind, kwargs) of ``plan`` on one layout and returns the results in order."""
    out = []
    layouts = {}
    for kind, kw in plan:
        if kind == "bad_layout":
            out.append(bad_layout_fn(rank, world, **kw))
            continue
        if kind == "init":
            layout = layouts.setdefault(kw["ep"], Layout.build(ep=kw["ep"]))
            torch.manual_seed(0)
            model = TinyMoENet(kw["cfg"], 8, layout.ep_group, layout.dp_group)
            out.append(
                {
                    "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                    "expert_offset": model.moe.experts.expert_offset,
                }
            )
            continue
        if kind == "mismatch":
            out.append(config_mismatch_fn(rank, world))
            continue
        ep = kw.pop("ep")
        # ep_dispatch="node" on nodes of node_size ranks (the default: one node, the flat dispatch)
        key = (ep, kw.pop("node_size", None), kw.pop("dispatch", "flat"))
        if key not in layouts:
            layouts[key] = Layout.build(ep=ep, node_size=key[1], ep_dispatch=key[2])
        layout = layouts[key]
        if kind == "layer":
            out.append(layer_case(layout, **kw))
        elif kind == "train":
            out.append(train_case(layout, **kw))
    return out


def bad_layout_fn(rank, world, ep, num_experts, **kw):
    try:
        Layout.build(ep=ep, num_experts=num_experts, **kw)
    except ValueError as e:
        return str(e)
    return None


def config_mismatch_fn(rank, world):
    from zero import check_same_on_all_ranks

    try:
        check_same_on_all_ranks(f"lr: {0.1 if rank == 0 else 0.2}")
    except RuntimeError as e:
        return str(e)
    return None


def dead_rank_fn(rank, world, how: str, timeout_s: float, group_kind: str = "world"):
    """Rank 1 fails mid-run while rank 0 waits in a collective, under the project's own collective
    timeout: the process group comes from ``zero.init_distributed(timeout_s=...)`` (what
    ``parallel.timeout_s`` sets in the trainer). ``how``: ``"dies"`` (the process exits, as a crash
    or an OOM kill does) or ``"stalls"`` (alive, never joins: only the timeout can end the wait).
    ``group_kind``: the collective runs on the default group (``"world"``) or on the expert-parallel
    group ``zero.Layout.build`` creates (``"ep"``), which must carry the same timeout.
    Returns rank 0's error and how long it waited."""
    import os
    import time

    from zero import Layout, init_distributed

    assert init_distributed(timeout_s=timeout_s)
    group = None if group_kind == "world" else Layout.build(ep=world).ep_group
    t = torch.ones(1)
    dist.all_reduce(t, group=group)  # both ranks connected and working: what follows happens mid-run
    assert t.item() == world
    if rank == 1:
        time.sleep(0.5)  # rank 0 is inside the next all_reduce by now (if not, it fails on entering)
        if how == "dies":
            os._exit(1)
        time.sleep(timeout_s + 2)  # past rank 0's timeout
        return "stalled"
    start = time.monotonic()
    try:
        dist.all_reduce(t, group=group)
    except Exception as e:  # gloo raises RuntimeError
        return {"error": f"{type(e).__name__}: {e}", "after_s": time.monotonic() - start}
    return {"error": None, "after_s": time.monotonic() - start}
