"""Document masking in the trainer (``data.document_mask``): each batch's document ids against a naive
count of separators, their way into every forward (the loop, validation, pipeline stages), and a
pipeline x expert x ZeRO-3 layout against one process.

The model's own oracle (a packed [A; B] gives B's logits and gradients equal to B alone within
1e-5, under every attention kind, through pipeline stages and activation checkpointing) is in
tests/moe/test_architectures.py (``test_packed_documents_compute_as_if_alone`` and its neighbours).
"""

import numpy as np
import pytest
import torch

from experiments.training.data import LMData
from moe.model import Transformer
from tests.support.dist import run_distributed
from tests.support.training import SHORT, cfg_of, run
from tests.zero.test_pipeline import _check_against_one_process, _trainer_runs

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _naive_doc_ids(tokens, start, length, sep):
    # a token's document: how many separators come before it in the split
    before = int(np.count_nonzero(np.asarray(tokens[:start]) == sep))
    out = []
    for t in range(start, start + length):
        out.append(before)
        before += int(tokens[t] == sep)
    return out


def test_doc_ids_count_the_separators_before_each_token():
    rng = np.random.default_rng(0)
    train_ = rng.integers(1, 5, 400).astype(np.uint8)
    train_[rng.choice(400, 40, replace=False)] = 0  # NUL ends a document
    data = LMData(train_, train_[:50].copy(), 256, "toy", separator=0)
    x, y, d = data.get_batch("train", 3, 8, 16, documents=True)
    x2, y2 = data.get_batch("train", 3, 8, 16)
    assert torch.equal(x, x2) and torch.equal(y, y2)  # the same rows with or without the documents
    for row_x, row_d in zip(x, d):
        start = next(s for s in range(len(train_) - 16) if np.array_equal(train_[s : s + 16], row_x.numpy()))
        assert row_d.tolist() == _naive_doc_ids(train_, start, 16, 0)
    # the ranks' documents are their rows' (the union over dp is the one-process batch)
    parts = [data.get_batch("train", 3, 8, 16, r, 2, 2, documents=True)[2] for r in range(2)]
    assert torch.equal(torch.cat([parts[0][:2], parts[1][:2], parts[0][2:], parts[1][2:]]), d)


def test_flat_token_files_have_no_documents():
    data = LMData(np.arange(100, dtype=np.uint16), np.arange(50, dtype=np.uint16), 300, "tokens.bin")
    with pytest.raises(ValueError, match=r"'tokens.bin' has no document boundaries .* data.document_mask=true"):
        data.get_batch("train", 0, 2, 8, documents=True)


def _record_doc_ids(calls: list):
    forward = Transformer.forward

    def spy(self, x, doc_ids=None):
        calls.append(None if doc_ids is None else doc_ids.clone())
        return forward(self, x, doc_ids)

    return forward, spy


def short_documents(folder, n=60):
    """A folder of ``n`` text files of 5 to 40 bytes: most 32-token windows cross a document boundary."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(n):
        (folder / f"d{i:03d}.txt").write_text("".join(rng.choice(list("abcdefgh \n"), rng.integers(5, 40))))
    return folder


def test_every_forward_of_a_run_gets_its_rows_documents(tmp_path):
    calls, drawn = [], []
    forward, spy = _record_doc_ids(calls)
    get_batch = LMData.get_batch

    def batch_spy(self, *a, **kw):
        out = get_batch(self, *a, **kw)
        drawn.append(out[2])
        return out

    folder = short_documents(tmp_path / "docs")
    overrides = [
        *SHORT,
        "data=text",
        f"data.path={folder}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.val_fraction=0.3",
        "train.steps=2",
        "train.eval_every=2",
        "train.eval_batches=1",
        "train.grad_accum=2",
    ]
    Transformer.forward, LMData.get_batch = spy, batch_spy
    try:
        masked = run(cfg_of(*overrides, "data.document_mask=true"), tmp_path, None, "masked")
    finally:
        Transformer.forward, LMData.get_batch = forward, get_batch
    # 2 steps x 2 micro-batches, then one validation batch in 2 micro-batch chunks
    assert len(calls) == 6 and len(drawn) == 3
    assert all(c is not None for c in calls)
    expected = [*drawn[0].chunk(2), *drawn[1].chunk(2), *drawn[2].chunk(2)]
    assert all(torch.equal(c, e) for c, e in zip(calls, expected))
    crossing = sum(len(row.unique()) > 1 for e in expected for row in e)
    assert crossing > len(calls), "few rows cross a document boundary: the test would see little"
    plain = run(cfg_of(*overrides), tmp_path, None, "plain")
    assert masked["train_losses"][0] != plain["train_losses"][0]  # the masks change what the model computes


def _doc_runs(rank, world, runs, run_dirs):
    """``_trainer_runs`` (tests/zero/test_pipeline.py), and how many stage forwards got document ids."""
    calls = []
    forward, spy = _record_doc_ids(calls)
    Transformer.forward = spy  # this rank's process only
    out = _trainer_runs(rank, world, runs, run_dirs)
    for summary in out:
        summary["forwards_with_docs"] = sum(c is not None for c in calls)
        summary["forwards"] = len(calls)
    return out


def _doc_data(tmp_path) -> list[str]:
    """Overrides for short documents (most windows cross a boundary, so the masks matter), masked."""
    folder = tmp_path / "docs"
    if not folder.exists():
        short_documents(folder)
    return ["data=text", f"data.path={folder}", f"data.cache_dir={tmp_path / 'cache'}", "data.val_fraction=0.3",
            "data.document_mask=true"]  # fmt: skip


def _check_doc_runs(per_rank, runs, tmp_path, stdlib, world):
    for r in per_rank:  # every stage of every rank computed with the documents (torch's shape inference too)
        for summary in r:
            assert summary["forwards"] > 0 and summary["forwards_with_docs"] == summary["forwards"]
    _check_against_one_process(per_rank, runs, tmp_path, stdlib, world)


@pytest.mark.distributed
def test_document_mask_under_pp2_ep2_zero3_trains_like_one_process(tmp_path, stdlib):
    runs = [(["parallel=pp2_ep2_zero3", *_doc_data(tmp_path)], 4)]  # pp=2 x dp=2 x ZeRO-3, ep=2
    per_rank = run_distributed(_doc_runs, 4, [o for o, _ in runs], [tmp_path / "pp0"], timeout=600)
    _check_doc_runs(per_rank, runs, tmp_path, stdlib, 4)


# every torch schedule, each with the micro-batching it needs; zbv with activation checkpointing
SCHEDULES_2 = [
    (["parallel.pp_schedule=gpipe", "parallel.pp_microbatches=2"], 2),
    (["parallel.pp_schedule=1f1b", "parallel.pp_microbatches=2", "train.grad_accum=2"], 4),
    (["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2", "parallel.pp_microbatches=2"], 2),
    (["parallel.pp_schedule=interleaved_zb", "parallel.pp_virtual_stages=2", "parallel.pp_microbatches=4"], 4),
    (
        [
            "parallel.pp_schedule=zbv",
            "parallel.pp_virtual_stages=2",
            "parallel.pp_microbatches=4",
            "model.checkpoint_activations=true",
        ],
        4,
    ),  # fmt: skip
    (["parallel.pp_schedule=dualpipev", "parallel.pp_virtual_stages=2", "parallel.pp_microbatches=4"], 4),
]


@pytest.mark.distributed
def test_document_mask_under_every_pipeline_schedule_trains_like_one_process(tmp_path, stdlib):
    runs = [(o + _doc_data(tmp_path), m) for o, m in SCHEDULES_2]
    per_rank = run_distributed(
        _doc_runs, 2, [o for o, _ in runs], [tmp_path / f"pp{i}" for i in range(len(runs))], timeout=900
    )
    _check_doc_runs(per_rank, runs, tmp_path, stdlib, 2)
