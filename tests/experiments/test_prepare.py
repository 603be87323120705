"""Prepared token shards: the tokenizer's own ids in order with the document index, a deterministic
split by content that no document straddles, uint32 past 65536 ids, a SIGKILLed prepare that
resumes to the same bytes, the cache, and every refusal. Corpora and tokenizers are built here."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash

from experiments import prepare as prep
from experiments.prepare import main, prepare, prepare_cached
from experiments.training import shards
from experiments.training.shards import MANIFEST, NoSpaceError, PreparedDataset
from experiments.training.tokenizer import load_tokenizer, train_bpe

ROOT = Path(__file__).resolve().parents[2]


def _doc(i: int) -> str:
    return f"document {i}: " + " ".join(f"w{(i * j) % 97}" for j in range(i % 13 + 1)) + f"\nend {i}é\n"


def _corpus(tmp: Path) -> tuple[list[Path], list[str]]:
    """Sources of every kind and, by hand, their documents in prepare's order."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    root = tmp / "corpus"
    (root / "sub" / "__pycache__").mkdir(parents=True)
    (root / ".git").mkdir()
    docs = []
    for name, i in (("a.txt", 1), ("b.md", 2), ("c.py", 3)):
        (root / name).write_text(_doc(i))
        docs.append(_doc(i))
    (root / "blob.txt").write_bytes(b"text\x00binary")  # a NUL byte: binary, skipped
    (root / "empty.txt").write_text("")
    (root / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8, skipped in a folder
    (root / "image.png").write_bytes(b"\x89PNG")  # not a text suffix
    (root / ".hidden.txt").write_text("hidden")
    (root / ".git" / "HEAD").write_text("ref")
    (root / "sub" / "__pycache__" / "x.py").write_text("cached")
    (root / "sub" / "d.txt").write_text(_doc(4))
    docs.append(_doc(4))
    records = [{"text": _doc(i), "n": i} for i in range(5, 40)]
    (root / "sub" / "e.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    docs += [r["text"] for r in records]
    jsonl = tmp / "more.jsonl"
    jsonl.write_text("".join(json.dumps({"text": _doc(i)}) + "\n" for i in range(40, 70)))
    docs += [_doc(i) for i in range(40, 70)]
    parquet = tmp / "rows.parquet"
    pq.write_table(
        pa.table({"text": [_doc(i) for i in range(70, 110)], "id": list(range(40))}), parquet, row_group_size=16
    )
    docs += [_doc(i) for i in range(70, 110)]
    return [root, jsonl, parquet], docs


def _split(docs: list[str], val_fraction: float, seed: int = 0) -> dict[str, list[str]]:
    # the documented rule: validation when the content's XXH3-64 falls below val_fraction of the range
    out = {"train": [], "val": []}
    for d in docs:
        out["val" if xxhash.xxh3_64_intdigest(d.encode(), seed=seed) < int(val_fraction * 2**64) else "train"].append(d)
    return out


def _docs_of(ds: PreparedDataset, split: str) -> list[np.ndarray]:
    off = ds.offsets(split)
    tokens = np.asarray(ds.train if split == "train" else ds.val)
    return [tokens[a:b] for a, b in zip(off[:-1], off[1:])]


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    return train_bpe([_doc(i) for i in range(200)], 400, tmp_path_factory.mktemp("bpe") / "tokenizer.json")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, bpe) -> Path:
    # a model folder whose convention is BOS before every document (add_bos_token) and no EOS
    d = tmp_path_factory.mktemp("llama")
    shutil.copy(bpe, d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(
        json.dumps({"add_bos_token": True, "add_eos_token": False, "bos_token": "<|endoftext|>"})
    )
    return d


def _reference(kind: str, spec, docs: list[str]) -> list[list[int]]:
    """The tokenizer's own ids for each document, separator added by hand."""
    if kind == "bytes":
        return [[*d.encode(), 0] for d in docs]
    import tokenizers

    path = spec / "tokenizer.json" if Path(spec).is_dir() else spec
    raw = tokenizers.Tokenizer.from_file(str(path))
    ids = [e.ids for e in raw.encode_batch(docs, add_special_tokens=False)]
    eos = raw.token_to_id("<|endoftext|>")
    return [[eos, *i] for i in ids] if kind == "llama" else [[*i, eos] for i in ids]


@pytest.mark.parametrize("kind", ["bytes", "json", "llama"])
def test_shards_are_the_tokenizers_own_ids_in_order(tmp_path, kind, request):
    sources, docs = _corpus(tmp_path)
    spec = {"bytes": "bytes", "json": request.getfixturevalue("bpe"), "llama": request.getfixturevalue("llama_dir")}[
        kind
    ]
    # tiny shards: many of them, documents from several sources in one
    out = prepare(sources, spec, tmp_path / "out", workers=0, val_fraction=0.25, shard_mb=0.0005, progress=False)
    ds = PreparedDataset(out, verify=True, tokenizer=spec, vocab_size=load_tokenizer(spec).vocab_size)
    assert len(ds.manifest["shards"]) > 5 and ds.dtype == np.uint16
    want = _split(docs, 0.25)
    assert want["train"] and want["val"]
    for split in ("train", "val"):
        ref = _reference(kind, spec, want[split])
        got = _docs_of(ds, split)
        assert [d.tolist() for d in got] == ref, split
        assert np.asarray(ds.train if split == "train" else ds.val).tolist() == [t for r in ref for t in r]
        assert ds.num_docs(split) == len(ref) and ds.document(split, 1).tolist() == ref[1]
    # windows across shard boundaries read as one array (how the trainer samples sequences)
    whole, rng = np.asarray(ds.train), np.random.default_rng(0)
    for start in rng.integers(0, len(whole) - 300, 50):
        assert np.array_equal(ds.train[int(start) : int(start) + 300], whole[start : start + 300])
    assert ds.train[-1] == whole[-1] and len(ds.train.parts) == len(ds.manifest["shards"])
    m = ds.manifest
    assert m["counts"]["docs"] == len(docs) and m["split"]["moved"] is None
    assert m["separator"] == load_tokenizer(spec).separator.as_dict()
    folder = m["sources"][0]
    assert folder["docs"] == 39 and folder["skipped"] == {"binary": 1, "empty": 1, "not UTF-8": 1, "other suffix": 1}
    assert [s["docs"] for s in m["sources"][1:]] == [30, 40]


@pytest.mark.distributed
def test_workers_and_shard_size_do_not_change_the_documents(tmp_path, bpe):
    sources, docs = _corpus(tmp_path)
    a = prepare(sources, bpe, tmp_path / "a", workers=0, val_fraction=0.25, shard_mb=0.0005, progress=False)
    b = prepare(sources, bpe, tmp_path / "b", workers=2, val_fraction=0.25, shard_mb=0.0005, progress=False)
    assert _files(a) == _files(b)  # the same bytes, whatever the worker count
    c = prepare(sources, bpe, tmp_path / "c", workers=2, val_fraction=0.25, progress=False)  # one shard
    da, dc = PreparedDataset(a), PreparedDataset(c)
    assert len(dc.manifest["shards"]) == 1
    for split in ("train", "val"):
        assert np.array_equal(
            np.asarray(da.train if split == "train" else da.val), dc.train[:] if split == "train" else dc.val[:]
        )
        assert np.array_equal(da.offsets(split), dc.offsets(split))


def test_split_deterministic_by_content_no_straddling(tmp_path):
    docs = [_doc(i) for i in range(300)] + [_doc(7)] * 5  # duplicates
    (tmp_path / "x.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = prepare([tmp_path / "x.jsonl"], "bytes", tmp_path / "o", workers=0, val_fraction=0.1, progress=False)
    ds = PreparedDataset(out)
    sides = {s: [bytes(d[:-1].astype(np.uint8)).decode() for d in _docs_of(ds, s)] for s in ("train", "val")}
    assert sides == _split(docs, 0.1)
    assert sorted(sides["train"] + sides["val"]) == sorted(docs)  # every document whole, on one side
    assert 15 <= len(sides["val"]) <= 45
    dup_side = "val" if _doc(7) in sides["val"] else "train"
    assert sides[dup_side].count(_doc(7)) == 6  # duplicates never straddle
    # the same documents elsewhere, in another order: each keeps its side
    (tmp_path / "y.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in reversed(docs)))
    other = PreparedDataset(
        prepare([tmp_path / "y.jsonl"], "bytes", tmp_path / "p", workers=0, val_fraction=0.1, progress=False)
    )
    assert {bytes(d[:-1].astype(np.uint8)).decode() for d in _docs_of(other, "val")} == set(sides["val"])
    seeded = PreparedDataset(
        prepare(
            [tmp_path / "x.jsonl"], "bytes", tmp_path / "q", workers=0, val_fraction=0.1, split_seed=1, progress=False
        )
    )
    assert not np.array_equal(np.asarray(seeded.val), np.asarray(ds.val))


@pytest.mark.parametrize("val_fraction, short", [(0.01, "val"), (0.99, "train")])
def test_small_corpus_both_sides_non_empty(tmp_path, val_fraction, short):
    docs = ["alpha\n", "beta\n", "gamma\n"]
    src = tmp_path / "src"
    src.mkdir()
    for i, d in enumerate(docs):
        (src / f"{i}.txt").write_text(d)
    assert not _split(docs, val_fraction)[short]  # by the hash alone, one side would be empty
    out = prepare([src], "bytes", tmp_path / "o", workers=0, val_fraction=val_fraction, progress=False)
    ds = PreparedDataset(out)
    assert (ds.num_docs(short), ds.num_docs("train") + ds.num_docs("val")) == (1, 3)
    # the document that crossed is the one nearest the threshold
    u = {d: xxhash.xxh3_64_intdigest(d.encode()) for d in docs}
    crossed = (min if short == "val" else max)(docs, key=u.get)
    assert bytes(ds.document(short, 0)[:-1].astype(np.uint8)).decode() == crossed
    assert ds.manifest["split"]["moved"] is not None
    # deterministic: a second prepare gives the same bytes
    again = prepare([src], "bytes", tmp_path / "o2", workers=0, val_fraction=val_fraction, progress=False)
    assert _files(out) == _files(again)


def test_uint32_past_65536_ids(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 70_000)}}
    raw = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.add_special_tokens(["<|endoftext|>"])
    raw.save(str(tmp_path / "big.json"))
    docs = ["w69999 w1 w65536", "w65535 w70000 w2", "w3"]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = prepare(
        [tmp_path / "d.jsonl"], tmp_path / "big.json", tmp_path / "o", workers=0, val_fraction=0.3, progress=False
    )
    ds = PreparedDataset(out, verify=True)
    assert ds.dtype == np.uint32 and ds.manifest["dtype"] == "uint32" and ds.vocab_size == 70_016
    got = sorted(d.tolist() for s in ("train", "val") for d in _docs_of(ds, s))
    assert got == sorted([*e.ids, 70_000] for e in raw.encode_batch(docs))
    assert max(max(g) for g in got) == 70_000 and [69_999, 1, 65_536, 70_000] in got


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 180) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, f"{path} did not appear"
        time.sleep(0.1)


@pytest.mark.distributed
def test_sigkill_mid_prepare_resumes_to_the_same_bytes(tmp_path, bpe):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(60):
        (src / f"{i:02d}.txt").write_text(_doc(i) * 5)
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "experiments.prepare", str(src), "--tokenizer", str(bpe), "--out", str(out)]
    cmd += ["--workers", "1", "--shard-mb", "0.004", "--val-fraction", "0.2", "--quiet"]
    env = {**os.environ, prep.PAUSE_ENV: "120"}  # sleeps after each recorded shard: killed while the first is done
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        _wait_for(out / "shard-00000.json", proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert (
        not (out / MANIFEST).exists() and (out / "train-00000.bin").exists() and not (out / "shard-00001.json").exists()
    )
    with pytest.raises(
        FileNotFoundError, match=rf"{out}' has no MANIFEST.json: it is not prepared data, or its prepare did not finish"
    ):
        PreparedDataset(out)
    kept = (out / "train-00000.bin").stat().st_mtime_ns
    prepare([src], bpe, out, workers=0, shard_mb=0.004, val_fraction=0.2, progress=False)
    assert (out / "train-00000.bin").stat().st_mtime_ns == kept  # the finished shard was verified and kept
    whole = prepare([src], bpe, tmp_path / "whole", workers=0, shard_mb=0.004, val_fraction=0.2, progress=False)
    assert len(PreparedDataset(whole).manifest["shards"]) > 3
    assert _files(out) == _files(whole)


def test_resume_redoes_a_shard_whose_checksum_fails(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        (src / f"{i:02d}.txt").write_text(_doc(i) * 5)
    out = prepare([src], "bytes", tmp_path / "o", workers=0, shard_mb=0.004, val_fraction=0.2, progress=False)
    before = _files(out)
    (out / MANIFEST).unlink()  # as if killed before the manifest
    damaged = bytearray((out / "train-00001.bin").read_bytes())
    damaged[3] ^= 0xFF  # same size: only the checksum sees it
    (out / "train-00001.bin").write_bytes(bytes(damaged))
    kept = (out / "train-00000.bin").stat().st_mtime_ns
    prepare([src], "bytes", out, workers=0, shard_mb=0.004, val_fraction=0.2, progress=False)
    assert _files(out) == before and (out / "train-00000.bin").stat().st_mtime_ns == kept


def test_full_disk_names_the_directory_and_removes_partial_files(tmp_path, monkeypatch, capsys):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        (src / f"{i:02d}.txt").write_text(_doc(i) * 5)
    out = tmp_path / "o"
    real = shards._write_bytes

    def full_at_shard_2(f, data):
        if "-00002." in f.name:
            real(f, data[: len(data) // 2])  # a partial write, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        real(f, data)

    monkeypatch.setattr(shards, "_write_bytes", full_at_shard_2)
    kw = dict(workers=0, shard_mb=0.004, val_fraction=0.2, progress=False)
    with pytest.raises(NoSpaceError) as e:
        prepare([src], "bytes", out, **kw)
    msg = str(e.value)
    assert e.value.errno == errno.ENOSPC and f"no space left on the device of '{out}'" in msg
    assert "shards left need about" in msg and "bytes free" in msg and e.value.needed > 0 and e.value.free > 0
    left = sorted(p.name for p in out.iterdir())
    assert not [n for n in left if n.endswith(".tmp")] and MANIFEST not in left and "train-00002.bin" not in left
    assert "shard-00001.json" in left
    # the command line: one sentence, exit status 2, no traceback
    assert (
        main(
            [
                str(src),
                "--tokenizer",
                "bytes",
                "--out",
                str(out),
                "--workers",
                "0",
                "--shard-mb",
                "0.004",
                "--val-fraction",
                "0.2",
                "--quiet",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("prepare: error: no space left on the device of") and "Traceback" not in err
    monkeypatch.setattr(shards, "_write_bytes", real)
    prepare([src], "bytes", out, **kw)
    assert _files(out) == _files(prepare([src], "bytes", tmp_path / "whole", **kw))


def test_datasets_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    docs = [_doc(i) for i in range(30)]
    datasets.Dataset.from_dict({"body": docs, "n": list(range(30))}).save_to_disk(str(tmp_path / "ds"))
    out = prepare([tmp_path / "ds"], "bytes", tmp_path / "o", field="body", workers=0, val_fraction=0.3, progress=False)
    ds = PreparedDataset(out)
    want = _split(docs, 0.3)
    assert [bytes(d[:-1].astype(np.uint8)).decode() for d in _docs_of(ds, "train")] == want["train"]
    assert ds.manifest["sources"][0]["kind"] == "datasets"
    with pytest.raises(ValueError, match=r"has no column 'text' \(its columns: \['body', 'n'\]\); pass --field"):
        prepare([tmp_path / "ds"], "bytes", tmp_path / "p", workers=0, progress=False)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"is a DatasetDict \(splits \['train'\]\): pass one split's folder"):
        prepare([tmp_path / "dd"], "bytes", tmp_path / "q", workers=0, progress=False)


def test_prepare_cached_keys_sources_and_tokenizer(tmp_path, bpe):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(10):
        (src / f"{i}.txt").write_text(_doc(i))
    root = tmp_path / "cache"
    a = prepare_cached([src], "bytes", root, workers=0, val_fraction=0.2)
    stamp = (a / MANIFEST).stat().st_mtime_ns
    assert (
        prepare_cached([src], "bytes", root, workers=0, val_fraction=0.2) == a
        and (a / MANIFEST).stat().st_mtime_ns == stamp
    )
    assert a.parent == root / "prepared" and PreparedDataset(a, tokenizer="bytes").num_docs("train") > 0
    assert prepare_cached([src], bpe, root, workers=0, val_fraction=0.2) != a  # another tokenizer
    assert prepare_cached([src], "bytes", root, workers=0, val_fraction=0.3) != a  # other parameters
    os.utime(src / "3.txt", ns=(1, 1))  # a source's mtime changed: another key
    assert prepare_cached([src], "bytes", root, workers=0, val_fraction=0.2) != a


def test_refusals(tmp_path, bpe):
    kw = dict(workers=0, progress=False)
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": _doc(i)}) + "\n" for i in range(20)))
    with pytest.raises(
        FileNotFoundError, match=r"tokenizer 'missing\.json' not found: expected 'bytes', a tokenizer\.json"
    ):
        prepare([good], "missing.json", tmp_path / "o", **kw)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match=r"broken\.json' could not be read as JSON|broken\.json' could not be loaded"):
        prepare([good], tmp_path / "broken.json", tmp_path / "o", **kw)
    with pytest.raises(FileNotFoundError, match=r"source 'nowhere' not found: expected text files and folders"):
        prepare(["nowhere"], "bytes", tmp_path / "o", **kw)

    # empty sources: no documents
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match=r"source '.*empty_dir' holds no documents \(no usable files\)"):
        prepare([tmp_path / "empty_dir"], "bytes", tmp_path / "o", **kw)
    (tmp_path / "bin_dir").mkdir()
    (tmp_path / "bin_dir" / "x.txt").write_bytes(b"\x00\x01")
    with pytest.raises(ValueError, match=r"bin_dir' holds no documents \(skipped: 1 binary\); expected"):
        prepare([tmp_path / "bin_dir"], "bytes", tmp_path / "o", **kw)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"empty\.jsonl' is empty: no documents"):
        prepare([tmp_path / "empty.jsonl"], "bytes", tmp_path / "o", **kw)
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n\n{"text": ""}\n')
    with pytest.raises(ValueError, match=r"blank\.jsonl' holds no documents \(skipped: 2 empty\)"):
        prepare([tmp_path / "blank.jsonl"], "bytes", tmp_path / "o", **kw)
    (tmp_path / "bin.txt").write_bytes(b"ab\x00c")
    with pytest.raises(ValueError, match=r"bin\.txt' holds a NUL byte at offset 2: it is binary, not text"):
        prepare([tmp_path / "bin.txt"], "bytes", tmp_path / "o", **kw)

    # .jsonl records: file:line and what would be valid
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c"\n')
    with pytest.raises(
        ValueError, match=rf"{bad}:3: not valid JSON \(.*\); a \.jsonl file holds one JSON object per line"
    ):
        prepare([bad], "bytes", tmp_path / "o", **kw)
    bad.write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(
        ValueError, match=rf"{bad}:2: the record has no field 'text' \(it has \['body'\]\); pass --field"
    ):
        prepare([bad], "bytes", tmp_path / "o", **kw)
    bad.write_text('{"text": "a"}\n\n{"text": 3}\n')
    with pytest.raises(ValueError, match=rf"{bad}:3: field 'text' is a JSON int, expected a string"):
        prepare([bad], "bytes", tmp_path / "o", **kw)
    bad.write_text('{"text": "a"}\n{"text": "nul \\u0000 inside"}\n')
    with pytest.raises(
        ValueError, match=rf"{bad}:2: the text holds a NUL character, which the bytes tokenizer reserves"
    ):
        prepare([bad], "bytes", tmp_path / "o", **kw)
    # a parquet file without the column
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x", "y"]}), tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"t\.parquet' has no column 'text' \(its columns: \['body'\]\); pass --field"):
        prepare([tmp_path / "t.parquet"], "bytes", tmp_path / "o", **kw)
    with pytest.raises(ValueError, match=r"val_fraction=1\.0 must be in \[0, 1\)"):
        prepare([good], "bytes", tmp_path / "o", val_fraction=1.0, **kw)
    (tmp_path / "one.txt").write_text("one document")
    with pytest.raises(ValueError, match="hold 1 document: a train/validation split needs 2 or more"):
        prepare([tmp_path / "one.txt"], "bytes", tmp_path / "o", **kw)

    # reading: ids beyond the vocabulary, another tokenizer, damage, no manifest
    out = prepare([good], "bytes", tmp_path / "data", val_fraction=0.2, **kw)
    with pytest.raises(
        ValueError,
        match=r"train-00000\.bin' holds token id \d+ at position \d+ \(document 0\), outside the vocabulary \[0, 40\)",
    ):
        PreparedDataset(out, vocab_size=40)
    PreparedDataset(out, vocab_size=256)
    with pytest.raises(
        ValueError, match=r"was tokenized by 'bytes' \(fingerprint [0-9a-f]{32}\), not by '.*tokenizer\.json'"
    ):
        PreparedDataset(out, tokenizer=bpe)
    with pytest.raises(ValueError, match=r"already holds data prepared from other inputs \(different: the tokenizer\)"):
        prepare([good], bpe, out, val_fraction=0.2, **kw)
    damaged = bytearray((out / "val-00000.bin").read_bytes())
    damaged[0] ^= 1
    (out / "val-00000.bin").write_bytes(bytes(damaged))
    PreparedDataset(out)  # the cheap check reads sizes only
    with pytest.raises(ValueError, match=r"val-00000\.bin' fails its checksum"):
        PreparedDataset(out, verify=True)
    (out / "val-00000.bin").write_bytes(bytes(damaged[:-2]))
    with pytest.raises(ValueError, match=r"val-00000\.bin' has \d+ bytes, its manifest says \d+"):
        PreparedDataset(out)
    (out / MANIFEST).unlink()
    with pytest.raises(FileNotFoundError, match=r"has no MANIFEST\.json: it is not prepared data"):
        PreparedDataset(out)
    (out / MANIFEST).write_text(json.dumps({"format": 2, "files": {}}))  # a checkpoint's manifest
    with pytest.raises(ValueError, match="is not a prepared-data manifest"):
        PreparedDataset(out)
