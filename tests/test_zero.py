"""ZeRO stages 0-3 (+ offload, + expert parallelism) with the default optimizer (FusedAdamW) against
single-process torch.optim.AdamW. Other optimizers: tests/test_zero_optim.py.

Every distributed configuration runs inside one spawn of ranks (a spawn costs seconds of imports on
this machine): the rank function loops over stages, ep sizes, accumulation, clipping and offload and
returns losses and final weights; the tests compare them with the single-process reference trained
on the same global batch, split into the same micro-batches.

Tolerances (fp32): the distributed runs sum gradients in a different order than one process, so
values differ by rounding (~1e-7 relative) per step; Adam's normalisation can magnify that for
entries whose gradient is near zero, and 20 steps compound it. 1e-5 relative on each step's loss and
2e-5 absolute on weights of size ~0.1-1 (lr 1e-2) hold with margin.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import routing_kernels.optim
from moe import MoEConfig, MoELayer, is_expert_param, scale_aux_losses
from tests.dist_utils import run_distributed
from zero import Layout
from zero.engine import ZeroEngine, default_blocks

D, F, E, STEPS, LR, WD = 16, 24, 4, 20, 1e-2, 0.1
B_PER_RANK, SEQ = 2, 3  # rows of each rank's micro-batch; odd sequence length on purpose
CLIP = 0.05  # below the reference's gradient norms (~0.1-1), so clipping is active every step
LOSS_RTOL = 1e-5
PARAM_ATOL = 2e-5
GRAD_ATOL = 1e-6  # gradients of size ~1e-2-1 after one reduction: rounding only (~1e-8)


class Block(nn.Module):
    def __init__(self, ffn):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.ffn = ffn

    def forward(self, x_BTD):
        return x_BTD + self.ffn(self.norm(x_BTD))


class TinyNet(nn.Module):
    """in-projection, a dense block, an MoE block, head: four blocks for ZeRO-3 to gather in turn."""

    def __init__(self, layout: Layout | None):
        super().__init__()
        cfg = MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=2)
        ep_group = None if layout is None else layout.ep_group
        dp_group = None if layout is None else layout.dp_group
        self.inp = nn.Linear(D, D)
        self.layers = nn.ModuleList(
            [
                Block(nn.Sequential(nn.Linear(D, F), nn.GELU(), nn.Linear(F, D))),
                Block(MoELayer(cfg, ep_group=ep_group, dp_group=dp_group)),
            ]
        )
        self.head = nn.Linear(D, 1)

    def forward(self, x_BTD):
        h = self.inp(x_BTD)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class TiedNet(nn.Module):
    """The input and output projections share one weight (as tied embeddings do): under stage 3 it
    must stay gathered while either runs."""

    def __init__(self, layout=None):
        super().__init__()
        self.inp = nn.Linear(D, D, bias=False)
        self.layers = nn.ModuleList([Block(nn.Sequential(nn.Linear(D, F), nn.GELU(), nn.Linear(F, D)))])
        self.out = nn.Linear(D, D, bias=False)
        self.out.weight = self.inp.weight
        self.head = nn.Linear(D, 1)

    def forward(self, x_BTD):
        return self.head(self.out(self.layers[0](self.inp(x_BTD))))


class SpareNet(TinyNet):
    """A parameter the forward never uses: its block's gradients never all arrive, so its
    reduction starts only when the backward ends, in the same order on every rank."""

    def __init__(self, layout=None):
        super().__init__(layout)
        self.layers[0].spare = nn.Linear(D, 3)


NET = {"tiny": TinyNet, "tied": TiedNet, "spare": SpareNet}


def reference_net(kind: str = "tiny") -> nn.Module:
    torch.manual_seed(0)
    return NET[kind](None)


def sharded_net(layout: Layout, kind: str = "tiny") -> nn.Module:
    """The reference weights, with this ep rank's slice of the experts."""
    net = NET[kind](layout)
    ref = dict(reference_net(kind).named_parameters())
    L = E // layout.ep
    with torch.no_grad():
        for n, p in net.named_parameters():
            src = ref[n]
            if is_expert_param(p):
                src = src[layout.ep_rank * L : (layout.ep_rank + 1) * L]
            p.copy_(src)
    return net


def batches(accum: int, dp: int):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, accum, dp * B_PER_RANK, SEQ, D, generator=g)
    y = torch.randn(STEPS, accum, dp * B_PER_RANK, SEQ, 1, generator=g)
    return x, y


def run_reference(accum: int, clip: float | None, dp: int, steps: int = STEPS, kind: str = "tiny", skip: tuple = ()):
    """One process, the same global batch and micro-batches, torch.optim.AdamW; the steps in
    ``skip`` are left out (as if they never ran: no forward, no update)."""
    net = reference_net(kind)
    scale_aux_losses(net, 1.0 / accum)
    # matrices decay, norm gains and biases do not (the trainer's grouping)
    groups = [
        {"params": [p for p in net.parameters() if p.dim() >= 2], "weight_decay": WD},
        {"params": [p for p in net.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=LR)
    x, y = batches(accum, dp)
    losses = []
    for s in range(steps):
        if s in skip:
            continue
        total = 0.0
        for m in range(accum):
            loss = ((net(x[s, m]) - y[s, m]) ** 2).mean() / accum
            loss.backward()
            total += loss.item()
        if s == 0:
            first_grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in net.named_parameters()}, first_grads


def run_engine(
    layout: Layout,
    stage: int,
    accum: int,
    clip: float | None,
    steps: int = STEPS,
    kind: str = "tiny",
    all_no_sync: bool = False,
    **kw,
):
    net = sharded_net(layout, kind)
    scale_aux_losses(net, 1.0 / accum)
    # the default optimizer (routing_kernels.FusedAdamW) with the reference's two groups
    engine = ZeroEngine(
        net,
        layout,
        stage=stage,
        lr=LR,
        weight_decay=WD,
        max_grad_norm=clip,
        param_groups=lambda name, p: {} if p.dim() >= 2 else {"weight_decay": 0.0},
        **kw,
    )
    x, y = batches(accum, layout.dp)
    rows = slice(layout.dp_rank * B_PER_RANK, (layout.dp_rank + 1) * B_PER_RANK)
    losses = []
    for s in range(steps):
        total = torch.zeros(())
        for m in range(accum):
            last = m == accum - 1 and not all_no_sync  # all_no_sync: step() itself reduces
            with engine.no_sync() if not last else _nullcontext():
                loss = ((engine(x[s, m, rows]) - y[s, m, rows]) ** 2).mean() / accum
                engine.backward(loss)
            total += loss.detach()
        if s == 0:
            first_grads = engine.full_gradients()
        engine.step()
        if layout.dp_group is not None:
            dist.all_reduce(total, group=layout.dp_group)
        losses.append(total.item() / layout.dp)
    params = engine.full_parameters()
    engine.first_grads = first_grads
    return losses, params, dict(engine.gather_stats), engine


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _compare(ref, got, layout: Layout):
    """Max relative loss error, max absolute weight error after all steps, and max absolute error
    of the first step's synchronised gradients (Adam forgives a wrongly scaled gradient; this does
    not) of one engine run against the reference."""
    ref_losses, ref_params, ref_grads = ref
    losses, params, grads = got
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    L = E // layout.ep

    def mine(want, p):  # an expert weight: this rank's ep slice
        return want if p.shape == want.shape else want[layout.ep_rank * L : (layout.ep_rank + 1) * L]

    # a parameter without gradient: torch.optim skips it, the engine steps it with a zero gradient
    skip = set(params) - set(ref_grads)
    w_err = max((p - mine(ref_params[n], p)).abs().max().item() for n, p in params.items() if n not in skip)
    g_err = max((g - mine(ref_grads[n], g)).abs().max().item() for n, g in grads.items() if n not in skip)
    return loss_err, w_err, g_err


def _rel_grad_err(ref_grads, grads, layout: Layout) -> float:
    """Max over parameters of the first step's gradient error relative to that gradient's max |g|."""
    L = E // layout.ep
    err = 0.0
    for n, g in grads.items():
        want = ref_grads[n]
        if want.shape != g.shape:  # an expert weight: this rank's ep slice
            want = want[layout.ep_rank * L : (layout.ep_rank + 1) * L]
        err = max(err, ((g.float() - want).abs().max() / want.abs().max()).item())
    return err


NO_ACCUM, ACCUM_CLIP = (1, None), (2, CLIP)
# bf16 compute against the fp32 reference. bf16 keeps 8 mantissa bits (2^-8 = 4e-3 per rounding).
# Measured on dp=2 x ep=2, stages 2 and 3, 5 data seeds: losses of the first 5 steps <= 4.4e-3
# relative, first-step synchronised gradients <= 1.8e-2 of each tensor's max |g|. Without the
# gradient reduction (each rank steps on its own half batch) the same runs are off by >= 2.7e-2 in
# the losses and >= 0.73 in the gradients. Tolerances are ~2x the measured maxima. Longer runs do not
# discriminate more: from ~10 steps on the bf16 trajectory drifts from fp32 by up to 1e-1 either way.
BF16_STEPS = 5
BF16_LOSS_RTOL = 1e-2
BF16_GRAD_RTOL = 3.5e-2
OFFLOAD_STEPS = 4  # offload must match bit for bit, which a few steps show as well as twenty


def _plan(world: int):
    """(ep, stage, (accum, clip)) runs of one spawn; kept short because each costs seconds here."""
    if world == 4:  # ep=2 inside dp=4: experts shard over edp=2, dense weights over dp=4
        return [(2, s, v) for s in range(4) for v in (NO_ACCUM, ACCUM_CLIP)], 2
    # dp=2: without EP (experts replicated on both ranks), and ep=dp (experts not replicated, edp=1)
    return [(1, s, ACCUM_CLIP) for s in range(4)] + [(2, s, ACCUM_CLIP) for s in (2, 3)], 2


def _equivalence_rank(rank, world):
    out = {}
    runs, offload_ep = _plan(world)
    refs = {v: run_reference(*v, world) for v in {v for _, _, v in runs}}
    layouts = {}
    for ep, stage, (accum, clip) in runs:
        layout = layouts.setdefault(ep, Layout.build(ep=ep, num_experts=E))
        losses, params, stats, engine = run_engine(layout, stage, accum, clip)
        out[("plain", ep, stage, accum, clip)] = (
            _compare(refs[(accum, clip)], (losses, params, engine.first_grads), layout),
            stats,
        )
    layout = layouts[offload_ep]
    for stage in (1, 2, 3):
        # offload must change where the optimizer runs, not a single bit of the result
        losses, params, _, _ = run_engine(layout, stage, 2, CLIP, steps=OFFLOAD_STEPS)
        losses_o, params_o, _, _ = run_engine(layout, stage, 2, CLIP, steps=OFFLOAD_STEPS, offload=True)
        out[("offload_same", offload_ep, stage)] = losses_o == losses and all(
            torch.equal(params_o[n], params[n]) for n in params
        )
    if world == 2:
        # a weight shared by two blocks, sharded and gathered under stage 3
        losses, params, stats, engine = run_engine(layout, 3, 2, CLIP, kind="tied")
        out[("extra", offload_ep, 3, ("tied",))] = (
            _compare(run_reference(2, CLIP, world, kind="tied"), (losses, params, engine.first_grads), layout),
            stats,
        )
        # every micro-batch inside no_sync (step() reduces), and a parameter that gets no gradient
        for stage in (2, 3):
            losses, params, stats, engine = run_engine(layout, stage, 2, CLIP, all_no_sync=True)
            out[("extra", offload_ep, stage, ("all_no_sync",))] = (
                _compare(refs[ACCUM_CLIP], (losses, params, engine.first_grads), layout),
                stats,
            )
            losses, params, stats, engine = run_engine(layout, stage, 2, CLIP, kind="spare")
            out[("extra", offload_ep, stage, ("spare",))] = (
                _compare(run_reference(2, CLIP, world, kind="spare"), (losses, params, engine.first_grads), layout),
                stats,
            )
        # bf16 compute weights and gradients, fp32 master weights and moments
        for stage in (2, 3):
            losses, _, _, engine = run_engine(layout, stage, 2, CLIP, steps=BF16_STEPS, mixed_precision="bf16")
            moments = {v.dtype for st in engine.optimizer.state.values() for v in st.values() if v.dim() > 0}
            dtypes = ({f.full_P.dtype for f in engine.flats}, {f.master.dtype for f in engine.flats}, moments)
            grad_err = _rel_grad_err(refs[ACCUM_CLIP][2], engine.first_grads, layout)
            out[("bf16", offload_ep, stage)] = (losses, refs[ACCUM_CLIP][0][:BF16_STEPS], dtypes, grad_err)
    if world == 4:
        out[("transformer", 2, 3)] = _transformer_run(rank, world, layout)
        # a pipeline stage's option: gather once per step, keep across micro-batches
        losses, params, stats, engine = run_engine(layout, 3, 2, CLIP, keep_gathered_across_microbatches=True)
        out[("extra", offload_ep, 3, ("keep_gathered_across_microbatches",))] = (
            _compare(refs[ACCUM_CLIP], (losses, params, engine.first_grads), layout),
            stats,
        )
    return out


TF_VOCAB, TF_LEN, TF_STEPS = 64, 7, 6


def _transformer_cfg():
    from moe.model import TransformerConfig

    # the trainer's model with every feature that touches ZeRO-3: tied embeddings (a weight shared by
    # two blocks), activation checkpointing (block forwards re-run inside the backward), MoE + EP
    return TransformerConfig(
        vocab_size=TF_VOCAB,
        d_model=D,
        n_layers=3,
        n_heads=2,
        d_ff=F,
        max_seq_len=16,
        moe_every=2,
        moe=MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=2),
        tie_embeddings=True,
        checkpoint_activations=True,
    )


def _transformer_run(rank, world, layout):
    """ZeRO-3 on the reference transformer against one process with AdamW: max relative loss error."""
    import torch.nn.functional as Fn

    from moe.model import Transformer

    tokens = torch.randint(
        0, TF_VOCAB, (TF_STEPS, world * B_PER_RANK, TF_LEN + 1), generator=torch.Generator().manual_seed(3)
    )
    lm_loss = lambda logits, b: Fn.cross_entropy(logits.flatten(0, 1), b[:, 1:].flatten())
    torch.manual_seed(0)
    ref = Transformer(_transformer_cfg())
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    want = []
    for b in tokens:
        loss = lm_loss(ref(b[:, :-1]), b)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    torch.manual_seed(0)
    net = Transformer(_transformer_cfg())
    ref_init = dict(net.named_parameters())
    net = Transformer(_transformer_cfg(), layout=layout)
    L = E // layout.ep
    with torch.no_grad():
        for n, p in net.named_parameters():
            p.copy_(ref_init[n][layout.ep_rank * L : (layout.ep_rank + 1) * L] if is_expert_param(p) else ref_init[n])
    engine = ZeroEngine(net, layout, stage=3, lr=LR, weight_decay=WD, max_grad_norm=CLIP)
    got = []
    for b in tokens:
        b = b[layout.dp_rank * B_PER_RANK : (layout.dp_rank + 1) * B_PER_RANK]
        loss = lm_loss(engine(b[:, :-1]), b)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=layout.dp_group)
        got.append(total.item() / layout.dp)
    return max(abs(a - b) / abs(b) for a, b in zip(got, want)), dict(engine.gather_stats)


@pytest.fixture(scope="module")
def results_dp4():
    return run_distributed(_equivalence_rank, 4, timeout=400)


@pytest.fixture(scope="module")
def results_dp2():
    return run_distributed(_equivalence_rank, 2, timeout=300)


def _check_all(results):
    checked = 0
    for out in results:
        for key, value in out.items():
            if key[0] in ("plain", "extra"):
                (loss_err, w_err, g_err), _ = value
                assert g_err < GRAD_ATOL, (key, g_err)
                assert loss_err < LOSS_RTOL, (key, loss_err)
                assert w_err < PARAM_ATOL, (key, w_err)
                checked += 1
    return checked


def test_stages_match_adamw_ep2_inside_dp4(results_dp4):
    # includes ZeRO-3 with ep=2 inside dp=4 (edp=2), with accumulation and clipping
    assert ("plain", 2, 3, 2, CLIP) in results_dp4[0]
    assert _check_all(results_dp4) == 4 * (8 + 1)


def test_stage3_trains_the_reference_transformer_like_one_process(results_dp4):
    # ep=2 inside dp=4, tied embeddings, activation checkpointing
    for out in results_dp4:
        loss_err, stats = out[("transformer", 2, 3)]
        assert loss_err < LOSS_RTOL, loss_err
        assert stats["max_gathered_blocks"] <= 2 and stats["prefetches"] > 0, stats


def test_stages_match_adamw_dp2_with_and_without_ep(results_dp2):
    assert ("plain", 1, 3, 2, CLIP) in results_dp2[0] and ("plain", 2, 3, 2, CLIP) in results_dp2[0]
    assert _check_all(results_dp2) == 2 * (4 + 2 + 1 + 4)


def test_bf16_mixed_precision_tracks_fp32(results_dp2):
    for out in results_dp2:
        runs = [v for k, v in out.items() if k[0] == "bf16"]
        assert len(runs) == 2
        for losses, ref_losses, (compute, master, moments), grad_err in runs:
            assert compute == {torch.bfloat16} and master == {torch.float32} and moments == {torch.float32}
            assert len(losses) == len(ref_losses) == BF16_STEPS
            for a, b in zip(losses, ref_losses):
                assert abs(a - b) <= BF16_LOSS_RTOL * abs(b), (losses, ref_losses)
            assert grad_err <= BF16_GRAD_RTOL, grad_err
            assert losses[-1] < losses[0]  # and it trains


def test_offload_equals_no_offload(results_dp4, results_dp2):
    for results in (results_dp4, results_dp2):
        flags = [v for out in results for k, v in out.items() if k[0] == "offload_same"]
        assert len(flags) == 3 * len(results) and all(flags)


def test_stage3_holds_at_most_two_gathered_blocks(results_dp4, results_dp2):
    for out in results_dp4 + results_dp2:
        for key, (_, stats) in ((k, v) for k, v in out.items() if k[0] in ("plain", "extra") and k[2] == 3):
            if key[0] == "extra":
                continue  # keep_gathered keeps every block by request; the tied net has other blocks
            # one block computing plus the one being prefetched
            assert 1 <= stats["max_gathered_blocks"] <= 2, (key, stats)
            # 4 blocks, gathered for forward and again for backward, every micro-batch
            accum = key[3] if key[0] == "plain" else 2
            assert stats["gathers"] >= 2 * 4 * accum * STEPS - 4, (key, stats)
            assert stats["prefetches"] > 0, (key, stats)


def test_single_process_path_matches_adamw(one_thread, monkeypatch):
    # layout None: the reference path itself, every stage, with accumulation and clipping; a
    # prime-sized chunk of FusedAdamW's CPU update, so its boundaries cut through every parameter
    monkeypatch.setattr(routing_kernels.optim, "_CPU_CHUNK", 97)
    ref = run_reference(2, CLIP, 1)
    layout = Layout.single()
    for stage in (0, 1, 2, 3):
        losses, params, _, engine = run_engine(layout, stage, 2, CLIP, offload=stage == 2)
        loss_err, w_err, g_err = _compare(ref, (losses, params, engine.first_grads), layout)
        assert loss_err < LOSS_RTOL and w_err < PARAM_ATOL and g_err < GRAD_ATOL, (stage, loss_err, w_err, g_err)


def test_shard_metadata_names_every_slice():
    net = reference_net()
    engine = ZeroEngine(net, None, stage=3)
    meta = engine.shard_metadata()
    names = {s.name for m in meta for s in m["params"]}
    assert names == {n for n, _ in net.named_parameters()}
    for m in meta:
        covered = sum(s.param_range[1] - s.param_range[0] for s in m["params"])
        assert covered == m["flat_numel"]
        for s in m["params"]:
            if "experts" in s.name:
                assert s.expert_offset == 0 and s.global_shape[0] == E


def test_bad_arguments_raise_before_any_collective():
    net = reference_net()
    with pytest.raises(ValueError, match="stage=4"):
        ZeroEngine(net, None, stage=4)
    with pytest.raises(ValueError, match="mixed_precision='fp16'"):
        ZeroEngine(net, None, mixed_precision="fp16")
    with pytest.raises(ValueError, match="max_grad_norm=0"):
        ZeroEngine(net, None, max_grad_norm=0)
    with pytest.raises(ValueError, match="must not nest"):
        ZeroEngine(net, None, blocks=[net.layers[0], net.layers[0].ffn])
    with pytest.raises(ValueError, match="keep_gathered_across_microbatches"):
        ZeroEngine(net, None, stage=2, keep_gathered_across_microbatches=True)
    with pytest.raises(ValueError, match="holds 4 of 4 experts but the layout has ep=2"):
        ZeroEngine(net, Layout(world=2, dp=2, ep=2))
    engine = ZeroEngine(net, None, stage=1)
    with pytest.raises(RuntimeError, match="no gradients"):
        engine.step()
    x = torch.randn(2, SEQ, D)
    engine.backward(engine(x).mean())
    with pytest.raises(RuntimeError, match="second backward outside no_sync"):
        engine.backward(engine(x).mean())
    assert [type(b).__name__ for b in default_blocks(net)] == ["Linear", "Block", "Block", "Linear"]
