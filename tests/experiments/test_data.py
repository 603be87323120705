"""Data: deterministic disjoint by-file split, dp shards that rebuild the global batch, clear errors."""

import math

import numpy as np
import pytest
import torch

from experiments.training.data import LMData, build_data, load_stdlib, load_text, load_tokens, split_files, stdlib_path


def _folder(tmp_path, n=40):
    root = tmp_path / "corpus"
    for i in range(n):
        sub = root / ("a" if i % 2 else "b")
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{i:02d}.txt").write_text(f"file {i}\n" + f"x = {i}\n" * (i + 1))
    (root / "blob.bin").write_bytes(b"\x00\x01\x02")  # binary: skipped
    (root / "empty.txt").write_text("")  # empty: skipped
    return root


def test_split_deterministic_disjoint_and_by_file():
    names = [f"pkg/mod{i}.py" for i in range(500)]
    train, val = split_files(names, 0.1)
    assert (train, val) == split_files(list(reversed(names)), 0.1)  # order of listing is irrelevant
    assert set(train).isdisjoint(val) and set(train) | set(val) == set(names)
    assert 25 <= len(val) <= 75  # about 10% of 500; a hash, so not exactly
    assert split_files(names, 0.1, split_seed=1) != (train, val)
    # a file's side does not depend on which other files exist
    assert set(split_files(names[:100], 0.1)[1]) == set(val) & set(names[:100])
    # two files: both sides non-empty
    t2, v2 = split_files(["a.py", "b.py"], 0.05)
    assert len(t2) == len(v2) == 1


def test_text_folder_split_and_cache(tmp_path):
    root = _folder(tmp_path)
    d1 = load_text(root, pattern="**/*", val_fraction=0.25, cache_dir=tmp_path / "cache")
    d2 = load_text(root, pattern="**/*", val_fraction=0.25, cache_dir=tmp_path / "cache")  # from the cache
    assert isinstance(d2.train, np.memmap)
    np.testing.assert_array_equal(np.asarray(d1.train), np.asarray(d2.train))
    np.testing.assert_array_equal(np.asarray(d1.val), np.asarray(d2.val))
    assert d1.info["files"] == 40  # the binary and the empty file are skipped
    # by file: every document lies whole in one split (each ends with the NUL separator)
    train_docs = set(bytes(np.asarray(d1.train)).split(b"\x00")[:-1])
    val_docs = set(bytes(np.asarray(d1.val)).split(b"\x00")[:-1])
    assert train_docs.isdisjoint(val_docs) and len(train_docs) + len(val_docs) == 40
    assert all(doc.startswith(b"file ") for doc in train_docs | val_docs)


@pytest.mark.parametrize("pattern", ["**/*.txt", "**/*", "*.txt", "a/**/*.txt"])
def test_the_file_walk_lists_what_path_glob_lists(tmp_path, pattern):
    # "**/<name>" walks the tree pruning the excluded folders; Path.glob, filtered after, is the reference
    from experiments.training.data import _list_files

    for rel in ["a/b/x.txt", ".h/.y.txt", "z.txt", "skip/q.txt", "a/skip/r.txt"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    (tmp_path / "d.txt").mkdir()  # a folder whose name matches
    (tmp_path / "into").symlink_to(tmp_path / "a")  # a symlinked folder: not entered
    (tmp_path / "l.txt").symlink_to(tmp_path / "z.txt")  # a symlinked file: kept
    (tmp_path / "broken.txt").symlink_to(tmp_path / "nowhere")  # a broken link: not a file
    ref = sorted(
        p.relative_to(tmp_path).as_posix()
        for p in tmp_path.glob(pattern)
        if p.is_file() and "skip" not in p.relative_to(tmp_path).parts[:-1]
    )
    assert ref and _list_files(tmp_path, pattern, ("skip",)) == ref


def test_stdlib_corpus():
    data = load_stdlib()  # the cache real runs use (a fresh build is covered by the text-folder test)
    assert data.vocab_size == 256 and data.info["files"] > 100
    assert len(data.val) > 10_000 and len(data.train) > 10 * len(data.val)
    assert not str(stdlib_path()).endswith("site-packages")
    # Python source: the unigram entropy of bytes is a few nats, far below uniform ln(256)
    assert 2.5 < data.unigram_entropy() < 4.5 < math.log(256)


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_shards_rebuild_the_global_batch(dp):
    data = LMData(
        np.arange(10_000, dtype=np.uint16) % 251, np.arange(500, dtype=np.uint16) % 251, 256, "synthetic", seed=3
    )
    for step in (0, 7):
        x, y = data.get_batch("train", step, 12, 9)
        parts = [data.get_batch("train", step, 12, 9, r, dp) for r in range(dp)]
        assert all(p[0].shape == (12 // dp, 9) for p in parts)
        torch.testing.assert_close(torch.cat([p[0] for p in parts]), x, rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([p[1] for p in parts]), y, rtol=0, atol=0)
    torch.testing.assert_close(y[:, :-1], x[:, 1:], rtol=0, atol=0)  # targets are the next tokens
    # reproducible per (seed, step); different steps and seeds draw different windows
    assert torch.equal(data.get_batch("train", 5, 12, 9)[0], data.get_batch("train", 5, 12, 9)[0])
    assert not torch.equal(data.get_batch("train", 5, 12, 9)[0], data.get_batch("train", 6, 12, 9)[0])
    other = LMData(data.train, data.val, 256, "synthetic", seed=4)
    assert not torch.equal(other.get_batch("train", 5, 12, 9)[0], data.get_batch("train", 5, 12, 9)[0])
    # with micro-batches: rank r's j-th micro-batch is its share of one process's j-th micro-batch
    x = data.get_batch("train", 3, 24, 9)[0]
    assert torch.equal(data.get_batch("train", 3, 24, 9, microbatches=3)[0], x)  # dp=1: the same rows
    parts = [data.get_batch("train", 3, 24, 9, r, dp, microbatches=3)[0].view(3, 24 // dp // 3, 9) for r in range(dp)]
    for j in range(3):
        assert torch.equal(torch.cat([p[j] for p in parts]), x[j * 8 : (j + 1) * 8]), (dp, j)
    with pytest.raises(ValueError, match="not divisible by the data-parallel size 4 x 5 micro-batches"):
        data.get_batch("train", 0, 24, 9, 0, 4, microbatches=5)
    with pytest.raises(ValueError, match="not divisible by the data-parallel size 5"):
        data.get_batch("train", 0, 12, 9, 0, 5)


def test_unigram_entropy():
    data = LMData(np.array([0, 1], dtype=np.uint8), np.array([1, 1, 2, 2, 2, 2], dtype=np.uint8), 256, "t")
    p = np.array([1 / 3, 2 / 3])
    assert data.unigram_entropy() == pytest.approx(-(p * np.log(p)).sum())


def test_tokens_folder_and_single_file(tmp_path):
    (tmp_path / "train.bin").write_bytes(np.arange(1000, dtype=np.uint16).tobytes())
    (tmp_path / "val.bin").write_bytes(np.arange(100, dtype=np.uint16).tobytes())
    d = load_tokens(tmp_path, vocab_size=1000)
    assert isinstance(d.train, np.memmap) and len(d.train) == 1000 and d.vocab_size == 1000
    x, y = d.get_batch("val", 0, 4, 10)
    assert x.dtype == torch.int64 and int(x.max()) < 100
    d1 = load_tokens(tmp_path / "train.bin", vocab_size=1000, val_fraction=0.1)
    assert len(d1.train) == 900 and len(d1.val) == 100
    cfg = {"source": "tokens", "path": str(tmp_path), "vocab_size": 1000, "val_fraction": 0.05}
    assert len(build_data(cfg).val) == 100


def test_errors_name_the_problem(tmp_path):
    (tmp_path / "train.bin").write_bytes(np.array([1, 2, 70000 % 65536, 50999], dtype=np.uint16).tobytes())
    (tmp_path / "val.bin").write_bytes(np.array([1, 2], dtype=np.uint16).tobytes())
    with pytest.raises(ValueError, match=r"train\.bin.*token id 50999.*index 3.*vocab_size=50304"):
        load_tokens(tmp_path, vocab_size=50304)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokens(tmp_path / "nowhere", vocab_size=256)
    (tmp_path / "val.bin").unlink()
    with pytest.raises(FileNotFoundError, match="no val.bin"):
        load_tokens(tmp_path, vocab_size=65536)
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.bin.*empty"):
        load_tokens(tmp_path / "empty.bin", vocab_size=256)
    with pytest.raises(FileNotFoundError, match="missing_dir"):
        load_text(tmp_path / "missing_dir")
    (tmp_path / "e.txt").write_text("")
    with pytest.raises(ValueError, match="e.txt.*empty"):
        load_text(tmp_path / "e.txt")
    (tmp_path / "no_text").mkdir()
    with pytest.raises(ValueError, match="no_text.*no files"):
        load_text(tmp_path / "no_text", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="data.source='csv'"):
        build_data({"source": "csv"})
