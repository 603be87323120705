"""moe.hf.patch under expert parallelism (gloo ranks): the patched model against the stock one
run in one process, unpatch gathering every expert, and training under ZeRO-3 with ep=2 like one
process (tests/hf/patch_models.py builds the models; 1e-5 relative)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moe.hf as hf  # noqa: E402
from tests.hf.patch_models import (  # noqa: E402
    VOCAB,
    L,
    _assert_same_state,
    _build,
    _close,
    _Grad,
    _load_stock,
    _scaled,
    _stock_grad,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: a second thread only waits (conftest)

EP_ARCHS = ("mixtral", "qwen2_moe", "deepseek_v3")


def _ep_rank(rank, world, archs):
    # each rank: the same stock model, patched with expert parallelism over all ranks; it runs its
    # own sequence of the batch and returns what it computed
    import torch.distributed as dist

    out = {}
    for arch in archs:
        model = hf.patch(_build(arch), ep_group=dist.group.WORLD, dp_group=dist.group.WORLD)
        torch.manual_seed(1)
        ids = torch.randint(0, VOCAB, (world, L))[rank : rank + 1]
        res = model(ids, labels=ids)
        res.loss.backward()
        out[arch] = dict(
            logits=res.logits.detach(),
            loss=res.loss.detach(),
            router_logits=[r.detach() for r in getattr(res, "router_logits", ())],
            grads={n: p.grad for n, p in model.named_parameters()},
            shapes={n: tuple(p.shape) for n, p in model.named_parameters()},
        )
    return out


def _ep_unpatch_rank(rank, world, archs, tmp):
    import os

    import torch.distributed as dist

    out = {}
    for arch in archs:
        model = _scaled(hf.patch(_build(arch), ep_group=dist.group.WORLD, dp_group=dist.group.WORLD))
        # refused before anything is written or exchanged: rank 1 never calls these, so a gather
        # on rank 0 would wait for it (or pair with its next gather and corrupt the results below)
        if rank == 0:
            with pytest.raises(
                ValueError,
                match=r"expert parallelism \(ep=2\).*moe\.hf\.save_pretrained\(model, save_directory\) on every rank",
            ):
                model.save_pretrained(os.path.join(tmp, arch, "refused"))
            assert not os.path.exists(os.path.join(tmp, arch, "refused"))
            last = hf._patched_layers(model)[-1][0]
            sd = model.state_dict()
            with pytest.raises(
                ValueError, match=rf"has no '{last}\.router\.weight'"
            ):  # the last layer's: checked before the first gather
                hf.stock_state_dict(model, {k: v for k, v in sd.items() if k != f"{last}.router.weight"})
            bad = sd | {f"{last}.experts.w2": sd[f"{last}.experts.w2"][:1]}
            with pytest.raises(
                ValueError,
                match=rf"{last}\.experts\.w2 has shape \(1, \d+, \d+\): expected \(\d+, \d+, \d+\) \(every expert\)",
            ):
                hf.save_pretrained(model, os.path.join(tmp, arch, "refused"), state_dict=bad)
            assert not os.path.exists(os.path.join(tmp, arch, "refused"))
        other = hf.patch(_build(arch), ep_group=dist.group.WORLD, dp_group=dist.group.WORLD)
        other.load_state_dict(_scaled(_build(arch)).state_dict())  # all experts given; this rank's kept
        loaded = hf.stock_state_dict(other)
        given = hf.stock_state_dict(model, model.state_dict())  # this rank's slices, gathered
        gathered = hf.stock_state_dict(model)  # a collective, the model left patched
        hf.save_pretrained(model, os.path.join(tmp, arch, "saved"))  # every rank; rank 0 writes
        dist.barrier()
        out[arch] = (given, gathered, hf.unpatch(model).state_dict(), loaded)
    return out


@pytest.mark.distributed
def test_unpatch_under_expert_parallelism_gathers_every_expert(tmp_path):
    """ep=2 on 2 gloo ranks: unpatch, stock_state_dict (of the model, and of a state dict holding
    this rank's slices) and moe.hf.save_pretrained gather every expert; bad input is refused on the
    one rank that holds it, before any exchange; a stock state dict loads, each rank keeping its
    own experts."""
    from tests.support.dist import run_distributed

    results = run_distributed(_ep_unpatch_rank, 2, EP_ARCHS, str(tmp_path))
    for arch in EP_ARCHS:
        model = _scaled(_build(arch))
        want = model.state_dict()
        for r in range(2):
            given, gathered, unpatched, loaded = results[r][arch]
            _assert_same_state(unpatched, want, (arch, r, "unpatch"))
            _assert_same_state(loaded, want, (arch, r, "load_state_dict of the stock layout"))
            _assert_same_state(gathered, want, (arch, r, "stock_state_dict"))
            _assert_same_state(given, want, (arch, r, "stock_state_dict(state_dict=)"))
        _assert_same_state(_load_stock(type(model), tmp_path / arch / "saved"), want, (arch, "moe.hf.save_pretrained"))


@pytest.mark.distributed
def test_expert_parallel_patch_matches_stock():
    # 2 ranks, ep=2: rank r holds experts [r*E/2, (r+1)*E/2) and runs sequence r. Its outputs and
    # replicated weights' gradients are the stock model's on sequence r; its experts' gradients
    # are the stock gradients of the sum of both ranks' losses (tokens of both ranks reach them)
    from tests.support.dist import run_distributed

    results = run_distributed(_ep_rank, 2, EP_ARCHS)
    for arch in EP_ARCHS:
        stock = _build(arch)
        names = [n for n, _ in stock.named_parameters()]
        params = [p for _, p in stock.named_parameters()]
        torch.manual_seed(1)
        ids = torch.randint(0, VOCAB, (2, L))
        per_rank = []
        for r in range(2):
            ref = stock(ids[r : r + 1], labels=ids[r : r + 1])
            got = results[r][arch]
            _close(got["logits"], ref.logits, f"{arch} rank {r} logits")
            _close(got["loss"], ref.loss, f"{arch} rank {r} loss")
            for a, b in zip(got["router_logits"], getattr(ref, "router_logits", ()), strict=True):
                _close(a, b, f"{arch} rank {r} router logits")
            per_rank.append(dict(zip(names, torch.autograd.grad(ref.loss, params, allow_unused=True))))
        total = {n: per_rank[0][n] + per_rank[1][n] for n in names if per_rank[0][n] is not None}
        for r in range(2):
            got = results[r][arch]
            checked = set()
            for n in names:
                prefix, _, leaf = n.rpartition("mlp.")
                pnames, g = _stock_grad(n, {k: _Grad(v) for k, v in got["grads"].items()})
                checked.update(pnames)
                if leaf in ("experts.gate_up_proj", "experts.down_proj"):
                    X = got["shapes"][prefix + "mlp.experts.w2"][0]
                    lo, hi = r * X, (r + 1) * X
                    _close(g, total[n][lo:hi], f"{arch} rank {r} grad of {n}[{lo}:{hi}]")
                else:
                    _close(g, per_rank[r][n], f"{arch} rank {r} grad of {n}")
            assert checked == set(got["grads"]), sorted(set(got["grads"]) ^ checked)


ZERO_STEPS, ZERO_LR = 3, 0.5


def _zero_batch():
    torch.manual_seed(1)
    return torch.randint(0, VOCAB, (2, L))


def _zero_optimizer(groups):
    # SGD with momentum: elementwise, so the engine shards it; unlike Adam it does not magnify the
    # rounding of near-zero gradient entries into lr-sized weight differences, so the weights can be
    # held to rounding as tightly as the gradients
    return torch.optim.SGD(groups, lr=ZERO_LR, momentum=0.9)


def _zero_rank(rank, world, arch, out_dir):
    import torch.distributed as dist

    import zero

    model = _build(arch)
    num_experts = getattr(model.config, "num_experts", None) or model.config.n_routed_experts
    # DeepSeek-V3 as its run dispatched: each token to a node once (two one-rank "nodes" here)
    node = arch == "deepseek_v3"
    layout = zero.Layout.build(
        ep=2, num_experts=num_experts, node_size=1 if node else None, ep_dispatch="node" if node else "flat"
    )
    hf.patch(model, ep_group=layout.ep_group, dp_group=layout.dp_group, ep_node_groups=layout.ep_node_groups)
    engine = zero.ZeroEngine(model, layout, stage=3, blocks=list(model.model.layers), optimizer=_zero_optimizer)
    ids = _zero_batch()[rank : rank + 1]  # this rank's share of the global batch
    losses, grads = [], []
    for _ in range(ZERO_STEPS):
        loss = model(ids, labels=ids).loss
        engine.backward(loss)
        grads.append(engine.full_gradients())
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    # the way out (README): the model's buffers and the engine's gathered weights (this rank's
    # experts), saved by every rank; the experts are gathered over ep and rank 0 writes
    trained = engine.full_parameters()
    hf.save_pretrained(model, out_dir, state_dict=model.state_dict() | trained)
    dist.barrier()
    return dict(losses=losses, grads=grads, shapes={n: tuple(t.shape) for n, t in trained.items()})


@pytest.mark.distributed
@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])  # a gated shared expert; the correction bias, a buffer
def test_patched_model_trains_under_zero3_with_expert_parallelism_like_one_process_and_saves_pretrained(arch, tmp_path):
    """The whole road a user takes: patch a transformers model with ep=2, train it under ZeRO-3 on 2
    gloo ranks (each rank one sequence of the global batch), save it with moe.hf.save_pretrained; against
    the stock model trained in one process on the whole batch. Every step's loss and every gradient
    (the engine's synchronised ones, an ep slice of the experts on each rank) within 1e-5, and the
    saved model's weights within 1e-5 of the reference's (SGD: rounding of the gradients only)."""
    from tests.support.dist import run_distributed

    results = run_distributed(_zero_rank, 2, arch, str(tmp_path))
    stock = _build(arch)
    opt = torch.optim.SGD(stock.parameters(), lr=ZERO_LR, momentum=0.9)
    ids = _zero_batch()
    for step in range(ZERO_STEPS):
        opt.zero_grad(set_to_none=True)
        loss = (stock(ids[:1], labels=ids[:1]).loss + stock(ids[1:], labels=ids[1:]).loss) / 2
        loss.backward()
        for r in range(2):
            got = results[r]
            _close(torch.tensor(got["losses"][step]), loss.detach(), f"rank {r} loss of step {step}")
            grads = {k: _Grad(v) for k, v in got["grads"][step].items()}
            for name, p in stock.named_parameters():
                g, want = _stock_grad(name, grads)[1], p.grad
                if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # this rank's experts
                    X = got["shapes"][name.rpartition("mlp.")[0] + "mlp.experts.w2"][0]
                    want = want[r * X : (r + 1) * X]
                _close(g, want, f"rank {r} step {step} grad of {name}")
        opt.step()
    saved = type(stock).from_pretrained(tmp_path, attn_implementation="eager").float()
    want = stock.state_dict()
    assert list(saved.state_dict()) == list(want)
    for name, t in saved.state_dict().items():
        _close(t, want[name], f"saved {name}")
