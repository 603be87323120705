"""Predicted model-state bytes per rank (zero.memory.predict_memory) against the live tensors of a
running ZeroEngine (measure_memory), on 2 and 4 gloo ranks, for every stage, fp32 and bf16, with
and without offload, dense and expert parameters apart.

Tolerance 5%: the measurement includes each flat buffer's padding to a multiple of the group size
(at most W - 1 elements per buffer), which the per-parameter prediction leaves out; the tiny test
model makes that the largest relative error (~2%).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.dist import run_distributed
from tests.support.zero_nets import E, TinyNet, sharded_net
from zero import Layout
from zero.engine import ZeroEngine
from zero.memory import FIELDS, KINDS, count_params, main, predict_memory

REL = 0.05


def _memory_rank(rank, world, ep):
    layout = Layout.build(ep=ep, num_experts=E)
    out = []
    x = torch.randn(2, 3, 16)
    for stage in (0, 1, 2, 3):
        for mp, offload in (("fp32", False), ("bf16", False), ("fp32", True)):
            net = sharded_net(layout)
            counts = count_params(net, layout)
            engine = ZeroEngine(net, layout, stage=stage, mixed_precision=mp, offload=offload)
            peak = {"gathered": 0}
            if stage == 3:
                # the gathered bytes while the MoE block computes: it plus at most the prefetched one
                def probe(module, args, output):
                    from zero.memory import measure_memory

                    peak["gathered"] = max(peak["gathered"], measure_memory(engine)["gathered"])

                net.layers[1].ffn.register_forward_hook(probe)
            # measured where model states are largest: gradients reduced, the optimizer's state
            # created by a first step (a group of one rank frees its gradient after each step)
            engine.backward(engine(x).square().mean())
            engine.step()
            engine.backward(engine(x).square().mean())
            from zero.memory import measure_memory

            measured = measure_memory(engine)
            engine.step()
            predicted = predict_memory(counts, layout=layout, stage=stage, mixed_precision=mp, offload=offload)
            # the two largest blocks in compute dtype: what stage 3 may hold gathered at once
            c = 2 if mp == "bf16" else 4
            block_bytes = sorted((sum(f.padded for f in u.flats) * c for u in engine.units), reverse=True)
            out.append(((stage, mp, offload), measured, predicted, peak["gathered"], sum(block_bytes[:2])))
    return out


def _check(results):
    n = 0
    for rank_out in results:
        for key, measured, predicted, gathered, two_blocks in rank_out:
            for kind in KINDS:
                for field in FIELDS:
                    m, p = measured[kind][field], predicted[kind][field]
                    assert abs(m - p) <= REL * p, (key, kind, field, m, p)
                    n += 1
            assert measured["gathered"] == 0, key  # nothing stays gathered after a backward
            if key[0] == 3:
                assert 0 < gathered <= two_blocks, (key, gathered, two_blocks)
                # sharding really happened: weights of stage 3 are a fraction of stage 0's
                assert measured["device_total"] < predicted["device_total"] * (1 + REL)
    return n


@pytest.mark.distributed
@pytest.mark.parametrize("world,ep", [(2, 1), (4, 2)])
def test_predicted_equals_measured(world, ep):
    # 4 ranks with ep=2: experts shard over edp=2, dense over dp=4
    results = run_distributed(_memory_rank, world, ep, timeout=300)
    assert _check(results) == world * 4 * 3 * len(KINDS) * len(FIELDS)


def test_seeds_table(capsys):
    # 7B parameters, 8 ranks, bf16 + Adam (16 bytes per parameter without ZeRO)
    totals = [predict_memory(7e9, dp=8, stage=s)["device_total"] / 1e9 for s in range(4)]
    assert totals == pytest.approx([112, 38.5, 26.25, 14])
    main(["--params", "7e9", "--dp", "8"])
    table = capsys.readouterr().out
    for s, total in zip(range(4), ("112", "38.5", "26.25", "14")):
        assert f"| {s} |" in table and f"| {total} |" in table


def test_expert_params_shard_over_edp():
    # 1B dense + 8B expert on dp=8, ep=4: a rank holds 2B expert params, sharded over edp=2
    m = predict_memory({"dense": 1e9, "expert": 8e9}, dp=8, ep=4, stage=3, mixed_precision="bf16")
    assert m["dense"]["params"] == pytest.approx(1e9 * 2 / 8)
    assert m["expert"]["params"] == pytest.approx(2e9 * 2 / 2)
    assert m["expert"]["optimizer"] == pytest.approx(2e9 * 12 / 2)
    off = predict_memory({"dense": 1e9, "expert": 8e9}, dp=8, ep=4, stage=3, offload=True)
    assert off["expert"]["optimizer"] == 0 and off["host_total"] == pytest.approx(
        m["dense"]["optimizer"] + m["expert"]["optimizer"]
    )


@pytest.mark.parametrize("mp", ["fp32", "bf16"])
def test_nvme_offload_predicted_equals_measured(tmp_path, mp):
    """``offload="nvme"``: the optimizer state off the device and out of host memory (in the files),
    and at stage 3 the parameter shards too; the files' bytes as predicted, up to each segment's
    alignment to 4096 elements."""
    from zero.memory import measure_memory

    x = torch.randn(2, 3, 16)
    for stage in (0, 1, 2, 3):
        net = sharded_net(Layout.single())
        counts = count_params(net)
        engine = ZeroEngine(net, None, stage=stage, mixed_precision=mp, offload="nvme", offload_dir=tmp_path)
        engine.backward(engine(x).square().mean())
        engine.step()
        engine.backward(engine(x).square().mean())
        measured = measure_memory(engine)
        engine.step()
        predicted = predict_memory(counts, stage=stage, mixed_precision=mp, offload="nvme")
        for kind in KINDS:
            for field in FIELDS:
                m, p = measured[kind][field], predicted[kind][field]
                assert abs(m - p) <= REL * p, (stage, kind, field, m, p)
        assert all(predicted[k]["params"] == 0 for k in KINDS) == (stage == 3)
        assert predicted["host_total"] == 0
        off = engine._nvme
        slack = len(off.plan.segments) * 4096 * sum(dt.itemsize for _, dt in off.slots)
        assert predicted["files_total"] <= measured["files_total"] <= predicted["files_total"] + slack, stage
        # stage 3 in bf16: a compute file beside the master; in fp32 the master is the shard
        assert ("compute" in [k for k, _ in off.slots]) == (stage == 3 and mp == "bf16")
    with pytest.raises(ValueError, match="offload='disk' must be one of"):
        predict_memory(1e9, offload="disk")


def test_count_params_scales_experts_by_ep():
    net = TinyNet(None)
    counts = count_params(net)
    assert counts["expert"] == sum(p.numel() for n, p in net.named_parameters() if "experts" in n)


def test_bad_inputs():
    with pytest.raises(ValueError, match="stage=5"):
        predict_memory(1e9, stage=5)
    with pytest.raises(ValueError, match="dp=6, ep=4"):
        predict_memory(1e9, dp=6, ep=4)
    with pytest.raises(ValueError, match="mixed_precision='fp8'"):
        predict_memory(1e9, mixed_precision="fp8")


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("stage", [2, 3])
def test_a_group_of_one_rank_holds_one_gradient_buffer(stage, offload):
    """Stages 2-3 with a sharding group of one rank (dp = 1; the experts' group at ep = dp): the
    reduced shard is the whole local buffer, consumed by the step. Kept until the next step's
    reduction, it would sit beside the next backward's buffer, two full gradients where one is
    needed. Counted at the end of the second backward, before its (trivial) reduction."""
    from zero.memory import measure_memory

    x = torch.randn(2, 3, 16)
    net = sharded_net(Layout.single())
    engine = ZeroEngine(net, None, stage=stage, offload=offload)
    full = sum(f.padded for f in engine.flats) * 4  # fp32 gradients
    engine.backward(engine(x).square().mean())
    engine.step()
    assert all(measure_memory(engine)[k]["grads"] == 0 for k in KINDS)
    engine(x).square().mean().backward()  # the backward alone: the engine has not reduced yet
    grads = sum(measure_memory(engine)[k]["grads"] for k in KINDS)
    assert grads == full, (grads, full)
    engine.step()  # and the step still finds its gradients
    assert engine.step_count == 2
