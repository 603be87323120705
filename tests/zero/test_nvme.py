"""NVMe offload (``offload="nvme"``, zero.nvme): the same training bit for bit as with the state in
memory, for AdamW, SGD with momentum and the fused default, under stages 0-3 (stage 3's parameter
shards in the files too), with expert and pipeline parallelism; resident memory bounded by the
buffers; checkpoints that resume either way;
a bad ``offload_dir`` refused by name; the last checkpoint intact after a kill -9 mid-update.

Bit for bit: an elementwise optimizer computes each element alike however the shard is cut into
tensors (zero.nvme's docstring), and the engine's arithmetic is otherwise the same, so any
difference at all is a bug (a sub-group read from the wrong offset, a state not written back, a
stale buffer, a missed compute-weight refresh).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support import nvme_cases as nc
from tests.support.dist import run_distributed
from zero import Layout, ZeroEngine, nvme
from zero import checkpoint as zc

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("opt", ["adamw", "sgd", "fused"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nvme_trains_bit_for_bit_like_memory(tmp_path, opt, stage):
    layout = Layout.single()
    memory = nc.run(layout, stage, opt)
    files = nc.run(layout, stage, opt, "nvme", tmp_path)
    engine = files["engine"]
    assert len(engine._nvme.plan.subgroups) >= 2 * nvme._SETS  # every buffer set is reused
    assert nc.same(memory, files)
    assert os.listdir(tmp_path) == []  # the files have no names: nothing to leave behind


@pytest.mark.parametrize("mixed_precision", ["fp32", "bf16"])
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_stage3_parameter_shards_are_in_the_files_bit_for_bit(tmp_path, opt, mixed_precision):
    """Stage 3: no flat keeps its compute shard in memory; each gather reads it from the files (the
    master file in fp32, a compute file in bf16, written by the step from its own buffers), and the
    10 steps are those of stage 3 in memory bit for bit."""
    from zero.memory import measure_memory

    layout = Layout.single()
    memory = nc.run(layout, 3, opt, mixed_precision=mixed_precision)
    files = nc.run(layout, 3, opt, "nvme", tmp_path, mixed_precision=mixed_precision)
    engine = files["engine"]
    assert nc.same(memory, files)
    assert nc.shards_in_files(engine)
    want = ["master", *(["exp_avg", "exp_avg_sq"] if opt == "adamw" else ["momentum_buffer"])]
    assert [k for k, _ in engine._nvme.slots] == want + (["compute"] if mixed_precision == "bf16" else [])
    assert all(measure_memory(engine)[k]["params"] == 0 for k in ("dense", "expert"))
    assert measure_memory(memory["engine"])["dense"]["params"] > 0  # the measure sees shards in memory
    # every gather of every step read its shard: forward and backward, 2 micro-batches, 10 steps
    blocks = sum(1 for u in engine.units if u.flats)
    assert engine._nvme.shards.stats["reads"] >= nc.STEPS * 2 * 2 * blocks - 2 * nc.STEPS


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_a_pool_of_fewer_slots_than_the_gathers_want_trains_the_same(tmp_path, monkeypatch, slots):
    """With fewer slots than the gathers in flight and the reads ahead want, a read ahead nobody
    took is dropped, or a gather in flight completed early, to free one: the same training bit for
    bit. After each step the last blocks' shards are read ahead (the wrong ones for the next
    forward, which starts at the first block), so the forward must drop them."""
    from zero.nvme import shards

    monkeypatch.setattr(shards, "_SLOTS", slots)
    layout = Layout.single()
    memory = nc.run(layout, 3, "adamw", mixed_precision="bf16")
    engine = nc.build(layout, 3, "adamw", "nvme", tmp_path, mixed_precision="bf16")
    pool, step = engine._nvme.shards, engine.step

    def step_then_read_the_last_blocks(*a, **k):
        norm = step(*a, **k)
        pool.read_ahead(list(reversed(engine.flats)))
        return norm

    engine.step = step_then_read_the_last_blocks
    losses = nc.train(engine, 0, nc.STEPS)
    assert nc.same(memory, {"losses": losses, "weights": engine.full_parameters()})
    assert len(pool.slots) == slots and pool.stats["dropped"] > 0, pool.stats
    if slots == 1:  # a unit's dense and expert flats start their gathers together: one waits
        assert pool.stats["waited_gathers"] > 0, pool.stats


def test_a_shard_read_ahead_before_a_step_is_not_used_after_it(tmp_path):
    """Shards read ahead (here: every flat's, just before the step) hold the old weights: the step
    drops them, and the next forward reads the new ones."""
    layout = Layout.single()
    memory = nc.run(layout, 3, "sgd", mixed_precision="bf16")
    engine = nc.build(layout, 3, "sgd", "nvme", tmp_path, mixed_precision="bf16")
    pool = engine._nvme.shards
    step = engine.step

    def read_everything_then_step(*a, **k):
        pool.read_ahead(engine.flats)
        assert any(s.flat is not None for s in pool.slots)
        return step(*a, **k)

    engine.step = read_everything_then_step
    losses = nc.train(engine, 0, nc.STEPS)
    assert nc.same(memory, {"losses": losses, "weights": engine.full_parameters()})


@pytest.mark.parametrize("src", ["none", "nvme"])
def test_a_bf16_stage3_checkpoint_resumes_into_nvme_shards(tmp_path, src):
    """Loaded into stage 3 under NVMe offload, the master weights go to the files item by item and
    the bf16 compute shards are rewritten from them through the step's buffers: the resumed run is
    the uninterrupted one."""
    layout = Layout.single()
    full = nc.run(layout, 3, "adamw", mixed_precision="bf16")
    engine = nc.build(layout, 3, "adamw", src, tmp_path / "a", mixed_precision="bf16")
    nc.train(engine, 0, 4)
    path = zc.save(engine, tmp_path / "ckpt") or tmp_path / "ckpt"
    resumed = nc.build(layout, 3, "adamw", "nvme", tmp_path / "b", mixed_precision="bf16")
    zc.load(resumed, path)
    losses = full["losses"][:4] + nc.train(resumed, 4, nc.STEPS)
    assert nc.same(full, {"losses": losses, "weights": resumed.full_parameters()})
    assert nc.shards_in_files(resumed)


@pytest.mark.parametrize("opt", ["adagrad", "rmsprop"])
def test_other_optimizers_state_goes_to_the_files(tmp_path, opt):
    layout = Layout.single()
    files = nc.run(layout, 2, opt, "nvme", tmp_path)
    assert nc.same(nc.run(layout, 2, opt), files)
    slots = [k for k, _ in files["engine"]._nvme.slots]
    assert slots == (["master", "sum"] if opt == "adagrad" else ["master", "square_avg", "momentum_buffer", "grad_avg"])


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_compute_weights_with_nvme_masters(tmp_path, stage):
    """Stage 2: the bf16 weights in memory; stage 3: the bf16 shards in the compute file, written
    from the step's buffers (by the fused kernel itself, or a copy after the update)."""
    layout = Layout.single()
    for opt in ("adamw", "fused"):  # the fused kernel writes the bf16 copy itself
        memory = nc.run(layout, stage, opt, mixed_precision="bf16")
        files = nc.run(layout, stage, opt, "nvme", tmp_path, mixed_precision="bf16")
        assert nc.same(memory, files), opt
        assert nc.shards_in_files(files["engine"]) == (stage == 3)


def test_between_steps_the_state_is_in_the_files_only(tmp_path):
    engine = nc.run(Layout.single(), 1, "adamw", "nvme", tmp_path, steps=2)["engine"]
    off = engine._nvme
    assert off.state_in_files and [k for k, _ in off.slots] == ["master", "exp_avg", "exp_avg_sq"]
    shards = [t for f in engine.flats for _, _, _, t in f.shards]
    assert len(shards) > len(engine.flats)  # cut into sub-group pieces
    for t in shards:
        assert set(engine.optimizer.state[t]) == {"step"}  # the scalar stays, the moments are in files
        assert torch.isnan(t).all()  # a stale read shows, it does not pass for a weight
        if t.numel() > 1:
            with pytest.raises(RuntimeError):
                t.add_(1.0)  # and a write is refused
    assert engine.weights_finite()
    assert off.stats["read_bytes"] > 0 and off.stats["write_bytes"] > 0


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("src, dst", [("nvme", "none"), ("none", "nvme"), ("nvme", "nvme"), ("nvme", "cpu")])
def test_a_checkpoint_resumes_across_memory_and_nvme(tmp_path, stage, src, dst):
    """Saved after 4 of 10 steps under one placement, resumed under the other: the 10-step run."""
    layout = Layout.single()
    offload_dir = tmp_path / "offload"
    full = nc.run(layout, stage, "adamw", src, offload_dir)
    engine = nc.build(layout, stage, "adamw", src, offload_dir)
    nc.train(engine, 0, 4)
    ck = zc.Checkpointer(engine, tmp_path / "ckpt")
    path = ck.save(4)
    ck.close()
    resumed = nc.build(layout, stage, "adamw", dst, offload_dir)
    assert zc.Checkpointer(resumed, tmp_path / "ckpt").latest() == path
    assert zc.load(resumed, path)["layout"]["offload_mode"] == src
    losses = full["losses"][:4] + nc.train(resumed, 4, nc.STEPS)
    assert nc.same(full, {"losses": losses, "weights": resumed.full_parameters()})


def test_an_async_save_of_nvme_state_writes_the_state_at_the_save(tmp_path, monkeypatch):
    """The offload files are copied beside themselves (not into RAM) and the save reads the copy
    while the next steps change the files; without room for the copy the save is synchronous."""
    engine = nc.build(Layout.single(), 1, "adamw", "nvme", tmp_path / "offload")
    nc.train(engine, 0, 2)
    at_save = engine.full_parameters()
    ck = zc.Checkpointer(engine, tmp_path / "ckpt", async_save=True)
    copies = []
    snapshot = nvme.NvmeOffload.snapshot
    monkeypatch.setattr(nvme.NvmeOffload, "snapshot", lambda self: copies.append(snapshot(self)) or copies[-1])
    path = ck.save(2)
    nc.train(engine, 2, 4)  # while the save may still be writing
    ck.close()
    assert copies and copies[0] is not None and not copies[0]._finalizer.alive  # the copy was closed
    assert zc.verify(path) is None
    fresh = nc.build(Layout.single(), 1, "adamw", "none")
    zc.load(fresh, path)
    for n, w in fresh.full_parameters().items():
        assert torch.equal(w, at_save[n]), n
    # no room for the copy: a warning, and the save is complete when save() returns
    monkeypatch.setattr(nvme.NvmeOffload, "snapshot", lambda self: None)
    ck = zc.Checkpointer(engine, tmp_path / "ckpt2", async_save=True)
    with pytest.warns(UserWarning, match="has no room for a copy of the offload files"):
        path = ck.save(4)
    assert zc.verify(path) is None
    ck.close()


def test_a_non_finite_nvme_master_is_never_saved(tmp_path):
    engine = nc.build(Layout.single(), 1, "adamw", "nvme", tmp_path / "offload")
    nc.train(engine, 0, 1)
    engine._nvme.write_range(0, 5, torch.tensor([float("nan")]))
    assert not engine.weights_finite()
    with pytest.raises(ValueError, match="holds non-finite values"):
        zc.save(engine, tmp_path / "x")


def _mounted(tmp_path, options: str):
    import shutil

    where = tmp_path / f"mnt-{options.replace(',', '-').replace('=', '')}"
    where.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        return None
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    return where if r.returncode == 0 else None


def _umount(where):
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_bad_arguments_are_refused_before_anything_starts(tmp_path):
    net = nc.sharded_net(Layout.single())
    with pytest.raises(ValueError, match=r"offload='ssd' must be one of \('none', 'cpu', 'nvme'\)"):
        ZeroEngine(net, None, stage=1, offload="ssd")
    with pytest.raises(ValueError, match="offload='nvme' needs offload_dir="):
        ZeroEngine(net, None, stage=1, offload="nvme")
    with pytest.raises(ValueError, match="offload_dir='/x' only applies to offload='nvme'"):
        ZeroEngine(net, None, stage=1, offload="cpu", offload_dir="/x")
    with pytest.raises(ValueError, match="offload_sub_group_elems=1000 must be a positive multiple of 4096"):
        ZeroEngine(net, None, stage=1, offload="nvme", offload_dir=tmp_path, offload_sub_group_elems=1000)
    assert all(p.data.data_ptr() for p in net.parameters())  # the model is untouched


@pytest.mark.distributed  # a subprocess (mount, or a fresh interpreter)
def test_a_bad_offload_dir_is_refused_by_name_with_the_bytes(tmp_path, monkeypatch):
    def attempt(d):
        with pytest.raises(ValueError) as info:
            nc.build(Layout.single(), 3, "adamw", "nvme", d)
        msg = str(info.value)
        assert f"offload_dir={d}" in msg and "this rank needs" in msg, msg
        need = int(msg.split("this rank needs ")[1].split(" bytes")[0])
        assert need >= 3 * sum(p.numel() for p in nc.sharded_net(Layout.single()).parameters()) * 4
        return msg

    # no collective may run before the refusal: there would be peers waiting in it
    import torch.distributed as dist

    for name in ("broadcast", "all_reduce", "all_gather_into_tensor", "barrier"):
        monkeypatch.setattr(dist, name, lambda *a, **k: pytest.fail(f"a collective ({name}) ran"))
    assert "its parent" in attempt(tmp_path / "missing" / "offload") and "does not exist" in attempt(
        tmp_path / "missing" / "offload"
    )
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in attempt(tmp_path / "file")
    skipped = []
    ro = _mounted(tmp_path, "ro,size=1m")
    if ro is None:
        skipped.append("read-only")
    else:
        try:
            assert "is not writable" in attempt(ro) and "Read-only file system" in attempt(ro)
        finally:
            _umount(ro)
    small = _mounted(tmp_path, "size=64k")
    if small is None:
        skipped.append("full")
    else:
        try:
            msg = attempt(small)
            assert "is full" in msg and "bytes are free there" in msg, msg
            assert os.listdir(small) == []  # the reservation that failed left nothing behind
        finally:
            _umount(small)
    if skipped:
        pytest.skip(f"mounting a tmpfs is not permitted here: the {' and '.join(skipped)} case untested")


def test_buffered_io_where_o_direct_is_not_available(tmp_path, monkeypatch):
    """Where O_DIRECT is refused (tmpfs before Linux 6.6, some network filesystems): buffered I/O
    with fadvise, the same results. Forced here by hiding the flag."""
    memory = nc.run(Layout.single(), 1, "adamw")
    direct = nc.run(Layout.single(), 1, "adamw", "nvme", tmp_path / "a")
    monkeypatch.delattr(os, "O_DIRECT")
    buffered = nc.run(Layout.single(), 1, "adamw", "nvme", tmp_path / "b")
    assert direct["engine"]._nvme.direct and not buffered["engine"]._nvme.direct
    assert nc.same(memory, direct) and nc.same(memory, buffered)


def _subprocess(*args, timeout=300, env=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "tests.support.nvme_cases", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
    )


@pytest.mark.distributed  # a subprocess (mount, or a fresh interpreter)
def test_resident_memory_is_bounded_by_the_buffers_not_the_state(tmp_path):
    """A fresh process: each of three AdamW steps of a 3.1M-parameter net (36 MiB of master weights
    and moments) raises the peak resident memory by about the buffers (3 MiB; measured 2.0 MiB, as
    the gradient buffer is unused on a CPU), not by the state; the same steps in memory raise it by
    the moments they allocate (measured 38 MiB: the measure does see state). The margin, a quarter
    of the state, covers the allocator and transparent huge pages (2 MiB at a touch)."""
    out = {}
    for offload in ("nvme", "none"):
        r = _subprocess("memory", offload, tmp_path, 1024, 65536)
        assert r.returncode == 0, r.stderr
        out[offload] = json.loads(r.stdout.strip().splitlines()[-1])
    files, memory = out["nvme"], out["none"]
    assert files["state_bytes"] >= 10 * files["buffer_bytes"]
    assert files["step_peak_bytes"] < files["buffer_bytes"] + files["state_bytes"] // 4, files
    assert memory["step_peak_bytes"] > memory["state_bytes"] // 2, memory  # the moments, 2/3 of the state
    assert files["files_left"] == []
    # a checkpoint saved from the files and loaded back into them holds items, not the state: at most
    # two items at once (one flat's master or moment, 12.6 MB each here: the one read and the one
    # handed on; measured 13.3-18.6 MB saving, 21.0 MB loading), never the 37.8 MB state. (The same
    # in memory rises by 1.4 MB / 0.1 MB: there the state is resident already.)
    item = files["state_bytes"] // 3  # one flat (the net is one unit), three slots
    bound = 2 * item + files["buffer_bytes"]
    assert bound < files["state_bytes"]
    assert files["save_peak_bytes"] < bound and files["load_peak_bytes"] < bound, files


@pytest.mark.distributed  # a subprocess (mount, or a fresh interpreter)
def test_stage3_shards_do_not_stay_resident(tmp_path):
    """A fresh process: stage 3 training of a 32-layer net (32 MiB of fp32 shards, one unit per
    layer) leaves resident, from before the model was built, about the buffers (the step's buffer
    sets and the shard pool's four slots, 11 MiB), not the shards, and no gradient (one rank: each
    flat's reduced gradient is its whole buffer, freed after the step); the same training in memory
    leaves the weights and moments too (the measure does see them). At the peak it holds one step's
    gradients (32 MiB, in memory either way) beside the buffers. Run with glibc's mmap threshold
    fixed, so freed tensors leave the process; the margin is a quarter of the shards."""
    out = {}
    env = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    for offload in ("nvme", "none"):
        r = _subprocess("shards", offload, tmp_path, 512, 32, 65536, env=env)
        assert r.returncode == 0, r.stderr
        out[offload] = json.loads(r.stdout.strip().splitlines()[-1])
    files, memory = out["nvme"], out["none"]
    shards, margin = files["shard_bytes"], files["shard_bytes"] // 4
    assert shards >= 2 * files["buffer_bytes"], files
    assert files["grad_held_bytes"] == memory["grad_held_bytes"] == 0
    assert files["held_bytes"] < files["buffer_bytes"] + margin, files
    assert files["peak_bytes"] - files["grad_bytes"] < files["buffer_bytes"] + margin, files
    assert memory["held_bytes"] > shards, memory  # weights and moments: 3x the shards
    assert files["files_left"] == []


@pytest.mark.distributed  # a subprocess (mount, or a fresh interpreter)
def test_a_kill_during_an_update_leaves_the_last_checkpoint_intact(tmp_path):
    offload, root, marker = tmp_path / "offload", tmp_path / "ckpt", tmp_path / "marker"
    root.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.nvme_cases", "kill", str(offload), str(root), str(marker)],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the update never started"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)  # half the sub-groups of step 3 are written back
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert os.listdir(offload) == []  # no offload file outlives its process
    path = zc.latest_complete(root)
    assert path == zc.step_dir(root, 2) and zc.verify(path) is None
    fresh = nc.build(Layout.single(), 3, "adamw", "nvme", tmp_path / "offload2")
    zc.load(fresh, path)
    want = torch.load(root / "weights_at_2.pt")
    for n, w in fresh.full_parameters().items():
        assert torch.equal(w, want[n]), n


@pytest.mark.distributed
def test_two_ranks_with_expert_parallelism(tmp_path):
    got = run_distributed(nc.ep2_rank, 2, str(tmp_path / "offload"), str(tmp_path / "ckpt"), timeout=900)
    for rank, out in enumerate(got):
        for key, ok in out.items():
            if key != "bad":
                assert ok, (rank, key)
    assert "offload_dir=" in got[1]["bad"] and "its parent" in got[1]["bad"] and "this rank needs" in got[1]["bad"]
    assert "another rank's offload_dir" in got[0]["bad"]


@pytest.mark.distributed
def test_two_pipeline_stages(tmp_path):
    got = run_distributed(nc.pp2_rank, 2, str(tmp_path), timeout=600)
    assert got == [True, True]


def test_the_benchmark_runs(tmp_path, capsys):
    """experiments/bench/nvme.py on a tiny model: a benchmark is a script, not a test, but a broken
    one should not wait for the next person who wants a figure."""
    from experiments.bench import nvme as bench

    figures = bench.main(
        ["--dir", str(tmp_path), "--params", "3e5", "--d", "64", "--steps", "1", "--sub-group", "4096"]
    )
    assert figures["io_efficiency"] > 0 and figures["disk"]["read"] > 0
    assert set(figures["runs"]) == {"none", "cpu", "nvme"}
    assert "I/O efficiency" in capsys.readouterr().out
