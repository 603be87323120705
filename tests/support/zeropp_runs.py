"""What tests/zero/test_zeropp_bytes.py and test_zeropp_quant.py run on their gloo ranks: TinyNet
(tests/support/zero_nets.py) trained under stage 3 and the ZeRO++ options, on 4 ranks as 2 "nodes"
of node_size=2, without EP (dense and expert weights over dp=4: 2 nodes x 2 members) and with ep=2
(experts over edp=2: 2 nodes x 1 member). Each spawn costs seconds of imports here, so each rank
function runs every configuration its tests need, and the tests' module fixtures hand out the
results."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe import scale_aux_losses
from tests.support.zero_nets import B_PER_RANK, LR, SEQ, WD, D, E, sharded_net
from zero import Layout
from zero.comm import CommCounter
from zero.engine import ZeroEngine

WORLD, NODE = 4, 2
EQ_STEPS, EQ_ACCUM = 5, 2
CURVE_STEPS = 50
BYTE_BLOCK = 32  # several scale blocks per chunk in the byte counts (TinyNet's chunks are 5-768 elements)


def teacher_data(steps: int, accum: int, dp: int, seed: int = 1):
    """Inputs and a fixed teacher's targets, ``y = tanh(x A) b``: a task the net learns, so the
    curves fall (~0.45 to ~0.01 in 50 steps) and a bad update shows."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(D, D, generator=g) / D**0.5
    b = torch.randn(D, 1, generator=g) / D**0.5
    x = torch.randn(steps, accum, dp * B_PER_RANK, SEQ, D, generator=g)
    return x, torch.tanh(x @ A) @ b


def train_tiny(
    layout: Layout,
    steps: int,
    accum: int,
    *,
    record_bytes: bool = False,
    first_grads: bool = False,
    eval_between: bool = False,
    seed: int = 1,
    **kw,
):
    """Stage 3 (unless ``stage`` is given) on TinyNet with the default optimizer (FusedAdamW, AdamW's
    update) and clipping; returns losses (the dp mean), full fp32 weights and, per step, the
    counters' breakdown; ``first_grads``: also the first step's synchronised gradients and the
    weights each block computed with in the first forward (after the engine's gather)."""
    net = sharded_net(layout)
    scale_aux_losses(net, 1.0 / accum)
    initial = {n: p.detach().clone() for n, p in net.named_parameters()}

    kw.setdefault("stage", 3)
    kw.setdefault("lr", LR)
    engine = ZeroEngine(
        net,
        layout,
        weight_decay=WD,
        max_grad_norm=1.0,
        param_groups=lambda name, p: {} if p.dim() >= 2 else {"weight_decay": 0.0},
        **kw,
    )
    seen = {}
    if first_grads:
        for block in [net.inp, *net.layers, net.head]:
            prefix = next(n for n, m in net.named_modules() if m is block)

            def capture(module, args, prefix=prefix):
                for n, p in module.named_parameters():
                    seen.setdefault(f"{prefix}.{n}", p.detach().float().clone())

            block.register_forward_pre_hook(capture)  # after the engine's: gathered
    x, y = teacher_data(steps, accum, layout.dp, seed)
    rows = slice(layout.dp_rank * B_PER_RANK, (layout.dp_rank + 1) * B_PER_RANK)
    losses, counts, gathers = [], [], []
    for s in range(steps):
        total = torch.zeros(())
        before = engine.gather_stats["gathers"]
        for m in range(accum):
            ctx = engine.no_sync() if m < accum - 1 else _Null()
            with ctx:
                loss = ((engine(x[s, m, rows]) - y[s, m, rows]) ** 2).mean() / accum
                engine.backward(loss)
            total += loss.detach().float()
        if first_grads and s == 0:
            grads = engine.full_gradients()
        engine.step()
        if eval_between:  # an evaluation forward between steps, counted aside
            with torch.no_grad(), engine.comm.aside():
                engine(x[s, 0, rows])
        gathers.append(engine.gather_stats["gathers"] - before)
        counts.append(engine.comm_bytes(breakdown=True))
        dist.all_reduce(total, group=layout.dp_group)  # the test's own collective, not the engine's
        losses.append(total.item() / layout.dp)
    out = {"losses": losses, "params": engine.full_parameters()}
    if first_grads:
        out["grads"], out["seen"], out["initial"] = grads, seen, initial
    if record_bytes:
        out["bytes"] = counts
        out["totals"] = engine.comm_bytes()
        out["setup"] = CommCounter.totals(engine.comm.setup)
        out["asides"] = CommCounter.breakdown(engine.comm.asides)
        out["gathers"] = gathers
        out["flats"] = [
            {
                "kind": f.kind,
                "padded": f.padded,
                "chunk": f.shard_numel,
                "world": f.world,
                "split": f.split,
                "elem": f.full_P.element_size(),
            }
            for f in engine.flats
        ]
    engine.remove_hooks()
    return out


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _ranks(group):
    return None if group is None else dist.get_process_group_ranks(group)


def equal_and_bytes_rank(rank, world):
    out = {}
    for ep in (1, 2):
        layout = Layout.build(ep=ep, num_experts=E, node_size=NODE)
        out[("layout", ep)] = {
            name: _ranks(getattr(layout, name))
            for name in (
                "dp_group",
                "dp_intra_group",
                "dp_inter_group",
                "edp_group",
                "edp_intra_group",
                "edp_inter_group",
            )
        } | {"node_split_dp": layout.node_split("dp"), "node_split_edp": layout.node_split("edp")}
        for mp in ("fp32", "bf16"):
            steps = EQ_STEPS if mp == "fp32" else 3
            for hpz in (False, True):
                out[("eq", ep, mp, hpz)] = train_tiny(layout, steps, EQ_ACCUM, hpz=hpz, mixed_precision=mp)
        # the byte counts: two steps each (the second has no first-step effects), one micro-batch
        for mp in ("fp32", "bf16"):
            for name, kw in BYTE_CONFIGS.items():
                kw = {"quant_block": BYTE_BLOCK} | kw
                out[("bytes", ep, mp, name)] = train_tiny(layout, 2, 1, record_bytes=True, mixed_precision=mp, **kw)
        out[("bytes_eval", ep)] = train_tiny(layout, 2, 1, record_bytes=True, eval_between=True, hpz=True)
    return out


BYTE_CONFIGS = {
    "plain": {},
    "hpz": {"hpz": True},
    "qwz": {"qwz": True},
    "qgz4": {"qgz": True, "qgz_bits": 4},
    "qgz8": {"qgz": True, "qgz_bits": 8},
    "zeropp": {"hpz": True, "qwz": True, "qgz": True, "qgz_bits": 4},
    "zeropp_block256": {"hpz": True, "qwz": True, "qgz": True, "quant_block": 256},
    "stage2_qgz4": {"stage": 2, "qgz": True},
}


def curve_rank(rank, world, configs=None, seed=1):
    # ep=2: dense weights over 2 nodes x 2 members, experts over 2 nodes x 1, both splits at once
    layout = Layout.build(ep=2, num_experts=E, node_size=NODE)
    out = {}
    for name, (steps, kw) in (CURVE_CONFIGS if configs is None else configs).items():
        run = train_tiny(layout, steps, 1, seed=seed, first_grads=True, **kw)
        out[name] = {k: run[k] for k in ("losses", "grads", "seen", "initial")}
    return out


CURVE_CONFIGS = {  # name: (steps, options)
    "fp32": (CURVE_STEPS, {}),
    "qwz": (CURVE_STEPS, {"qwz": True}),
    "qgz4": (CURVE_STEPS, {"qgz": True, "qgz_bits": 4}),
    "zeropp": (CURVE_STEPS, {"hpz": True, "qwz": True, "qgz": True}),
    "qgz8": (1, {"qgz": True, "qgz_bits": 8}),  # its first-step gradient only
    # stages 1 and 2 reduce the same local gradients through the same exchange as stage 3
    "qgz4_stage1": (1, {"stage": 1, "qgz": True}),
    "qgz4_stage2": (1, {"stage": 2, "qgz": True}),
}
