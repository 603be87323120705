"""The trainer's checkpoints (experiments/training/checkpointing, on ``zero.checkpoint``): a run
resumes bit for bit, SIGTERM saves on every rank, a single-process checkpoint resumes on two ranks,
pipeline stages and one process resume each other, ``consolidate`` writes the full weights of any
layout, and a resumed run continues the same wandb run.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.support import ckpt_cases as cc
from tests.support.dist import run_distributed
from zero import checkpoint as zc

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# Trainer runs on another layout than one process differ by summation order only: measured <= 1.8e-7
# relative on losses and, with AdamW's eps at 1e-4 (tests/support/ckpt_cases.py says why), <= 1.2e-7
# absolute on weights; a resharding bug (a slice, a moment or a step count out of place) moves them by
# ~lr = 3e-3.
TRAIN_LOSS_RTOL = 1e-6
TRAIN_WEIGHT_ATOL = 1e-5


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    import functools

    from experiments.train import train
    from experiments.training.data import build_data

    cfg = cc.train_cfg()
    train = functools.partial(
        train, data=build_data(cfg.data, seed=cfg.seed)
    )  # and the cache exists before the ranks start
    root = tmp_path_factory.mktemp("trainer")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = train(cc.train_cfg(), run_dir=root / "single", keep_weights=True)
        at3 = zc.step_dir(root / "single" / "checkpoints", 3)
        single_resumed = train(cc.train_cfg(f"train.resume={at3}"), run_dir=root / "single_resumed", keep_weights=True)
        # what 2 pipeline stages with 2 micro-batches train like
        ga2 = train(cc.train_cfg("train.grad_accum=2"), run_dir=root / "single_ga2", keep_weights=True)
        ga2_at3 = zc.step_dir(root / "single_ga2" / "checkpoints", 3)
        two = run_distributed(cc.trainer_rank, 2, str(root / "two"), str(at3), str(ga2_at3), timeout=400)
        pp_at3 = zc.step_dir(root / "two" / "pp" / "checkpoints", 3)
        ga2["from_pp"] = train(
            cc.train_cfg("train.grad_accum=2", f"train.resume={pp_at3}"),
            run_dir=root / "ga2_from_pp",
            keep_weights=True,
        )
    finally:
        torch.set_num_threads(n)
    return root, single, single_resumed, two, ga2


@pytest.mark.distributed
def test_trainer_resumes_bit_for_bit(trainer_runs):
    root, single, resumed, _, _ = trainer_runs
    assert resumed["resumed_from_step"] == 3 and resumed["status"] == "completed"
    assert resumed["train_losses"] == single["train_losses"]  # steps 1-3 from the checkpoint, 4-6 trained
    assert resumed["val_history"] == single["val_history"]
    for name, w in single["weights"].items():
        assert torch.equal(resumed["weights"][name], w), name
    rows = lambda d: [json.loads(line) for line in (root / d / "metrics.jsonl").read_text().splitlines()]
    got, want = rows("single_resumed"), rows("single")[3:]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in got] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in want
    ]
    # the checkpoint carries the resolved config beside the state
    assert "expert_bias: true" in (zc.step_dir(root / "single" / "checkpoints", 3) / "config.yaml").read_text()


@pytest.mark.distributed
def test_sigterm_saves_on_every_rank_and_resumes_exactly(trainer_runs):
    root, _, _, two, _ = trainer_runs
    for rank, r in enumerate(two):
        assert r["preempted"]["status"] == "preempted" and r["preempted"]["last_step"] == 4, rank
        # the pipeline's last stage had the signal; the first stops with it, having heard of it
        # only through the gradient norm's all-reduce over the stages
        assert (r["pp_preempted"]["status"], r["pp_preempted"]["last_step"]) == ("preempted", 2), rank
        assert r["resumed"]["resumed_from_step"] == 4, rank
        assert r["resumed"]["train_losses"] == r["full"]["train_losses"], rank
        for name, w in r["full"]["weights"].items():
            assert torch.equal(r["resumed"]["weights"][name], w), (rank, name)
    ckpts = root / "two" / "pre" / "checkpoints"
    assert [s for s, _ in zc.list_checkpoints(ckpts)] == [6, 4]  # keep_last=2: 3 went when 6 was written
    # the uninterrupted run saved asynchronously: complete checkpoints, and the same training
    full = root / "two" / "full" / "checkpoints"
    assert [s for s, _ in zc.list_checkpoints(full)] == [6, 3]
    assert all(zc.verify(p) is None for _, p in zc.list_checkpoints(full))
    assert json.loads((root / "two" / "pre" / "summary.json").read_text())["status"] == "completed"


def _assemble_ranks(per_rank: list[dict], ref: dict) -> dict:
    from tests.support.training import assemble_weights

    return assemble_weights(per_rank, ref)


@pytest.mark.distributed
def test_trainer_resumes_a_single_process_checkpoint_on_two_ranks(trainer_runs):
    _, single, _, two, _ = trainer_runs
    got = [r["from_single"] for r in two]
    assert got[0]["resumed_from_step"] == 3
    torch.testing.assert_close(
        torch.tensor(got[0]["train_losses"]), torch.tensor(single["train_losses"]), rtol=TRAIN_LOSS_RTOL, atol=0
    )
    full = _assemble_ranks(got, single["weights"])
    for name, w in single["weights"].items():
        torch.testing.assert_close(full[name], w, rtol=0, atol=TRAIN_WEIGHT_ATOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.distributed
def test_pipeline_stages_and_one_process_resume_each_other(trainer_runs):
    """Parameters keep the whole model's names on every pipeline stage, so a pp=2 checkpoint is
    an ordinary one: one process resumes it, and 2 stages resume one process's."""
    _, _, _, two, ga2 = trainer_runs
    pp = [r["pp_from_single"] for r in two]
    for got, what in ((ga2["from_pp"], "one process from pp=2"), (pp[0], "pp=2 from one process")):
        assert got["resumed_from_step"] == 3, what
        torch.testing.assert_close(
            torch.tensor(got["train_losses"]),
            torch.tensor(ga2["train_losses"]),
            rtol=TRAIN_LOSS_RTOL,
            atol=0,
            msg=lambda m: f"{what}: {m}",
        )
    full = {**pp[0]["weights"], **pp[1]["weights"]}  # each stage holds its own layers, whole
    for name, w in ga2["weights"].items():
        torch.testing.assert_close(full[name], w, rtol=0, atol=TRAIN_WEIGHT_ATOL, msg=lambda m: f"pp=2: {name}: {m}")
        torch.testing.assert_close(
            ga2["from_pp"]["weights"][name],
            w,
            rtol=0,
            atol=TRAIN_WEIGHT_ATOL,
            msg=lambda m: f"one process from pp=2: {name}: {m}",
        )


@pytest.mark.distributed
def test_consolidate_writes_the_full_weights_of_any_layout(trainer_runs, tmp_path):
    from safetensors.torch import load_file

    from experiments.checkpoint import main as checkpoint_cli
    from experiments.training.build import build_model

    root, single, _, _, _ = trainer_runs
    # one process: exactly the weights it trained; ep2 + ZeRO-3 on 2 ranks: the same within rounding
    for src, exact in ((root / "single", True), (root / "two" / "full", False)):
        out = tmp_path / src.name
        assert checkpoint_cli(["consolidate", str(src / "checkpoints"), str(out)]) == 0
        tensors = load_file(out / "model.safetensors")
        model = build_model(cc.train_cfg())
        model.load_state_dict(tensors, strict=True)  # every parameter and state_dict buffer, nothing else
        for name, w in single["weights"].items():
            if exact:
                assert torch.equal(tensors[name], w), name
            else:
                torch.testing.assert_close(
                    tensors[name], w, rtol=0, atol=TRAIN_WEIGHT_ATOL, msg=lambda m: f"{name}: {m}"
                )
        assert any(k.endswith("expert_bias") and v.abs().sum() > 0 for k, v in tensors.items())
        assert (out / "config.yaml").is_file()


@pytest.mark.slow  # two trainer runs and wandb's service
def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch):
    import wandb

    from experiments.train import train
    from experiments.training.data import build_data

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_SERVICE", raising=False)  # a service of this test's own (tests/experiments/test_train.py)
    wb = ["logger=wandb", "logger.mode=offline", "train.eval_every=3"]
    data = build_data(cc.train_cfg().data, seed=0)
    try:
        train(cc.train_cfg(*wb, "train.steps=3"), run_dir=tmp_path / "a", data=data)
        at3 = zc.step_dir(tmp_path / "a" / "checkpoints", 3)
        run_id = zc.read_meta(at3)["extra"]["wandb_id"]
        train(cc.train_cfg(*wb, "train.steps=4", f"train.resume={at3}"), run_dir=tmp_path / "b", data=data)
    finally:
        wandb.teardown()  # waits for the service to finish writing the offline runs
    runs = sorted(p.name for p in tmp_path.glob("*/wandb/offline-run-*"))
    assert run_id and len(runs) == 2 and all(r.endswith(f"-{run_id}") for r in runs), (run_id, runs)
