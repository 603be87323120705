"""The CPU expert path's parallel lanes and block queue (routing_kernels.cpu), driven through its
public ``forced_schedule``: lanes against the naive reference, the same bits whatever the schedule,
errors surfacing, the queue's order, the fallbacks, pooled buffers, and the lanes under activation
checkpointing and other threads.

Shapes follow the project's legend (docs/design.md).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import routing_kernels as rk
from moe import MoEConfig
from routing_kernels.cpu import BlockQueue, LaneFailed, forced_schedule, lane_count, release_lanes
from tests.support.layer_cases import (
    CASES,
    check_against_naive,
    make,
    no_aux,
    run_layer,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture
def two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def lanes(two_threads):
    """Two intra-op threads, and two lanes for any size (routing_kernels.cpu.forced_schedule): the
    CPU path then runs its expert blocks in two parallel lanes, whatever the routing. Yields the
    schedule's log (``.lanes``: the lane count of every pass)."""
    with forced_schedule(lanes=2) as log:
        yield log


def ran_in_two_lanes(log) -> bool:
    return bool(log.lanes) and all(n == 2 for n in log.lanes)


@pytest.mark.parametrize(
    "name", ["odd", "k_eq_E", "3d_input", "gelu_shared", "capacity_probs", "expert_choice", "fewer_tokens_than_experts"]
)
def test_lanes_match_naive(name, lanes):
    shape, kw = CASES[name]
    layer = make(no_aux(d_model=shape[-1], **kw))
    torch.manual_seed(1)
    check_against_naive(layer, torch.randn(shape), torch.float32, name)
    assert ran_in_two_lanes(lanes), f"ran in lanes {lanes.lanes}"


@pytest.mark.parametrize("name", ["odd", "gelu_shared", "capacity_position", "expert_choice"])
def test_lanes_same_bits_whatever_the_schedule(name, two_threads):
    # blocks of 3 rows: every expert's rows span many blocks, taken by either lane in any order, so
    # weight gradients wait for their turn; which lane runs which block must not change one bit.
    # (A schedule skewed by sleeping in one lane was not fixed: on a loaded machine the other lane
    # could be descheduled long enough that the sleeping one still took every block, in both runs.)
    shape, kw = CASES[name]
    layer = make(MoEConfig(d_model=shape[-1], **kw))
    x, grad = torch.randn(shape), torch.randn(shape)
    runs, logs = [], []
    # lane 0 takes the even blocks, then the odd ones (and the other lane the rest)
    for pattern in (lambda n: n % 2, lambda n: 1 - n % 2):
        with forced_schedule(lanes=2, block_rows=3, lane_of=pattern) as log:
            runs.append(run_layer(layer, x, grad))
        logs.append(log)
    schedules = [sorted(log.blocks.get(0, [])) for log in logs]
    assert schedules[0] != schedules[1], "both runs gave the lanes the same blocks: nothing was tested"
    for log in logs:
        assert all(len(log.blocks.get(i, [])) > 0 for i in (0, 1)), log.blocks
    first, second = runs
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for n in first[2]:
        assert torch.equal(first[2][n], second[2][n]), n
    assert all(ran_in_two_lanes(log) for log in logs)


def test_lane_errors_surface_and_the_next_call_works(two_threads):
    # the lanes alternate blocks: left to the machine, a lane started late on a loaded machine could
    # find the queue empty, and a failure planted in it would never happen (seen once in a suite run)
    shape, kw = CASES["odd"]
    layer = make(MoEConfig(d_model=shape[-1], **kw))
    x, grad = torch.randn(shape), torch.randn(shape)
    with forced_schedule(lanes=2, block_rows=3, lane_of=lambda n: n % 2):
        expected = run_layer(layer, x, grad)
        # in every lane; then in one lane only, while the other may be waiting for that lane's block
        for failing in ((0, 1), (1,)):

            def fail(lane, block, failing=failing):
                if lane in failing:
                    raise RuntimeError("lane failure")

            with forced_schedule(on_block=fail), pytest.raises(RuntimeError, match="lane failure"):
                run_layer(layer, x, grad)
        again = run_layer(layer, x, grad)
    assert torch.equal(again[0], expected[0]) and torch.equal(again[1], expected[1])


def test_block_queue_order_turns_and_failure():
    import threading

    q = BlockQueue([5, 0, 2, 9], block=4)
    units = []
    while (u := q.take()) is not None:
        units.append(u)
    # first blocks of every expert, largest first, then second blocks, ...; an expert's rows are cut
    # into equal parts (9 rows: 3 + 3 + 3), rows in expert order (starts 0, 5, 7)
    assert units == [(3, 7, 10, 0), (0, 0, 2, 0), (2, 5, 7, 0), (0, 2, 5, 1), (3, 10, 13, 1), (3, 13, 16, 2)]
    # in lanes, the last blocks are halved (their halves `lanes` apart, renumbered in row order),
    # unless another tail block is of the same expert (expert 3 above)
    assert BlockQueue([5, 0, 2, 9], block=4, lanes=2).blocks == units
    assert BlockQueue([8, 8, 8], block=4, lanes=2).blocks == [
        (0, 0, 4, 0),
        (1, 8, 12, 0),
        (2, 16, 20, 0),
        (0, 4, 8, 1),
        (1, 12, 14, 1),
        (2, 20, 22, 1),
        (1, 14, 16, 2),
        (2, 22, 24, 2),
    ]
    q.wait_turn(3, 0)  # block 0 never waits
    q.wait_s = 0.05
    with pytest.raises(TimeoutError, match="block 0 of expert 3"):
        q.wait_turn(3, 1)
    q.end_turn(3)
    q.wait_turn(3, 1)
    # a failing lane wakes a waiting one, which stops instead of waiting out the timeout
    q.wait_s = 60.0
    errors = []

    def waiter():
        try:
            q.wait_turn(0, 1)
        except LaneFailed as err:
            errors.append(err)

    t = threading.Thread(target=waiter)
    t.start()
    q.fail()
    t.join(10)
    assert not t.is_alive() and len(errors) == 1
    assert q.take() is None


def test_block_queue_covers_rows_in_turn_order():
    # any counts, block size and lane count: the blocks tile every expert's rows exactly, are
    # numbered 0, 1, ... in row order, and each comes after its predecessor in the queue (what
    # makes the turns deadlock-free)
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(300):
        counts = [rng.choice([0, 1, 2, 5, 9, 40]) for _ in range(rng.randint(1, 7))]
        q = BlockQueue(counts, block=rng.randint(1, 12), lanes=rng.randint(1, 4))
        position = {(e, i): j for j, (e, _, _, i) in enumerate(q.blocks)}
        for e, (n, start) in enumerate(zip(counts, [0, *itertools.accumulate(counts)])):
            mine = sorted((i, a, b) for u, a, b, i in q.blocks if u == e)
            if n == 0:
                assert not mine
                continue
            assert [i for i, _, _ in mine] == list(range(len(mine)))
            assert [a for _, a, _ in mine] == [start] + [b for _, _, b in mine[:-1]]
            assert mine[-1][2] == start + n and all(b > a for _, a, b in mine)
            assert all(position[e, i - 1] < position[e, i] for i, _, _ in mine[1:])


def test_lane_count_falls_back():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert lane_count([2100, 1900, 2000, 2050], 512, 1024) == 2
        assert lane_count([9000, 100, 100, 100], 512, 1024) == 2  # a hot expert's blocks spread too
        assert lane_count([3, 2, 1, 0], 512, 1024) == 1  # too little work to hand off
        assert lane_count([0, 0], 512, 1024) == 1
        # small matmuls (512 rows x 64 x 256 per expert): the lanes' Python would contend for the GIL
        assert lane_count([512] * 8, 64, 256) == 1
        torch.set_num_threads(1)
        assert lane_count([2100, 1900], 512, 1024) == 1
    finally:
        torch.set_num_threads(n)


def test_cpu_blocks_and_loop_agree():
    cfg = no_aux(d_model=24, d_ff=40, num_experts=7, top_k=3, capacity_factor=0.8)
    layer = make(cfg)
    torch.manual_seed(13)
    x, g = torch.randn(50, 24), torch.randn(50, 24)
    with rk.use_expert_backend("cpu_blocks"):
        a = run_layer(layer, x, g)
    with rk.use_expert_backend("loop"):
        b = run_layer(layer, x, g)
    # same products, summed in another order (per block vs per token): fp32 rounding only
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-6)
    for n in a[2]:
        torch.testing.assert_close(a[2][n], b[2][n], rtol=1e-5, atol=1e-6, msg=n)


def test_pooled_buffers_stay_with_a_live_graph():
    # the CPU path keeps the buffers of saved activations from step to step; a second forward
    # while the first graph is alive (pipeline micro-batches, retain_graph) must not reuse them
    layer = make(no_aux(d_model=16, d_ff=24, num_experts=3, top_k=2))
    params = list(layer.parameters())
    torch.manual_seed(14)
    x1, x2, g = torch.randn(40, 16), torch.randn(40, 16), torch.randn(40, 16)
    out1 = layer(x1)
    first = torch.autograd.grad(out1, params, g, retain_graph=True)
    for _ in range(2):  # the second round may reuse out2's buffers, freed by its backward
        out2 = layer(x2)
        torch.autograd.grad(out2, params, g)
    again = torch.autograd.grad(out1, params, g)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


@pytest.mark.parametrize("reentrant", [False, True])
def test_lanes_under_activation_checkpointing(reentrant, lanes):
    # the recompute runs the lanes again inside the backward pass (on autograd's thread): the same
    # ops in the same lanes, so gradients are bit-identical to the run without checkpointing
    cfg = MoEConfig(d_model=16, d_ff=20, num_experts=6, top_k=2)
    layer = make(cfg)
    x, g = torch.randn(3, 11, 16), torch.randn(3, 11, 16)
    out, gx, grads = run_layer(layer, x, g)
    ck = copy.deepcopy(layer)
    ck.zero_grad(set_to_none=True)
    xc = x.clone().requires_grad_(True)
    out_c = checkpoint(ck, xc, use_reentrant=reentrant)
    out_c.backward(g)
    assert torch.equal(out_c.detach(), out) and torch.equal(xc.grad, gx)
    for name, p in ck.named_parameters():
        assert torch.equal(p.grad, grads[name]), name
    assert ran_in_two_lanes(lanes)


def test_lanes_leave_thread_defaults_alone(lanes):
    # lane threads run one intra-op thread each; threads the program starts later must still get
    # the process's setting (torch.set_num_threads in a thread also sets their default)
    import threading

    release_lanes()  # fresh lane threads: their start-up is under test
    shape, kw = CASES["odd"]
    layer = make(MoEConfig(d_model=shape[-1], **kw))
    layer(torch.randn(shape)).sum().backward()
    assert lanes.lanes and lanes.lanes[0] == 2
    seen = {}

    def probe():
        torch.ones(100_000).sum()
        seen["threads"] = torch.get_num_threads()

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    assert seen["threads"] == torch.get_num_threads() == 2
    assert lanes.lane_threads and all(n == 1 for n in lanes.lane_threads), lanes.lane_threads


def test_lanes_share_many_threads(lanes):
    # 4 intra-op threads and 2 lanes (what lane_count gives with at most 2): each lane runs 2
    # threads, so none sits idle, and the results still match the reference; the caller keeps its 4
    torch.set_num_threads(4)
    assert lane_count([2100, 1900], 512, 1024, max_lanes=2) == 2
    shape, kw = CASES["odd"]
    layer = make(no_aux(d_model=shape[-1], **kw))
    torch.manual_seed(1)
    check_against_naive(layer, torch.randn(shape), torch.float32, "odd")
    assert ran_in_two_lanes(lanes)
    assert lanes.lane_threads and all(n == 2 for n in lanes.lane_threads), lanes.lane_threads
    assert torch.get_num_threads() == 4
    for threads, expected in ((16, 8), (12, 6), (9, 3), (7, 7)):
        torch.set_num_threads(threads)
        assert lane_count([2100, 1900], 512, 1024) == expected, threads
