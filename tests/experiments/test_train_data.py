"""The trainer's tokenized data: ``data.tokenizer`` (the model's vocabulary follows it), prepared data on
first use and its refusals, and ``data.sources`` mixtures (proportions, determinism, per-source
validation in nats per token and bits per byte)."""

import json
import math

import numpy as np
import pytest
import torch
import xxhash

from experiments.prepare import prepare
from experiments.training.data import LMData, build_data
from experiments.training.shards import read_manifest
from experiments.training.tokenized import Mixture, fit_model_vocab, load_prepared
from experiments.training.tokenizer import load_tokenizer, train_bpe
from tests.support.training import SHORT, cfg_of, metrics_rows, run
from zero import checkpoint as zc

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _folder(path, n, seed, letters="abcdefgh \n"):
    """``n`` text files of 20 to 120 characters."""
    path.mkdir()
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        text = "".join(rng.choice(list(letters), rng.integers(20, 120)))
        (path / f"d{i:03d}.txt").write_text(text)
        docs.append(text)
    return path, docs


@pytest.fixture
def corpus(tmp_path):
    return _folder(tmp_path / "corpus", 80, 0)


def _overrides(tmp_path, *extra):
    return [
        *SHORT,
        "train.steps=2",
        "train.eval_every=2",
        "train.log_every=1",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.prepare_workers=0",
        "data.val_fraction=0.25",
        *extra,
    ]


def test_a_tokenizer_json_sets_the_models_vocabulary_and_prepares_once(tmp_path, corpus):
    folder, docs = corpus
    tok_path = train_bpe(docs, 300, tmp_path / "tok.json")  # 300 ids: the model takes 320 (a multiple of 64)
    over = _overrides(tmp_path, "data=text", f"data.path={folder}", f"data.tokenizer={tok_path}")
    summary = run(cfg_of(*over), tmp_path, None, "a", keep_weights=True)
    assert summary["weights"]["embed.weight"].shape[0] == 320
    assert summary["weights"]["lm_head.weight"].shape[0] == 320
    prepared = list((tmp_path / "cache" / "prepared").iterdir())
    assert len(prepared) == 1
    m = read_manifest(prepared[0])
    assert m["tokenizer"]["fingerprint"] == load_tokenizer(tok_path).fingerprint()
    # bits per byte from the manifest's validation tokens and text bytes
    bpb = summary["final_val_loss"] * m["counts"]["val"]["tokens"] / m["counts"]["val"]["text_bytes"] / math.log(2)
    assert summary["final_val"]["val_bpb"] == pytest.approx(bpb, rel=1e-12)
    # a second run finds the prepared data (same directory, files untouched)
    mtimes = {p.name: p.stat().st_mtime_ns for p in prepared[0].iterdir()}
    run(cfg_of(*over), tmp_path, None, "b")
    assert {p.name: p.stat().st_mtime_ns for p in prepared[0].iterdir()} == mtimes


def test_the_manifest_records_each_splits_text_bytes(tmp_path, corpus):
    folder, docs = corpus
    out = prepare([folder], "bytes", tmp_path / "o", workers=0, val_fraction=0.25, progress=False)
    counts = read_manifest(out)["counts"]
    threshold = int(0.25 * 2**64)
    val = [d for d in docs if xxhash.xxh3_64_intdigest(d.encode(), seed=0) < threshold]
    assert counts["val"]["text_bytes"] == sum(len(d.encode()) for d in val)
    assert counts["train"]["text_bytes"] == sum(len(d.encode()) for d in docs) - counts["val"]["text_bytes"]
    assert counts["val"]["tokens"] == counts["val"]["text_bytes"] + len(val)  # bytes: one NUL per document


def test_prepared_data_of_another_tokenizer_is_refused(tmp_path, corpus):
    folder, docs = corpus
    out = prepare([folder], "bytes", tmp_path / "o", workers=0, val_fraction=0.25, progress=False)
    tok_path = train_bpe(docs, 300, tmp_path / "tok.json")
    cfg = cfg_of(*_overrides(tmp_path, "data.source=prepared", f"data.path={out}", f"data.tokenizer={tok_path}"))
    with pytest.raises(ValueError, match=r"was tokenized by 'bytes' \(fingerprint \w+\), not by .*tok\.json"):
        build_data(cfg.data)
    bpe_out = prepare([folder], tok_path, tmp_path / "b", workers=0, val_fraction=0.25, progress=False)
    cfg = cfg_of(*_overrides(tmp_path, "data.source=prepared", f"data.path={bpe_out}"))  # data.tokenizer=bytes
    with pytest.raises(ValueError, match=r"tokenized by .*tok\.json.*not by 'bytes'"):
        build_data(cfg.data)
    cfg = cfg_of(*_overrides(tmp_path, "data.source=prepared", f"data.path={folder}"))
    with pytest.raises(FileNotFoundError, match=r"holds no MANIFEST.json: data.source=prepared takes a directory"):
        build_data(cfg.data)


@pytest.mark.parametrize(
    "override,error,match",
    [
        ("data.tokenizer=bpe:12", ValueError, r"data.tokenizer='bpe:12' is invalid: .* N >= 257"),
        ("data.tokenizer=/nowhere/tokenizer.json", FileNotFoundError, r"/nowhere/tokenizer.json"),
        ("data.sources=[{path:/nowhere,weight:1}]", FileNotFoundError, r"data source '/nowhere' does not exist"),
        ("data.sources=[{path:stdlib,weight:0}]", ValueError, r"sources\[0\].weight=0.0 is invalid"),
    ],
)
def test_bad_data_values_are_named(tmp_path, override, error, match):
    with pytest.raises(error, match=match):
        build_data(cfg_of(*_overrides(tmp_path, override)).data)


def test_init_from_fixes_the_vocabulary_and_the_tokenizer_must_fit():
    data = LMData(
        np.zeros(10, np.uint16), np.zeros(10, np.uint16), 320, "d", info={"tokenizer": "t", "tokenizer_vocab_size": 300}
    )
    cfg = cfg_of("model=tiny", "data.tokenizer=t.json", "model.init_from=/ckpt", "data.vocab_size=256")
    with pytest.raises(ValueError, match=r"into 300 ids, but model.init_from='/ckpt' fixes model.vocab_size=256"):
        fit_model_vocab(cfg, data)
    cfg = cfg_of("model=tiny", "data.tokenizer=t.json", "model.init_from=/ckpt", "model.vocab_size=300")
    fit_model_vocab(cfg, data)  # 300 ids fit a checkpoint of 300 (not padded: the checkpoint decides)
    assert cfg.model.vocab_size == 300
    cfg = cfg_of("model=tiny", "data.tokenizer=t.json")
    fit_model_vocab(cfg, data)
    assert cfg.model.vocab_size == cfg.data.vocab_size == 320


def test_an_id_beyond_the_models_vocabulary_names_its_file(tmp_path, corpus):
    folder, _ = corpus
    out = prepare([folder], "bytes", tmp_path / "o", workers=0, val_fraction=0.25, progress=False)
    data = load_prepared(out, "bytes")
    data.info["tokenizer_vocab_size"] = 100  # as if a tokenizer of 100 ids had written letters (ids 97-104)
    cfg = cfg_of("model=tiny", "data.source=prepared", f"data.path={out}", "model.init_from=/c", "model.vocab_size=100")
    with pytest.raises(ValueError, match=r"train-00000.bin' holds token id 1\d\d at position \d+ \(document \d+\)"):
        fit_model_vocab(cfg, data)


# ----------------------------------------------------------------------------- mixtures


def _toy(lo, n, seed):
    # ids in [lo, lo + 10): a row's source is read off its tokens; 0 separates documents
    rng = np.random.default_rng(seed)
    t = rng.integers(lo, lo + 10, n).astype(np.uint16)
    t[rng.choice(n, n // 20, replace=False)] = 0
    return LMData(t, t[: n // 4].copy(), 64, f"src{lo}", separator=0)


def _mixture(weights=(1.0, 3.0), seed=0):
    return Mixture([_toy(10, 4000, 1), _toy(30, 3000, 2)], list(weights), ["a", "b"], seed)


def _source_of_rows(x_BL):
    top = x_BL.max(1).values
    return (top >= 30).long()


def test_mixture_proportions_are_the_weights_within_binomial_error():
    mix, steps, rows = _mixture(), 200, 16
    n = steps * rows
    from_b = sum(int(_source_of_rows(mix.get_batch("train", s, rows, 16)[0]).sum()) for s in range(steps))
    # each row's source is an independent draw with P(b) = 3/4: from_b ~ Binomial(n, 3/4), sd = sqrt(n p (1-p))
    # = 24.5 for n = 3200; 4.5 sd is exceeded with probability 7e-6 (the draw is fixed by the seed: no flake)
    sd = math.sqrt(n * 0.75 * 0.25)
    assert abs(from_b - 0.75 * n) <= 4.5 * sd, (from_b, 0.75 * n, sd)
    other = _mixture((3.0, 1.0))  # and the weights decide: reversed, reversed proportions
    from_b = sum(int(_source_of_rows(other.get_batch("train", s, rows, 16)[0]).sum()) for s in range(steps))
    assert abs(from_b - 0.25 * n) <= 4.5 * sd


def test_mixture_batches_are_a_function_of_seed_and_step_and_split_over_ranks():
    mix = _mixture()
    x, y, d = mix.get_batch("train", 7, 8, 16, documents=True)
    again = _mixture().get_batch("train", 7, 8, 16, documents=True)  # a resumed run: a fresh mixture, step 7
    assert all(torch.equal(a, b) for a, b in zip((x, y, d), again))
    assert not torch.equal(x, mix.get_batch("train", 8, 8, 16)[0])
    assert not torch.equal(x, _mixture(seed=1).get_batch("train", 7, 8, 16)[0])
    assert torch.equal(y[:, :-1], x[:, 1:])
    # the rows of 2 dp ranks x 2 micro-batches are the global batch, as LMData.get_batch orders them
    r0, r1 = (mix.get_batch("train", 7, 8, 16, r, 2, 2, documents=True) for r in range(2))
    for k in range(3):
        assert torch.equal(torch.cat([r0[k][:2], r1[k][:2], r0[k][2:], r1[k][2:]]), (x, y, d)[k])
    # each row's documents are its own source's
    for row_x, row_d in zip(x, d):
        starts = np.flatnonzero(row_x.numpy() == 0) + 1
        assert all(row_d[s] == row_d[s - 1] + 1 for s in starts if s < 16)


def test_a_mixture_run_reports_each_source_and_resumes_exactly(tmp_path):
    a, _ = _folder(tmp_path / "a", 40, 1, "abcd \n")
    b, _ = _folder(tmp_path / "b", 40, 2, "wxyz,.\n")
    sources = f"data.sources=[{{path:{a},weight:1,name:prose}},{{path:{b},weight:2}}]"
    ck = tmp_path / "ck"
    over = _overrides(
        tmp_path,
        sources,
        "train.steps=4",
        "train.eval_every=2",
        f"train.checkpoint.dir={ck}",
        "train.checkpoint.every=2",
    )
    whole = run(cfg_of(*over, "train.checkpoint.keep_last=3"), tmp_path, None, "whole", keep_weights=True)
    rows = metrics_rows(tmp_path / "whole")
    val = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 4]
    for r in val:
        assert {"val_loss/prose", "val_loss/b", "val_bpb/prose", "val_bpb/b", "val_bpb"} <= set(r)
        assert r["val_loss"] == pytest.approx((r["val_loss/prose"] + 2 * r["val_loss/b"]) / 3, rel=1e-12)
        assert r["val_loss/prose"] != r["val_loss/b"]
    assert (
        json.loads((tmp_path / "whole" / "summary.json").read_text())["final_val"]["val_loss/b"]
        == val[-1]["val_loss/b"]
    )
    resumed = run(
        cfg_of(
            *_overrides(tmp_path, sources, "train.steps=4", "train.eval_every=2", f"train.resume={zc.step_dir(ck, 2)}")
        ),
        tmp_path,
        None,
        "resumed",
        keep_weights=True,
    )
    assert resumed["resumed_from_step"] == 2
    assert metrics_rows(tmp_path / "resumed")[-1] == rows[-1] | {
        "tokens_per_s": metrics_rows(tmp_path / "resumed")[-1]["tokens_per_s"]
    }
    for name, w in whole["weights"].items():
        assert torch.equal(resumed["weights"][name], w), name
