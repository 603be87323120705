"""Any elementwise torch optimizer under ZeroEngine: torch AdamW, Adam, SGD with momentum and
routing_kernels.FusedAdamW under stages 1-3 (and 0), with and without EP (ep=2 inside dp=4) and
offload, each against the unsharded single-process run of the SAME optimizer on the same global
batch; param groups (per-group lr and weight decay) carried over; whole-tensor optimizers, bad
factories and bad groups refused before any collective.

Every case uses two param groups with different learning rates and weight decay (matrices: lr,
decay; norm gains, biases and other 1-D parameters: 3 x lr, no decay), so a parameter in the wrong
group, a group's options lost or the factory ignored all change the result. A wrong gradient
scale (the 1/dp, the clip coefficient) shows in SGD, and in the Adam family through an eps near
the gradients' size; clipping is active every step (CLIP is below the gradient norms).

Tolerances (fp32): the sharded runs sum gradients in another order than one process (all-reduce or
reduce-scatter, per-rank matmul blocking), ~1e-7 relative per step, which the optimizer carries
into the weights (Adam's normalisation can magnify it for entries whose gradient is near zero).
Measured over these 6 steps: at most 2.4e-7 relative on a step's loss and 1.2e-7 absolute on
final weights of size ~0.1-1 (5.7e-7 with eps=1e-8), so 2e-6 and 5e-6 leave 8x margin or more; the
bugs planted while writing these tests (a wrong scale, a wrong group, the factory ignored) move the
weights by 1e-5 to 1e-1.

All distributed cases of one world size run inside one spawn of ranks (a spawn costs seconds of
imports on this machine); the references run once in the test process.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.distributed as dist

import routing_kernels
from moe import scale_aux_losses
from tests.support.dist import run_distributed
from tests.support.zero_nets import B_PER_RANK, CLIP, E, batches, reference_net, sharded_net
from zero import Layout, ZeroEngine

LR, WD, MOMENTUM = 1e-2, 0.1, 0.9
# Adam's eps near the clipped gradients' size (~1e-3 per element): with the usual 1e-8 its update is
# nearly invariant to the gradient's scale and would hide a wrong 1/dp or clip factor
EPS = 1e-4
STEPS, ACCUM = 6, 2
OFFLOAD_STEPS = 3  # offload changes where the step runs, which a few steps show as well as six
LOSS_RTOL, PARAM_ATOL = 2e-6, 5e-6


def make_optimizer(name: str, groups):
    """The optimizer ``name`` over ``groups`` (the engine's shard groups or the model's own)."""
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=LR, eps=EPS)
    if name == "adam":
        return torch.optim.Adam(groups, lr=LR, eps=EPS)  # weight decay as L2, added to the gradient
    if name == "sgd":
        return torch.optim.SGD(groups, lr=LR, momentum=MOMENTUM)
    if name == "fused":
        return routing_kernels.FusedAdamW(groups, lr=LR, eps=EPS)
    raise ValueError(name)


OPTIMIZERS = ("adamw", "adam", "sgd", "fused")


def model_groups(net) -> list[dict]:
    """Two groups the torch way over the model's parameters, with different lr and weight decay."""
    params = list(net.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 3 * LR},
    ]


def group_options(name, p) -> dict:
    """The same two groups as a function of (name, param)."""
    return {"weight_decay": WD} if p.dim() >= 2 else {"weight_decay": 0.0, "lr": 3 * LR}


def run_reference(opt_name: str, dp: int, steps: int = STEPS):
    """One process, the whole global batch in the same micro-batches, torch's clipping."""
    net = reference_net()
    scale_aux_losses(net, 1.0 / ACCUM)
    opt = make_optimizer(opt_name, model_groups(net))
    x, y = batches(ACCUM, dp)
    losses = []
    for s in range(steps):
        total = 0.0
        for m in range(ACCUM):
            loss = ((net(x[s, m]) - y[s, m]) ** 2).mean() / ACCUM
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in net.named_parameters()}


def run_engine(layout: Layout, opt_name: str, stage: int, steps: int = STEPS, groups_as: str = "list", **kw):
    net = sharded_net(layout)
    scale_aux_losses(net, 1.0 / ACCUM)
    groups = model_groups(net) if groups_as == "list" else group_options
    engine = ZeroEngine(
        net,
        layout,
        stage=stage,
        max_grad_norm=CLIP,
        param_groups=groups,
        optimizer=lambda g: make_optimizer(opt_name, g),
        **kw,
    )
    x, y = batches(ACCUM, layout.dp)
    rows = slice(layout.dp_rank * B_PER_RANK, (layout.dp_rank + 1) * B_PER_RANK)
    losses = []
    for s in range(steps):
        total = torch.zeros(())
        for m in range(ACCUM):
            with engine.no_sync() if m < ACCUM - 1 else contextlib.nullcontext():
                loss = ((engine(x[s, m, rows]) - y[s, m, rows]) ** 2).mean() / ACCUM
                loss.backward()  # plain autograd works as well as engine.backward
            total += loss.detach()
        engine.step()
        if layout.dp_group is not None:
            dist.all_reduce(total, group=layout.dp_group)
        losses.append(total.item() / layout.dp)
    # elements the optimizer updates on this rank: its shard of every parameter, no padding
    held = sum(t.numel() for g in engine.optimizer.param_groups for t in g["params"])
    return losses, engine.full_parameters(), type(engine.optimizer).__name__, held


def _plan(world: int):
    """(ep, optimizer, stage, offload) of one spawn: dp=2 without EP (and stage 0, the same code),
    dp=4 with ep=2 inside it (experts shard over edp=2, dense weights over dp=4)."""
    ep = 1 if world == 2 else 2
    plan = [(ep, o, s, off) for o in OPTIMIZERS for s in (1, 2, 3) for off in (False, True)]
    if world == 2:
        plan += [(ep, o, 0, False) for o in OPTIMIZERS]
    return plan


_COLLECTIVES = (
    "broadcast",
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_gather",
    "barrier",
    "all_to_all_single",
    "broadcast_object_list",
    "all_gather_object",
    "all_gather_single",
    "reduce_scatter_single",
    "reduce_scatter",
    "scatter",
    "gather",
)


@contextlib.contextmanager
def count_collectives():
    """Counts the torch.distributed collectives started inside (every call the engine makes goes
    through these module attributes)."""
    count = [0]
    saved = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}

    def wrap(fn):
        def counted(*a, **k):
            count[0] += 1
            return fn(*a, **k)

        return counted

    for n, fn in saved.items():
        setattr(dist, n, wrap(fn))
    try:
        yield count
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def _refusals_rank(layout: Layout):
    """Each bad optimizer or group raises on every rank before the engine's first collective."""
    out = {}
    cases = {  # name -> the engine's keyword arguments for a fresh net
        "adafactor": lambda net: dict(optimizer=lambda g: torch.optim.Adafactor(g, lr=LR)),
        "muon": lambda net: dict(optimizer=lambda g: torch.optim.Muon(g, lr=LR)),
        "ignores_groups": lambda net: dict(optimizer=lambda g: torch.optim.AdamW(net.parameters(), lr=LR)),
        "param_twice": lambda net: dict(
            param_groups=[{"params": list(net.parameters())}, {"params": [net.head.weight]}]
        ),
    }
    for name, make_kw in cases.items():
        net = sharded_net(layout)
        kw = make_kw(net)
        with count_collectives() as n:
            try:
                ZeroEngine(net, layout, stage=3, **kw)
                message = None
            except ValueError as e:
                message = str(e)
        out[name] = (message, n[0])
    net = sharded_net(layout)
    with count_collectives() as n:  # the counter sees a good engine's start-up broadcasts
        ZeroEngine(net, layout, stage=3, optimizer=lambda g: torch.optim.SGD(g, lr=LR))
    out["good"] = (None, n[0])
    return out


def _optim_rank(rank, world):
    out = {}
    layouts = {}
    for ep, opt_name, stage, offload in _plan(world):
        layout = layouts.setdefault(ep, Layout.build(ep=ep, num_experts=E))
        steps = OFFLOAD_STEPS if offload else STEPS
        out[(ep, opt_name, stage, offload)] = run_engine(layout, opt_name, stage, steps=steps, offload=offload)
    if world == 2:
        layout = layouts[1]
        # the groups as a function of (name, param): the same groups, the same run bit for bit
        out["callable_groups"] = (run_engine(layout, "sgd", 3, groups_as="callable"), out[(1, "sgd", 3, False)])
        out["refusals"] = _refusals_rank(layout)
    return out


@pytest.fixture(scope="module")
def references():
    return {
        (o, dp, steps): run_reference(o, dp, steps)
        for o in OPTIMIZERS
        for dp in (2, 4)
        for steps in (STEPS, OFFLOAD_STEPS)
    }


@pytest.fixture(scope="module")
def results_dp2():
    return run_distributed(_optim_rank, 2, timeout=300)


@pytest.fixture(scope="module")
def results_dp4():
    return run_distributed(_optim_rank, 4, timeout=300)


def _check_against_references(results, references, world: int) -> int:
    checked = 0
    total = sum(p.numel() for p in reference_net().parameters())
    for key in _plan(world):
        held = [out[key][3] for out in results]
        if key[2] == 0:  # replicated: every rank updates all it holds
            assert held == [sum(p.numel() for p in out[key][1].values()) for out in results], (key, held)
        else:  # the shards of all ranks together: every element of the model once
            assert sum(held) == total, (key, held, total)
    for rank, out in enumerate(results):
        for key in _plan(world):
            ep, opt_name, stage, offload = key
            losses, params, opt_type, _ = out[key]
            ref_losses, ref_params = references[(opt_name, world, len(losses))]
            assert opt_type == {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "fused": "FusedAdamW"}[opt_name], (
                key,
                opt_type,
            )
            for a, b in zip(losses, ref_losses):
                assert abs(a - b) <= LOSS_RTOL * abs(b), (key, losses, ref_losses)
            ep_rank = rank % ep  # ep groups are consecutive ranks
            L = E // ep
            for n, p in params.items():
                want = ref_params[n]
                if p.shape != want.shape:  # an expert weight: this rank's ep slice
                    want = want[ep_rank * L : (ep_rank + 1) * L]
                err = (p - want).abs().max().item()
                assert err <= PARAM_ATOL, (key, n, err)
            checked += 1
    return checked


@pytest.mark.distributed
def test_optimizers_match_unsharded_dp2_stages_0_to_3_with_and_without_offload(results_dp2, references):
    assert _check_against_references(results_dp2, references, 2) == 2 * (4 * 3 * 2 + 4)


@pytest.mark.distributed
def test_optimizers_match_unsharded_ep2_inside_dp4_with_and_without_offload(results_dp4, references):
    assert _check_against_references(results_dp4, references, 4) == 4 * 4 * 3 * 2


@pytest.mark.slow  # every optimizer's single-process reference run
def test_the_runs_train(references):
    # the comparisons above are not between frozen runs: every optimizer lowers the loss
    for o in OPTIMIZERS:
        losses, _ = references[(o, 2, STEPS)]
        assert losses[-1] < losses[0], (o, losses)


@pytest.mark.distributed
def test_groups_as_a_function_equal_groups_as_a_list(results_dp2):
    for out in results_dp2:
        (losses_f, params_f, _, _), (losses_l, params_l, _, _) = out["callable_groups"]
        assert losses_f == losses_l and all(torch.equal(params_f[n], params_l[n]) for n in params_l)


@pytest.mark.distributed
def test_refusals_come_before_any_collective_on_every_rank(results_dp2):
    for out in results_dp2:
        refusals = out["refusals"]
        assert refusals["good"][1] > 0  # the counter does see the engine's collectives
        expect = {
            "adafactor": "Adafactor cannot run under ZeroEngine: it keeps factored second moments",
            "muon": "Muon only supports 2D parameters.*cannot run under ZeroEngine",
            "ignores_groups": "none of the shard tensors it was given",
            "param_twice": r"parameter head.weight is in param_groups\[0\] and param_groups\[1\]",
        }
        for name, pattern in expect.items():
            message, collectives = refusals[name]
            assert message is not None, name
            assert re.search(pattern, message), (name, message)
            assert collectives == 0, (name, collectives)


# ----- one process: messages, groups, metadata --------------------------------------------------
class Lamb(torch.optim.SGD):
    """Stands for an optimizer the engine cannot know (LAMB scales by per-tensor norms)."""


class ElementwiseSGD(torch.optim.SGD):
    elementwise = True


class NotElementwiseSGD(torch.optim.SGD):
    elementwise = False


def test_whole_tensor_and_unknown_optimizers_are_refused_with_the_reason():
    net = reference_net()
    params = {id(p): p.data_ptr() for p in net.parameters()}
    cases = [
        (
            lambda g: torch.optim.Adafactor(g),
            r"Adafactor cannot run under ZeroEngine: it keeps factored second moments "
            r".* which need the parameter's whole 2-D tensor; ZeroEngine gives the "
            r"optimizer 1-D shard tensors",
        ),
        # Muon refuses 1-D tensors itself; the engine says where they come from
        (
            lambda g: torch.optim.Muon(g),
            "1-D fp32 shards.*Muon only supports 2D parameters.*cannot run under ZeroEngine",
        ),
        (lambda g: torch.optim.LBFGS(g), "LBFGS cannot run under ZeroEngine"),
        (
            lambda g: Lamb(g, lr=0.1),
            r"Lamb is not known to be elementwise: .* set the class attribute Lamb.elementwise = True",
        ),
        (lambda g: NotElementwiseSGD(g, lr=0.1), "NotElementwiseSGD says elementwise = False"),
    ]
    for stage in (0, 3):
        for factory, match in cases:
            with pytest.raises(ValueError, match=match):
                ZeroEngine(net, None, stage=stage, optimizer=factory)
    # a refused engine left the model alone: no parameter became a view of a flat buffer
    assert {id(p): p.data_ptr() for p in net.parameters()} == params
    engine = ZeroEngine(net, None, stage=1, optimizer=lambda g: ElementwiseSGD(g, lr=0.1))
    assert type(engine.optimizer) is ElementwiseSGD


def test_bad_factories_and_groups_are_named():
    net = reference_net()
    vec = [p for p in net.parameters() if p.dim() < 2]
    mat = [p for p in net.parameters() if p.dim() >= 2]
    bad = [
        (dict(optimizer=torch.optim.SGD(net.parameters(), lr=0.1)), "is an optimizer; pass a factory instead"),
        (dict(optimizer="adamw"), "must be a callable"),
        (dict(optimizer=lambda g: None), "the optimizer factory returned NoneType"),
        (dict(optimizer=lambda g: torch.optim.SGD(net.parameters(), lr=0.1)), "none of the shard tensors it was given"),
        (
            dict(optimizer=lambda g: torch.optim.SGD(g[:1], lr=0.1), param_groups=[{"params": mat}, {"params": vec}]),
            r"must keep the 2 param groups it is given",
        ),
        (dict(optimizer=lambda g: torch.optim.SGD(g, lr=0.1), lr=0.1), "configure the default optimizer only"),
        (dict(param_groups=[{"params": mat}]), r"parameter inp.bias is in no param group"),
        (
            dict(param_groups=[{"params": mat + vec}, {"params": vec[:1]}]),
            r"parameter inp.bias is in param_groups\[0\] and param_groups\[1\]",
        ),
        (
            dict(param_groups=[{"params": mat + vec + [torch.zeros(3, requires_grad=True)]}]),
            r"shape \(3,\) that is not a trainable parameter",
        ),
        (dict(param_groups=[{"lr": 0.1}]), r"param_groups\[0\] must be a dict with a 'params' entry"),
        (dict(param_groups={"params": mat}), "must be a list of dicts"),
        (dict(param_groups=lambda n, p: 0.1), r"param_groups\('inp.weight', \.\.\.\) returned 0.1"),
        (dict(param_groups=lambda n, p: {"params": [p]}), "without 'params'"),
    ]
    for kw, match in bad:
        with pytest.raises(ValueError, match=match):
            ZeroEngine(net, None, stage=2, **kw)


def test_param_groups_reach_the_optimizer_and_the_metadata_names_each_shard_tensor():
    net = reference_net()
    want = {n: p.detach().clone() for n, p in net.named_parameters()}
    engine = ZeroEngine(
        net, None, stage=1, param_groups=group_options, optimizer=lambda g: torch.optim.SGD(g, lr=LR, momentum=MOMENTUM)
    )
    opt = engine.optimizer
    assert [(g["lr"], g["weight_decay"], g["momentum"]) for g in opt.param_groups] == [
        (LR, WD, MOMENTUM),
        (3 * LR, 0.0, MOMENTUM),
    ]
    shapes = dict(net.named_parameters())
    decayed, plain = engine.param_group_names
    assert all(shapes[n].dim() >= 2 for n in decayed) and all(shapes[n].dim() < 2 for n in plain)
    # every optimizer tensor is described once, and holds exactly the parameter slices it says
    described = []
    for flat in engine.shard_metadata():
        for t in flat["shard_tensors"]:
            g, j = t["index"]
            tensor = opt.param_groups[g]["params"][j]
            assert (
                g == t["param_group"]
                and tensor.dim() == 1
                and tensor.numel() == t["flat_range"][1] - t["flat_range"][0]
            )
            for s in t["params"]:
                assert (s.name in decayed) == (g == 0)
                a, b = s.shard_range
                assert torch.equal(tensor[a:b], want[s.name].reshape(-1)[s.param_range[0] : s.param_range[1]])
            described.append(id(tensor))
    assert sorted(described) == sorted(id(p) for g in opt.param_groups for p in g["params"])
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == sum(p.numel() for p in want.values())
    # one lr for every group, or per group through the optimizer
    engine.lr = 0.5
    assert engine.lr == 0.5 and all(g["lr"] == 0.5 for g in opt.param_groups)
    opt.param_groups[1]["lr"] = 0.25
    with pytest.raises(AttributeError, match="different learning rates"):
        _ = engine.lr
