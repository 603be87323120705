"""Sharded checkpoints (``zero.checkpoint``): resume at the same layout bit for bit, at any other
layout like the uninterrupted single-process run, integrity, safe loading. The trainer's own
checkpointing is tested in tests/experiments/test_checkpointing.py.

The reshard matrix saves after 3 of 6 steps under each of single, dp2 ZeRO-1 + offload (2 ranks),
ep2 ZeRO-3 and ep4 ZeRO-2 (4 ranks), and resumes each checkpoint under every layout, in one spawn of
4 ranks (the 2-rank layout on ranks 0-1 over a subgroup) and one process.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle

import pytest
import torch

from tests.support import ckpt_cases as cc
from tests.support.dist import run_distributed
from zero import Layout
from zero import checkpoint as zc

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# Tolerance of a resumed run under another layout against the uninterrupted single-process run:
# the layouts sum gradients in another order (~1e-7 relative per step; tests/zero/test_engine.py), and
# Adam at eps 1e-4 passes that on over 6 steps. Measured: <= 2.4e-7 relative on losses, <= 1.9e-7
# absolute on weights of size ~0.1-1. A chunk loaded at a wrong offset, a lost optimizer moment or
# a stale replica moves a loss by > 1e-3.
LOSS_RTOL = 1e-6
WEIGHT_ATOL = 2e-6


def whole(state: dict) -> dict:
    """{name: tensor}: a rank's weights with its experts placed at their global rows."""
    return {n: w for n, (off, w) in state["weights"].items()}


def assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """The whole model from the ranks' final states: experts are the ep slices side by side."""
    out = {}
    for s in per_rank:
        for n, (off, w) in s["weights"].items():
            if off is None:
                out.setdefault(n, w)
                continue
            full = out.setdefault(n, torch.full((cc.E,) + tuple(w.shape[1:]), float("nan")))
            full[off : off + w.shape[0]] = w
    return out


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("matrix")
    ck = {name: str(root / name) for name in cc.LAYOUTS_ALL}
    results = {}  # (layout, loaded from or None) -> list of per-rank results
    # the single-process reference, saving its checkpoint
    results[("single", None)] = [cc.run("single", save=ck["single"])]
    # one spawn of 4 ranks (the 2-rank layouts on ranks 0-1): every layout saves, then loads every checkpoint
    multi = [n for n in cc.LAYOUTS_ALL if n != "single"]
    jobs = [(name, None, ck[name]) for name in multi]
    jobs += [(name, ck[src], None) for name in cc.LAYOUTS if name != "single" for src in cc.LAYOUTS]
    per_rank = run_distributed(cc.matrix_rank, 4, jobs, timeout=400)
    for i, (name, load, _) in enumerate(jobs):
        results[(name, None if load is None else os.path.basename(load))] = [r[i] for r in per_rank if r[i] is not None]
    for src in cc.LAYOUTS_ALL:
        results[("single", src)] = [cc.run("single", load=ck[src])]
    return results, ck


@pytest.mark.distributed
def test_same_layout_resumes_bit_for_bit(matrix):
    results, _ = matrix
    for name in cc.LAYOUTS:
        full, resumed = results[(name, None)], results[(name, name)]
        assert resumed[0]["losses"] == full[0]["losses"][cc.SAVE_AT :], name
        for a, b in zip(full, resumed):
            for n, (_, w) in a["weights"].items():
                assert torch.equal(b["weights"][n][1], w), f"{name}: {n}"
            for n, buf in a["buffers"].items():
                assert torch.equal(b["buffers"][n], buf), f"{name}: buffer {n}"
            assert b["step_count"] == a["step_count"] == cc.STEPS


@pytest.mark.distributed
def test_every_layout_resumes_every_other(matrix):
    results, _ = matrix
    ref = results[("single", None)][0]
    ref_w = whole(ref)
    # every layout trains like one process (tests/zero/test_engine.py), uninterrupted (src None) or resumed
    pairs = [(name, src) for name in cc.LAYOUTS for src in cc.LAYOUTS]
    pairs += [(name, None) for name in cc.LAYOUTS_ALL] + [("single", "dp2_z0")]
    for name, src in pairs:
        got = results[(name, src)]
        what = f"{name} resumed from {src}" if src else f"{name} uninterrupted"
        want = ref["losses"][cc.SAVE_AT :] if src else ref["losses"]
        torch.testing.assert_close(
            torch.tensor(got[0]["losses"]),
            torch.tensor(want),
            rtol=LOSS_RTOL,
            atol=0,
            msg=lambda m: f"{what}: losses: {m}",
        )
        w = assemble(got)
        assert set(w) == set(ref_w), what
        for n, want_w in ref_w.items():
            torch.testing.assert_close(w[n], want_w, rtol=0, atol=WEIGHT_ATOL, msg=lambda m: f"{what}: {n}: {m}")
        # the expert biases moved during the run (aux-loss-free balancing) and came back
        bias = {n: b for n, b in got[0]["buffers"].items() if n.endswith("expert_bias")}
        assert bias and all(torch.equal(b, ref["buffers"][n]) for n, b in bias.items()), what
        assert all(b.abs().sum() > 0 for b in bias.values()), what
    # and the run trained: a resumed run that ignored the checkpoint would start from the initial loss
    assert ref["losses"][-1] < ref["losses"][0]


@pytest.mark.distributed
def test_replicas_are_written_once(matrix):
    """Replicas (stage 0 on 2 ranks: everything) hand DCP the same chunks; each is stored once:
    every byte of the data files belongs to exactly one stored item, and each parameter's and
    moment's chunks add up to its global size."""
    _, ck = matrix
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for name, path in ck.items():
        md = zc.SafeReader(path).read_metadata()
        entries = md.state_dict_metadata
        params = {k[len(zc.PARAM) :]: v.size.numel() for k, v in entries.items() if k.startswith(zc.PARAM)}
        assert params and all(isinstance(v, TensorStorageMetadata) for v in entries.values()), name
        for key in ("", "exp_avg/", "exp_avg_sq/"):
            prefix = zc.PARAM if not key else f"{zc.OPTIM}{key}"
            for p, numel in params.items():
                chunks = entries[prefix + p].chunks
                assert sum(c.sizes.numel() for c in chunks) == numel, (name, prefix + p)
        stored = sum(info.length for info in md.storage_data.values())
        written = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".distcp"))
        assert written == stored, (name, written, stored)


# ----- integrity, keep_last, async, safe loading (one process) ----------------------------------
def _trained_engine(steps: int):
    engine = cc.build(Layout.single(), 0, False)
    cc.train_steps(engine, Layout.single(), 0, steps)
    return engine


def _save(engine, root, step):
    ck = zc.Checkpointer(engine, root, keep_last=10)
    ck.save(step)
    return zc.step_dir(root, step)


def _first_data_file(path):
    return sorted(p for p in path.iterdir() if p.suffix == ".distcp")[0]


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "delete the manifest", "delete a file"])
def test_damaged_checkpoint_is_named_and_the_older_one_used(tmp_path, damage):
    engine = _trained_engine(2)
    old = _save(engine, tmp_path, 2)
    cc.train_steps(engine, Layout.single(), 2, 3)
    new = _save(engine, tmp_path, 3)
    assert zc.verify(old) is None and zc.verify(new) is None
    data = _first_data_file(new)
    if damage == "flip a byte":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))
        expect = f"file {data.name} does not match its xxh3_128 checksum"
    elif damage == "truncate":
        data.write_bytes(data.read_bytes()[:-10])
        expect = f"file {data.name} has"
    elif damage == "delete the manifest":
        (new / zc.MANIFEST).unlink()
        expect = "no MANIFEST.json"
    else:
        (new / zc.META).unlink()
        expect = f"file {zc.META} is missing"
    assert expect in zc.verify(new)
    with pytest.warns(UserWarning, match=f"skipping checkpoint {new}: {expect}"):
        assert zc.latest_complete(tmp_path) == old
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        assert zc.Checkpointer(engine, tmp_path).latest() == old
    # an explicit path is verified too: an error naming the checkpoint and the file
    fresh = cc.build(Layout.single(), 0, False)
    with pytest.raises(ValueError, match=f"checkpoint {new} is incomplete or corrupt: {expect}"):
        zc.load(fresh, new)
    assert zc.load(fresh, old)["step"] == 2


@pytest.mark.distributed
def test_ranks_verify_a_share_each_and_agree_on_the_older_checkpoint(tmp_path):
    """Resume verification is split over the ranks (each re-reads about 1/n of the bytes), and a
    corrupt file only one rank reads makes every rank skip that checkpoint."""
    got = run_distributed(cc.shared_verification_rank, 2, str(tmp_path), timeout=120)
    victim = got[0]["victim"]
    assert [g["found"] for g in got] == ["step_00000001"] * 2
    assert any("step_00000002" in w and victim in w for w in got[0]["warned"]), got[0]["warned"]
    assert got[1]["warned"] == []  # one warning, from rank 0
    assert ("step_00000002", victim) in got[1]["read"] and ("step_00000002", victim) not in got[0]["read"]
    older = [{f for d, f in g["read"] if d == "step_00000001"} for g in got]
    assert not older[0] & older[1] and older[0] | older[1] == set(got[0]["files"]["step_00000001"])


def test_keep_last_never_deletes_the_only_complete_checkpoint(tmp_path):
    engine = _trained_engine(1)
    with pytest.raises(ValueError, match="keep_last=1 must be an integer >= 2"):
        zc.Checkpointer(engine, tmp_path, keep_last=1)
    ck = zc.Checkpointer(engine, tmp_path, keep_last=2)
    for step in (1, 2, 3):
        ck.save(step)
    assert [s for s, _ in zc.list_checkpoints(tmp_path)] == [3, 2]
    # newer incomplete ones (a save that died) are not counted and not touched; older ones go
    (zc.step_dir(tmp_path, 2) / zc.MANIFEST).unlink()
    for step in (4, 5):
        zc.step_dir(tmp_path, step).mkdir()
    assert zc.prune(tmp_path, 2) == [zc.step_dir(tmp_path, 2)]
    assert [s for s, _ in zc.list_checkpoints(tmp_path)] == [5, 4, 3]
    (zc.step_dir(tmp_path, 3) / zc.MANIFEST).unlink()
    assert zc.prune(tmp_path, 2) == []
    with pytest.warns(UserWarning, match="no MANIFEST.json"):
        assert zc.latest_complete(tmp_path, check=False) is None


def test_async_save_writes_the_state_at_the_save(tmp_path):
    """The step after an async save changes the weights while the files are being written; the
    checkpoint holds the state at the save (staged before save() returned)."""
    engine = _trained_engine(2)
    at_save = {n: w.clone() for n, w in engine.full_parameters().items()}
    ck = zc.Checkpointer(engine, tmp_path, async_save=True)
    path = ck.save(2)
    cc.train_steps(engine, Layout.single(), 2, 3)
    ck.close()
    assert zc.verify(path) is None
    fresh = cc.build(Layout.single(), 0, False)
    zc.load(fresh, path)
    for n, w in fresh.full_parameters().items():
        assert torch.equal(w, at_save[n]), n


class _Evil:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))  # what a malicious pickle does: call anything on load


def _rewrite_manifest(path):
    """What an attacker can do as well: the manifest guards against accidents, not against intent."""
    (path / zc.MANIFEST).unlink()
    zc.finish(path)  # digests every file as it now is


def test_a_malicious_pickle_in_a_checkpoint_does_not_run(tmp_path):
    engine = _trained_engine(1)
    path = _save(engine, tmp_path / "ck", 1)
    marker = tmp_path / "pwned"
    fresh = cc.build(Layout.single(), 0, False)
    # 1. DCP's .metadata (a plain pickle)
    good = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    _rewrite_manifest(path)
    with pytest.raises(pickle.UnpicklingError, match="posix.mkdir"):
        zc.load(fresh, path)
    assert not marker.exists()
    # 2. a pickle where a tensor's bytes belong: format 2 reads raw bytes and never unpickles them
    (path / ".metadata").write_bytes(good)
    _plant_pickled_payload(path, marker)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match=r"param/.* has \d+ bytes in __0_0.distcp, its metadata says"):
        zc.load(fresh, path)
    assert not marker.exists()
    # 3. the same in a format-1 checkpoint (torch.save items, read by torch.load(weights_only=True))
    old = _save_format_1(engine, tmp_path / "old")
    _plant_pickled_payload(old, marker)
    with pytest.raises(CheckpointException, match="unsupported GLOBAL posix.mkdir"):
        zc.load(fresh, old)
    assert not marker.exists()


def test_a_data_file_outside_the_checkpoint_is_refused(tmp_path):
    """The metadata names the data files; one named outside the directory is not read, even when
    it holds exactly the right bytes."""
    engine = _trained_engine(1)
    path = _save(engine, tmp_path / "ck", 1)
    md = zc.SafeReader(path).read_metadata()
    data = _first_data_file(path)
    (tmp_path / "outside.distcp").write_bytes(data.read_bytes())
    md.storage_data = {i: dataclasses.replace(v, relative_path="../outside.distcp") for i, v in md.storage_data.items()}
    (path / ".metadata").write_bytes(pickle.dumps(md))
    _rewrite_manifest(path)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match="names the data file '../outside.distcp' outside"):
        zc.load(cc.build(Layout.single(), 0, False), path)


def _plant_pickled_payload(path, marker):
    md = zc.SafeReader(path).read_metadata()
    index, info = next((i, v) for i, v in md.storage_data.items() if i.fqn.startswith(zc.PARAM))
    data = path / info.relative_path
    buf = io.BytesIO()
    torch.save(_Evil(marker), buf)
    raw = data.read_bytes()
    data.write_bytes(raw + buf.getvalue())
    md.storage_data[index] = dataclasses.replace(info, offset=len(raw), length=len(buf.getvalue()))
    (path / ".metadata").write_bytes(pickle.dumps(md))
    _rewrite_manifest(path)


def _save_format_1(engine, path):
    """A checkpoint as the previous version wrote it: DCP's own writer (``torch.save`` per item),
    format 1 in meta.json, SHA-256 in the manifest."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from zero.checkpoint.entries import _entries, _meta
    from zero.checkpoint.planners import _ChunkSavePlanner

    tensors, chunks, _ = _entries(engine, 0, True)
    path.mkdir()
    (path / zc.META).write_text(json.dumps({**_meta(engine, engine.step_count, {}), "format": 1}))
    dcp.save(tensors, storage_writer=FileSystemWriter(path), planner=_ChunkSavePlanner(chunks), no_dist=True)
    files = {p.name: zc.file_digest(p, "sha256") for p in sorted(path.iterdir())}
    (path / zc.MANIFEST).write_text(json.dumps({"format": 1, "files": files}))
    return path


def test_a_format_1_checkpoint_still_loads_and_verifies(tmp_path):
    engine = _trained_engine(2)
    path = _save_format_1(engine, tmp_path / "old")
    assert zc.verify(path) is None
    fresh = cc.build(Layout.single(), 0, False)
    zc.load(fresh, path)
    for (n, w), (_, v) in zip(engine.full_parameters().items(), fresh.full_parameters().items()):
        assert torch.equal(w, v), n
    data = path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))
    assert "does not match its sha256 checksum" in zc.verify(path)


@pytest.mark.distributed
def test_zero_checkpoint_imports_without_moe_or_hydra():
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\n"
        "for m in ('hydra', 'omegaconf', 'wandb', 'transformers', 'safetensors'): sys.modules[m] = None\n"
        "import zero.checkpoint\n"
        "assert 'moe' not in sys.modules, 'zero imports moe'\n"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=root,
        env=dict(os.environ, PYTHONPATH=str(root)),
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_a_state_with_non_finite_weights_is_never_saved(tmp_path):
    engine = _trained_engine(1)
    engine.flats[-1].master[0] = float("nan")
    with pytest.raises(ValueError, match="refusing to save .*: parameter .* holds non-finite values"):
        zc.save(engine, tmp_path / "x")
    assert not (tmp_path / "x").exists()
