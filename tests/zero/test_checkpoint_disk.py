"""A checkpoint save that meets a full disk: the partial directory is removed (it would hold the
space and fail every retry), every complete checkpoint is kept, and every rank raises one
``CheckpointDiskFull`` naming the directory, the bytes the save needs and the bytes free."""

from __future__ import annotations

import re
import shutil
import warnings

import pytest

from tests.support import disk_full as df
from tests.support.dist import run_distributed
from zero import checkpoint as zc
from zero.checkpoint import integrity, state

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _numbers(message: str) -> tuple[int, int]:
    m = re.search(r"the save needs (\d+) bytes and (\d+) bytes are free", message)
    assert m, message
    return int(m.group(1)), int(m.group(2))


def _two_complete(root, **kw):
    eng = df.engine()
    ck = zc.Checkpointer(eng, root, keep_last=3, **kw)
    ck.save(1)
    df.train(eng, 1)
    ck.save(2)
    ck.wait()
    df.train(eng, 1)
    return eng, ck


def _check_after(root, error, needed):
    """The partial step 3 is gone, steps 1 and 2 verify, and the error names what it should."""
    assert [s for s, _ in zc.list_checkpoints(root)] == [2, 1]
    assert all(zc.verify(p) is None for _, p in zc.list_checkpoints(root))
    assert zc.latest_complete(root) == zc.step_dir(root, 2)
    assert error.directory == zc.step_dir(root, 3) and str(zc.step_dir(root, 3)) in str(error)
    assert (error.needed, error.free) == _numbers(str(error))
    assert error.needed == needed
    assert abs(error.free - shutil.disk_usage(root).free) < 64 << 20  # other writers share this disk
    assert "step_00000002" in str(error) and "step_00000001" in str(error)  # the kept ones are named


@pytest.mark.parametrize("where", ["data file", "meta.json", "manifest"])
def test_a_full_disk_removes_the_partial_save_and_names_the_numbers(tmp_path, monkeypatch, where):
    eng, ck = _two_complete(tmp_path)
    needed = df.data_bytes(zc.step_dir(tmp_path, 2))  # the same model, the same entries
    if where == "data file":
        ctx = df.enospc_after(1000)
    else:

        def full(path, data):
            raise OSError(28, "No space left on device", str(path))

        # meta.json is written by state's import of write_durably, the manifest by integrity's
        monkeypatch.setattr(state if where == "meta.json" else integrity, "write_durably", full)
        ctx = df.enospc_after(1 << 60)
    with ctx, pytest.raises(zc.CheckpointDiskFull) as info:
        ck.save(3)
    assert isinstance(info.value, OSError) and info.value.errno == 28
    _check_after(tmp_path, info.value, needed)
    monkeypatch.undo()
    ck.save(3)  # the space is back: the retry succeeds
    assert zc.latest_complete(tmp_path) == zc.step_dir(tmp_path, 3)
    ck.close()


def test_an_async_save_that_meets_a_full_disk_raises_at_the_next_call(tmp_path):
    eng, ck = _two_complete(tmp_path, async_save=True)
    needed = df.data_bytes(zc.step_dir(tmp_path, 2))
    with df.enospc_after(1000):
        ck.save(3)  # returns once staged
        with pytest.raises(zc.CheckpointDiskFull) as info:
            ck.close()
    _check_after(tmp_path, info.value, needed)


def test_the_bytes_needed_are_what_a_save_writes(tmp_path):
    """``needed`` is known before the save writes: the sum of what each rank will write."""
    eng = df.engine()
    ck = zc.Checkpointer(eng, tmp_path, keep_last=2)
    ck.save(1, files={"config.yaml": "x: 1\n"})
    with df.enospc_after(0), pytest.raises(zc.CheckpointDiskFull) as info:
        ck.save(2, files={"config.yaml": "x: 1\n"})
    assert info.value.needed == df.data_bytes(zc.step_dir(tmp_path, 1))


def test_the_first_save_warns_when_keep_last_plus_one_do_not_fit(tmp_path, monkeypatch):
    eng = df.engine()
    with pytest.warns(UserWarning, match=r"keep_last \+ 1 = 3 checkpoints of \d+ bytes"):
        monkeypatch.setattr(state, "_free_bytes", lambda path: 1000)
        ck = zc.Checkpointer(eng, tmp_path, keep_last=2)
        ck.save(1)
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*a save will meet a full disk")
        ck.save(2)  # only the first save checks
        zc.Checkpointer(eng, tmp_path / "roomy", keep_last=2).save(1)  # enough room: no warning


def test_a_real_full_tmpfs(tmp_path):
    """A 2 MiB tmpfs holds two checkpoints of ~0.8 MB, not three: the third save meets ENOSPC."""
    with df.small_tmpfs("2m") as root:
        if root is None:
            pytest.skip("mounting a tmpfs is not permitted here (needs root and CAP_SYS_ADMIN)")
        eng = df.engine(width=256)
        with pytest.warns(UserWarning, match="a save will meet a full disk"):
            ck = zc.Checkpointer(eng, root, keep_last=3)
            ck.save(1)
        df.train(eng, 1)
        ck.save(2)
        df.train(eng, 1)
        needed = df.data_bytes(zc.step_dir(root, 2))
        with pytest.raises(zc.CheckpointDiskFull) as info:
            ck.save(3)
        e = info.value
        _check_after(root, e, needed)
        assert e.free == shutil.disk_usage(root).free < e.needed
        ck.close()


@pytest.mark.distributed
@pytest.mark.parametrize("victim, async_save", [(1, False), (0, True)])
def test_one_ranks_full_disk_stops_both_ranks_with_the_message(tmp_path, victim, async_save):
    got = run_distributed(df.two_rank_disk_full, 2, str(tmp_path), victim, async_save, timeout=180)
    assert [g["type"] for g in got] == ["CheckpointDiskFull"] * 2
    assert got[0]["message"] == got[1]["message"] and got[0]["fields"] == got[1]["fields"]
    directory, needed, free = got[0]["fields"]
    assert directory == str(zc.step_dir(tmp_path, 3)) and needed > 0 and free > 0
    assert _numbers(got[0]["message"]) == (needed, free)
    assert [g["latest"] for g in got] == ["step_00000002"] * 2
    assert got[0]["dirs"] == ["step_00000001", "step_00000002"]
    assert needed == df.data_bytes(zc.step_dir(tmp_path, 2))
