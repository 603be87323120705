"""torch.compile of the MoE path on the CPU: graph breaks per block, compiled against eager (forward,
every gradient, statistics, a training curve), activation checkpointing, expert parallelism's one
isolated host read, and the routing's traced graph (no scatter into an empty tensor: Inductor
misordered one).

The compiled runs use the ``aot_eager`` backend: dynamo and AOTAutograd trace, functionalise and
partition the graph exactly as for Inductor, but the graph then runs eager aten kernels, so a
graph break, a trace-time constant or a wrong fake shape shows, in seconds instead of the minutes
Inductor's C++ compile takes on this machine. Tolerances are 1e-5 (relative to each tensor's
largest entry, fp32): AOTAutograd may decompose an op into others that sum in another order
(measured here: bit-identical; Inductor's fused kernels on the same model: 2e-7 forward, 5e-7
gradients); a wrong gradient or a statistic counted twice is off by far more.
"""

import copy
import dataclasses

import pytest
import torch
import torch._dynamo
import torch.nn as nn

import routing_kernels as rk
from moe import MoEConfig, MoELayer, Transformer, TransformerConfig

# slow: dynamo and AOTAutograd trace each model for seconds (pyproject.toml's markers)
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # tests/conftest.py

TOL = 1e-5  # see the module docstring


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # each test compiles its own models: dynamo's caches (and its per-function recompile limit,
    # past which it would silently run eager) start empty
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


MOE = {
    # Mixtral: dropless token choice, softmax then top-2
    "dropless": MoEConfig(d_model=32, d_ff=32, num_experts=4, top_k=2, z_loss_coef=1e-2),
    # Switch: top-1 under a capacity, the latest tokens dropped
    "capacity": MoEConfig(d_model=32, d_ff=32, num_experts=4, top_k=1, capacity_factor=1.0, drop_policy="position"),
    # DeepSeek-V3-like: sigmoid scores, groups, aux-loss-free bias, a gated shared expert, the
    # sequence balancing loss, capacity by weight
    "deepseek": MoEConfig(
        d_model=32,
        d_ff=16,
        num_experts=8,
        top_k=3,
        score_func="sigmoid",
        num_groups=4,
        topk_groups=2,
        route_scale=2.5,
        expert_bias=True,
        num_shared_experts=1,
        shared_expert_gate=True,
        seq_aux_loss_coef=1e-2,
        capacity_factor=1.25,
    ),
    # expert choice (every expert takes its top-C tokens)
    "expert_choice": MoEConfig(d_model=32, d_ff=32, num_experts=4, top_k=2, router="expert_choice", activation="gelu"),
}


def _model(kind: str, **kw) -> Transformer:
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=16, moe=MOE[kind], **kw
    )
    return Transformer(cfg)


def _ids(seed=0):
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))


def _graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).abs().max() <= TOL * max(1.0, float(a.abs().max())))


GROUPED_MM = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")


@pytest.mark.parametrize(
    "kind, backend",
    [(kind, "cpu_blocks") for kind in MOE]
    # the GPU's path (torch runs _grouped_mm on the CPU too): its recomputing activation function
    + [pytest.param("dropless", "grouped_mm", marks=GROUPED_MM)],
)
def test_no_graph_break_in_a_block(kind, backend):
    # the whole 2-block model (attention, router, statistics, losses, the expert op) is one graph
    model = _model(kind)
    if backend == "grouped_mm":  # its fake (meta) kernel takes bf16 only, as on the GPU
        model = model.to(torch.bfloat16)
    with rk.use_expert_backend(backend):
        explained = torch._dynamo.explain(model)(_ids())
    reasons = [b.reason for b in explained.break_reasons]
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), reasons


class _Tap(nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, logits):
        return logits


@pytest.mark.parametrize(
    "kind, backend",
    [
        ("dropless", "cpu_blocks"),
        ("capacity", "cpu_blocks"),
        ("deepseek", "cpu_blocks"),
        pytest.param("dropless", "grouped_mm", marks=GROUPED_MM),
        pytest.param("expert_choice", "grouped_mm", marks=GROUPED_MM),  # GELU
        # the reference loop reads the counts on the host: a graph break
        # inside the layer, whose aux-loss gradient must survive it
        ("capacity", "loop"),
    ],
)
def test_compiled_block_equals_eager(kind, backend):
    eager = _model(kind)
    if backend == "grouped_mm":  # its fake (meta) kernel takes bf16 only, as on the GPU
        eager = eager.to(torch.bfloat16)
    compiled = copy.deepcopy(eager)
    compiled.compile_blocks(backend="aot_eager")
    taps = []
    for model in (eager, compiled):
        for layer in model.moe_layers():
            layer.router_logits_tap = _Tap()
            layer.router_logits_tap.register_forward_hook(lambda m, a, out: m.seen.append(a[0].detach().clone()))
    with rk.use_expert_backend(backend):
        for model in (eager, compiled):
            for step in range(2):  # the second call runs the cached graph
                model.zero_grad(set_to_none=True)
                logits = model(_ids(step))
                logits.square().mean().backward()
                taps.append(
                    (
                        logits.detach(),
                        {n: p.grad.clone() for n, p in model.named_parameters()},
                        [layer.stats for layer in model.moe_layers()],
                    )
                )
    assert _graphs_compiled() >= 1  # the blocks did compile (not a silent fallback to eager)
    for (y_e, g_e, s_e), (y_c, g_c, s_c) in zip(taps[:2], taps[2:]):
        assert _close(y_e, y_c)
        assert g_e.keys() == g_c.keys()
        for name in g_e:
            assert _close(g_e[name], g_c[name]), name  # every gradient, the routers' and experts' included
        for a, b in zip(s_e, s_c):
            for field in dataclasses.fields(a):
                assert _close(getattr(a, field.name).double(), getattr(b, field.name).double()), field.name
    for le, lc in zip(eager.moe_layers(), compiled.moe_layers()):
        assert torch.equal(le.load_since_update, lc.load_since_update)  # two training forwards, counted once each
        assert len(lc.router_logits_tap.seen) == 2 and all(
            _close(a, b) for a, b in zip(le.router_logits_tap.seen, lc.router_logits_tap.seen)
        )


def test_aux_loss_gradient_reaches_the_router_when_compiled():
    # the layer's output carries the aux losses' gradient (_AttachAuxLoss); compiled, with a loss
    # that does not depend on the routed output at all, the router still gets exactly that gradient
    torch.manual_seed(0)
    cfg = MOE["dropless"]
    layer = MoELayer(cfg)
    twin = copy.deepcopy(layer)
    twin.forward = torch.compile(twin.forward, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 16, 32)
    for m in (layer, twin):
        m.aux_loss_scale = 0.5
        (m(x) * 0.0).sum().backward()
    assert layer.router.weight.grad.abs().max() > 0
    assert _close(layer.router.weight.grad, twin.router.weight.grad)


def test_checkpointed_compiled_blocks_count_statistics_once():
    # activation checkpointing re-runs each block's compiled forward in the backward; the recompute
    # mark (routing_kernels.runtime.recompute_context) makes it skip the statistics and the load
    eager = _model("dropless", checkpoint_activations=True)
    compiled = copy.deepcopy(eager)
    compiled.compile_blocks(backend="aot_eager")
    for model in (eager, compiled):
        model(_ids()).square().mean().backward()
    for le, lc in zip(eager.moe_layers(), compiled.moe_layers()):
        assert le.load_since_update.sum() == 2 * 16 * 2  # T * K assignments, once
        assert torch.equal(le.load_since_update, lc.load_since_update)
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        assert _close(pe.grad, pc.grad), name


# --- the trainer ---------------------------------------------------------------------------------


def test_train_compile_curve_equals_eager(tmp_path, monkeypatch):
    """Under ZeRO-0 and then ZeRO-3. The ZeRO-3 run reuses the graphs traced under ZeRO-0 where
    dynamo's guards (shapes, strides, dtypes, the training flag) pass, and retraces where they do not,
    so it runs what a fresh trace would give in a tenth of the time."""
    hydra = pytest.importorskip("hydra")  # noqa: F841 (the trainer's config tree)
    from experiments.training.data import load_stdlib

    compile_blocks = Transformer.compile_blocks
    # the trainer compiles with Inductor by default; aot_eager traces the same graphs (docstring)
    monkeypatch.setattr(
        Transformer, "compile_blocks", lambda self, **kw: compile_blocks(self, backend="aot_eager", **kw)
    )
    stdlib = load_stdlib()
    for zero_stage in (0, 3):
        _compile_curve(tmp_path / f"zero{zero_stage}", stdlib, zero_stage)


def _compile_curve(tmp_path, stdlib, zero_stage):
    from tests.support.training import cfg_of, run

    common = [
        "model=tiny",
        "model.n_layers=2",
        "logger=none",
        "train.progress=false",
        "train.batch_size=4",
        "train.seq_len=16",
        "train.steps=10",
        "train.log_every=1",
        "train.eval_every=5",
        "train.eval_batches=1",
        "optim.warmup_steps=2",
        f"parallel.zero_stage={zero_stage}",
        "moe.z_loss_coef=1e-2",
    ]
    eager = run(cfg_of(*common), tmp_path, stdlib, "eager", keep_weights=True)
    compiled = run(cfg_of(*common, "train.compile=true"), tmp_path, stdlib, "compiled", keep_weights=True)
    assert _graphs_compiled() >= 2  # training and validation (eval mode) graphs
    assert len(compiled["train_losses"]) == 10
    for a, b in zip(eager["train_losses"], compiled["train_losses"]):
        assert abs(a - b) <= TOL * max(1.0, abs(a))
    for va, vb in zip(eager["val_history"], compiled["val_history"]):
        assert va == pytest.approx(vb, rel=TOL)
    for name, w in eager["weights"].items():
        assert _close(w, compiled["weights"][name]), name


# --- expert parallelism: the one host read, isolated -------------------------------------------


def _ep_rank(rank, world):
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    cfg = TransformerConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=16, moe=MOE["dropless"]
    )

    def build():  # the same weights twice (a process group does not deepcopy)
        torch.manual_seed(0)
        return Transformer(cfg, ep_group=group, dp_group=group)

    model, twin = build(), build()
    ids = _ids(rank)
    probe = build()
    x = torch.randn(2, 16, 32)
    explained = torch._dynamo.explain(probe.blocks[0])(x, probe.rope_cos, probe.rope_sin)  # one MoE block
    reasons = [b.reason for b in explained.break_reasons]
    twin.compile_blocks(backend="aot_eager")
    out = []
    for m in (model, twin):
        y = m(ids)
        y.square().mean().backward()
        out.append((y.detach(), [p.grad.clone() for p in m.parameters()]))
    return (explained.graph_count, explained.graph_break_count), reasons, out


@pytest.mark.distributed
def test_expert_parallel_count_exchange_is_the_one_break():
    from tests.support.dist import run_distributed

    for breaks, reasons, ((y_e, g_e), (y_c, g_c)) in run_distributed(_ep_rank, 2, timeout=240):
        # every break of an expert-parallel block is the one isolated host read; dynamo counts it once
        # in each frame it cuts (Block.forward, MoELayer.forward, the dispatcher's call)
        graphs, count = breaks
        assert reasons and all("AllToAllDispatcher._exchange" in r for r in reasons), "\n".join(
            r[:300] for r in reasons
        )
        assert count <= 4 and graphs == count + 1, breaks
        assert _close(y_e, y_c)
        assert all(_close(a, b) for a, b in zip(g_e, g_c))


_EMPTY = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided, torch.ops.aten.new_empty}
_SCATTERS = {
    torch.ops.aten.index_put,
    torch.ops.aten.index_put_,
    torch.ops.aten._index_put_impl_,
    torch.ops.aten.scatter,
    torch.ops.aten.scatter_,
}


def _scatters_into_empty(fn, *args) -> list[str]:
    from torch.fx.experimental.proxy_tensor import make_fx

    def packet(node):
        return getattr(node.target, "overloadpacket", None) if node.op == "call_function" else None

    graph = make_fx(fn)(*args).graph
    return [
        n.format_node()
        for n in graph.nodes
        if packet(n) in _SCATTERS and isinstance(n.args[0], torch.fx.Node) and packet(n.args[0]) in _EMPTY
    ]


def test_routing_writes_no_empty_tensor():
    # Inductor (CPU) scheduled ``dest_A[order_A] = arange`` into an empty dest_A after the kernel
    # that read dest_A, in the inference graph of a DeepSeek-V3 block (validation): every row went
    # to row 1, and the CPU expert op read rows no assignment filled (an IndexError in
    # routing_kernels/cpu/blocks.py). aot_eager runs the same graph correctly, and an Inductor build
    # of a model takes minutes here, so the contract is checked on the traced graph instead: the
    # permutations the compiled routing inverts are inverted by a sort or a gather, not by a
    # scatter into uninitialised memory. Both still invert them.
    from moe import capacity_keep_mask
    from routing_kernels import reference

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4, (16, 2), generator=g)
    weights = torch.rand(16, 2, generator=g)
    assert _scatters_into_empty(lambda i: reference.routing_metadata(i, 4), ids) == []
    for policy in ("position", "probs"):
        assert _scatters_into_empty(lambda i, w: capacity_keep_mask(i, w, 4, 5, policy), ids, weights) == []

    counts, offsets, dest = reference.routing_metadata(ids, 4)
    flat = ids.reshape(-1)
    assert sorted(dest.reshape(-1).tolist()) == list(range(flat.numel()))  # a permutation of the rows
    # row dest[a] lies in its expert's segment, and rows keep token order within an expert
    for e in range(4):
        rows = dest.reshape(-1)[flat == e]
        assert rows.tolist() == list(range(int(offsets[e]), int(offsets[e + 1])))
