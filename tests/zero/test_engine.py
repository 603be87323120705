"""ZeRO stages 0-3 (+ offload, + expert parallelism) with the default optimizer (FusedAdamW) against
single-process torch.optim.AdamW. Other optimizers: tests/zero/test_optim.py.

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

import routing_kernels.optim
from moe import MoEConfig, is_expert_param
from tests.support.dist import run_distributed
from tests.support.zero_nets import (
    ACCUM_CLIP,
    B_PER_RANK,
    BF16_GRAD_RTOL,
    BF16_LOSS_RTOL,
    BF16_STEPS,
    CLIP,
    GRAD_ATOL,
    LOSS_RTOL,
    LR,
    NO_ACCUM,
    PARAM_ATOL,
    SEQ,
    STEPS,
    WD,
    D,
    E,
    F,
    _compare,
    _rel_grad_err,
    reference_net,
    run_engine,
    run_reference,
)
from zero import Layout
from zero.engine import ZeroEngine, default_blocks

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


@pytest.mark.distributed
def test_stages_match_adamw_ep2_inside_dp4(results_dp4):
    # includes ZeRO-3 with ep=2 inside dp=4 (edp=2), with accumulation and clipping
    assert ("plain", 2, 3, 2, CLIP) in results_dp4[0]
    assert _check_all(results_dp4) == 4 * (8 + 1)


@pytest.mark.distributed
def test_stage3_trains_the_reference_transformer_like_one_process(results_dp4):
    # ep=2 inside dp=4, tied embeddings, activation checkpointing
    for out in results_dp4:
        loss_err, stats = out[("transformer", 2, 3)]
        assert loss_err < LOSS_RTOL, loss_err
        assert stats["max_gathered_blocks"] <= 2 and stats["prefetches"] > 0, stats


@pytest.mark.distributed
def test_stages_match_adamw_dp2_with_and_without_ep(results_dp2):
    assert ("plain", 1, 3, 2, CLIP) in results_dp2[0] and ("plain", 2, 3, 2, CLIP) in results_dp2[0]
    assert _check_all(results_dp2) == 2 * (4 + 2 + 1 + 4)


@pytest.mark.distributed
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


@pytest.mark.distributed
def test_offload_equals_no_offload(results_dp4, results_dp2):
    for results in (results_dp4, results_dp2):
        flags = [v for out in results for k, v in out.items() if k[0] == "offload_same"]
        assert len(flags) == 3 * len(results) and all(flags)


@pytest.mark.distributed
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
