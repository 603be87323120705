"""The training entry point: every config composes and trains, determinism, metrics, layouts, errors."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue

import routing_kernels
import zero
from experiments.train import train
from experiments.training.build import build_engine, build_model
from experiments.training.optim import lr_at
from tests.support.dist import run_distributed
from tests.support.paths import CONF, NOT_GROUPS, ROOT
from tests.support.training import SHORT, TINY, assemble_weights, cfg_of, check_same_training, metrics_rows, run

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _token_folder(tmp_path):
    d = tmp_path / "tok"
    d.mkdir()
    rng = np.random.default_rng(0)
    (d / "train.bin").write_bytes(rng.integers(0, 300, 5000, dtype=np.uint16).tobytes())
    (d / "val.bin").write_bytes(rng.integers(0, 300, 500, dtype=np.uint16).tobytes())
    return d


def _text_folder(tmp_path):
    d = tmp_path / "txt"
    d.mkdir()
    for i in range(6):
        (d / f"doc{i}.md").write_text(f"# doc {i}\n" + "the quick brown fox\n" * 50)
    return d


def _choices():
    out = []
    for group_dir in sorted(
        p for p in CONF.iterdir() if p.is_dir() and not p.name.startswith("_") and p.name not in NOT_GROUPS
    ):
        for f in sorted(group_dir.glob("*.yaml")):
            out.append((group_dir.name, f.stem))
    return out


def test_tree_lists_every_group():
    defaults = OmegaConf.load(CONF / "train.yaml").defaults
    listed = {next(iter(d)) for d in defaults if not isinstance(d, str)}
    assert listed == {group for group, _ in _choices()}, "every conf/ group appears in train.yaml's defaults"
    assert "_self_" in defaults


@pytest.mark.parametrize("group,choice", _choices())
def test_every_config_composes_and_runs_two_steps(group, choice, tmp_path, stdlib, monkeypatch):
    overrides = [f"{group}={choice}"] + TINY
    if group != "logger":
        overrides.append("logger=none")
    if group == "data" and choice == "text":
        overrides.append(f"data.path={_text_folder(tmp_path)}")
    if group == "data" and choice == "tokens":
        overrides += [f"data.path={_token_folder(tmp_path)}", "data.vocab_size=300"]
    if group == "experiment" and choice == "stdlib_bpe":
        # its BPE and its prepare, on a small folder: the whole stdlib takes minutes on a cold cache
        overrides += ["data=text", f"data.path={_text_folder(tmp_path)}", "data.tokenizer=bpe:300"]
        overrides += [f"data.cache_dir={tmp_path / 'cache'}", "data.prepare_workers=0", "data.val_fraction=0.3"]
    if group == "logger" and choice == "wandb":
        monkeypatch.setenv("WANDB_SILENT", "true")
        # a service this test starts and owns (an inherited WANDB_SERVICE would point wandb at
        # another process's service, which teardown() neither stops nor waits for)
        monkeypatch.delenv("WANDB_SERVICE", raising=False)
        overrides.append("logger.mode=offline")  # no network, no account
    cfg = cfg_of(*overrides)
    if group == "parallel" and (cfg.parallel.ep > 1 or cfg.parallel.pp > 1):
        # needs several ranks: the layout and pipeline tests run it; one process must refuse it by
        # the numbers (the pipeline plan first: too few layers of this tiny model for its stages)
        match = (
            f"world size 1 is not divisible by pp={cfg.parallel.pp}|cannot fill"
            if cfg.parallel.pp > 1
            else f"ep={cfg.parallel.ep} does not divide dp=1"
        )
        with pytest.raises(ValueError, match=match):
            run(cfg, tmp_path, stdlib)
        return
    if group == "logger" and choice == "wandb":
        import wandb

        try:
            summary = run(cfg, tmp_path, stdlib)
        finally:
            # train() finished the run, but finish() returns while wandb's service process may still
            # be writing the run's file (seen: 1 run in 3 under load read only its 7-byte header).
            # teardown() tells the service to shut down and waits for its process to exit: after
            # it, everything is on disk, and no service outlives the test
            wandb.teardown()
        assert not _wandb_services(), "a wandb service process is still running after teardown()"
    else:
        summary = run(cfg, tmp_path, stdlib)
    assert math.isfinite(summary["final_val_loss"]) and len(summary["train_losses"]) == 2
    rows = metrics_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    if group == "logger" and choice == "wandb":
        runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
        (records,) = runs[0].glob("run-*.wandb")  # an offline run, ready for `wandb sync`
        blob = records.read_bytes()  # protobuf records: keys and config strings appear verbatim
        assert b"expert_load/layer0" in blob and b"val_loss" in blob and b"tokens_per_s" in blob
        assert b'"d_model"' in blob and b"${" not in blob, "the config is logged resolved"


def _wandb_services() -> list[int]:
    """Live wandb service processes started by this process (the service is its child)."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        return []  # no procfs: nothing to look at
    me, found = os.getpid(), []
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (d / "cmdline").read_bytes()
        except OSError:  # exited meanwhile
            continue
        state, ppid = fields[0], int(fields[1])
        if ppid == me and state != "Z" and b"wandb" in cmdline:
            found.append(int(d.name))
    return found


def test_moe_vs_dense_pairs_equal_active_params(tmp_path, stdlib):
    exp = OmegaConf.load(CONF / "experiment" / "moe_vs_dense.yaml")
    ((key, values),) = exp.hydra.sweeper.params.items()
    summaries = {}
    for v in str(values).split(","):
        cfg = cfg_of("experiment=moe_vs_dense", "logger=none", *TINY, f"{key}={v}")
        summaries[v] = run(cfg, tmp_path, stdlib, name=f"job{v}")
    dense, moe_run = summaries["0"], summaries["1"]
    assert dense["moe_layers"] == 0 and moe_run["moe_layers"] == 2
    # same active parameters per token up to the routers (E x D per MoE layer)
    assert moe_run["params_active"] - dense["params_active"] == 2 * 8 * 32
    # and 4x the FFN parameters: 8 experts of half width (3 x D x F/2 each) instead of 3 x D x F
    D, F = 32, 64
    assert moe_run["params_total"] - dense["params_total"] == 2 * (8 * 3 * D * F // 2 - 3 * D * F + 8 * D)


def test_short_run_lowers_loss_and_writes_metrics(tmp_path, stdlib):
    cfg = cfg_of(*SHORT, "train.steps=30", "train.log_every=5", "train.eval_every=15")
    s = run(cfg, tmp_path, stdlib)
    losses = s["train_losses"]
    assert losses[-1] < losses[0] - 1.0, losses
    assert s["final_val_loss"] < math.log(256) - 1.0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [5, 10, 15, 20, 25, 30]
    assert [r["step"] for r in rows if "val_loss" in r] == [15, 30]
    for r in rows:
        assert {"loss", "lr", "tokens_per_s", "grad_norm", "aux_loss", "dropped_fraction", "expert_load"} <= set(r)
        assert len(r["expert_load"]) == 2 and sum(r["expert_load"][0]) == 5 * 8 * 32 * 2  # 5 steps x tokens x top-2
    assert rows[-1]["val_loss"] == s["final_val_loss"]
    assert rows[-1]["lr"] < rows[1]["lr"]  # cosine decay
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["final_val_loss"] == s["final_val_loss"] and saved["unigram_entropy"] == pytest.approx(
        stdlib.unigram_entropy()
    )


def test_same_config_same_curve(tmp_path, stdlib):
    cfg = cfg_of(*SHORT, "train.steps=4", "train.log_every=1", "train.eval_every=2")
    a, b = run(cfg, tmp_path, stdlib, "a"), run(cfg, tmp_path, stdlib, "b")
    assert a["train_losses"] == b["train_losses"] and a["val_history"] == b["val_history"]  # bit for bit
    c = run(cfg_of(*SHORT, "train.steps=4", "train.log_every=1", "train.eval_every=2", "seed=1"), tmp_path, stdlib, "c")
    assert c["train_losses"] != a["train_losses"]


def test_grad_accum_trains_the_same_batch(tmp_path, stdlib):
    # the balancing losses are batch statistics (not sums over tokens), so they are off here: with
    # them, micro-batches balance each micro-batch, a (documented) difference from one big batch
    base = [*SHORT, "train.steps=3", "train.log_every=1", "moe.aux_loss_coef=0", "moe.z_loss_coef=0"]
    one = run(cfg_of(*base), tmp_path, stdlib, "one", keep_weights=True)
    four = run(cfg_of(*base, "train.grad_accum=4"), tmp_path, stdlib, "four", keep_weights=True)
    check_same_training(four, metrics_rows(tmp_path / "four"), one, metrics_rows(tmp_path / "one"), "grad_accum=4")


def _layout_runs(rank, world, runs, run_dirs):
    """Each run's summary with this rank's final weights, and the training rows this rank drew at step 0."""
    from experiments.training.data import LMData

    torch.set_num_threads(1)
    drawn = []
    get_batch = LMData.get_batch

    def spy(self, split, step, *args, **kw):
        x, y = get_batch(self, split, step, *args, **kw)
        if split == "train" and step == 0:
            drawn.append(x.clone())
        return x, y

    LMData.get_batch = spy  # this rank's process only
    out = []
    for overrides, run_dir in zip(runs, run_dirs):
        drawn.clear()
        summary = train(cfg_of(*overrides), run_dir=run_dir, keep_weights=True)
        summary["rows_step0"] = torch.cat(drawn)
        out.append(summary)
    return out


# every layout trains the same model on the same global batch, so it logs the single-process curve;
# (ep, overrides)
LAYOUTS_2 = [
    (1, []),  # plain data parallel
    (2, ["parallel=ep2"]),
    (2, ["parallel=ep2", "parallel.zero_stage=1", "train.grad_clip=0.05"]),
    (2, ["parallel=ep2", "parallel.zero_stage=2", "parallel.zero_offload=true"]),
    (2, ["parallel=ep2", "parallel.zero_stage=3", "optim.impl=switchyard"]),
]
LAYOUTS_4 = [
    (2, ["parallel=ep2"]),
    (2, ["parallel=zero3_ep2"]),
    (4, ["parallel=ep4", "parallel.zero_stage=2"]),
    # two "nodes" of two ranks: each token crosses to the other node once
    (4, ["parallel=ep4", "parallel.node_size=2", "parallel.ep_dispatch=node", "parallel.zero_stage=3"]),
]
LAYOUT_BASE = [*SHORT, "train.steps=3", "train.log_every=1", "train.eval_every=3"]


def _check_layouts(per_rank, layouts, tmp_path, stdlib, world):
    for i, (ep, extra) in enumerate(layouts):
        runs = [r[i] for r in per_rank]
        # the run was distributed as asked: every rank in the layout, each with its own rows
        assert [s["layout"] for s in runs] == [
            {"world": world, "rank": r, "dp": world, "ep": ep, "pp": 1} for r in range(world)
        ], extra
        single_overrides = [o for o in extra if not o.startswith("parallel")] + LAYOUT_BASE
        single = run(cfg_of(*single_overrides), tmp_path, stdlib, f"single{i}", keep_weights=True)
        full_batch = dataclasses.replace(stdlib, seed=0).get_batch("train", 0, 8, 32)[0]
        assert torch.equal(torch.cat([s["rows_step0"] for s in runs]), full_batch), (
            f"{extra}: the ranks' rows are not the global batch"
        )
        assert all(len(s["rows_step0"]) == 8 // world for s in runs), extra
        assert all(r["train_losses"] == runs[0]["train_losses"] for r in runs), "the logged loss is the dp mean"
        got = dict(runs[0], weights=assemble_weights(runs, single["weights"]))
        check_same_training(
            got, metrics_rows(tmp_path / f"dist{i}"), single, metrics_rows(tmp_path / f"single{i}"), f"layout {extra}"
        )


@pytest.mark.distributed
def test_two_ranks_train_like_one_process_on_every_layout(tmp_path, stdlib):
    runs = [extra + LAYOUT_BASE for _, extra in LAYOUTS_2]
    per_rank = run_distributed(_layout_runs, 2, runs, [tmp_path / f"dist{i}" for i in range(len(runs))], timeout=400)
    _check_layouts(per_rank, LAYOUTS_2, tmp_path, stdlib, 2)


@pytest.mark.distributed
def test_four_ranks_ep_inside_dp_and_zero3_train_like_one_process(tmp_path, stdlib):
    runs = [extra + LAYOUT_BASE for _, extra in LAYOUTS_4]
    per_rank = run_distributed(_layout_runs, 4, runs, [tmp_path / f"dist{i}" for i in range(len(runs))], timeout=400)
    _check_layouts(per_rank, LAYOUTS_4, tmp_path, stdlib, 4)


@pytest.mark.distributed
def test_torchrun_launch(tmp_path, stdlib):
    # the documented launch: torchrun, gloo on the CPU, only rank 0 writes metrics. --standalone:
    # torchrun's agent serves the rendezvous on a port the OS gives it and the ranks join that (a
    # port picked here, closed and passed as --master_port could be taken by another process
    # before torchrun bound it). The stdlib fixture builds the data cache first, so the two ranks
    # do not both read the standard library on a fresh machine.
    env = dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    run_dir = tmp_path / "tr"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "experiments.train",
        "parallel=zero3_ep2",
        "experiment=smoke",
        *TINY,
        f"hydra.run.dir={run_dir}",
    ]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "ep=2" in p.stdout and p.stdout.count("final val loss") == 1  # rank 0 alone reports
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


def test_lr_schedule():
    o = OmegaConf.create({"lr": 1.0, "warmup_steps": 10, "min_lr_ratio": 0.1})
    assert lr_at(0, o, 100) == pytest.approx(0.1)
    assert lr_at(9, o, 100) == pytest.approx(1.0)
    assert lr_at(55, o, 100) == pytest.approx(0.55)  # cosine midpoint between 1.0 and 0.1
    assert lr_at(100, o, 100) == pytest.approx(0.1)
    lrs = [lr_at(s, o, 100) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


# (overrides, optimizer class, settings it must carry): a build_engine that ignored optim.name or
# optim.impl would build the same optimizer for every row
OPTIMIZER_CHOICES = [
    (["optim.impl=switchyard"], routing_kernels.FusedAdamW, {}),
    (["optim.impl=foreach"], torch.optim.AdamW, {"foreach": True, "fused": None}),
    (["optim.impl=fused"], torch.optim.AdamW, {"fused": True}),
    (["optim.impl=auto"], torch.optim.AdamW, {"fused": True}),  # torch's fused kernel runs on the CPU too
    (["optim.name=adam", "optim.impl=foreach"], torch.optim.Adam, {"foreach": True, "betas": (0.9, 0.95)}),
    (["optim.name=sgd"], torch.optim.SGD, {"momentum": 0.9}),
    (
        ["optim.name=sgd", "optim.momentum=0.5", "optim.impl=foreach"],
        torch.optim.SGD,
        {"momentum": 0.5, "foreach": True},
    ),
]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_build_engine_uses_the_configured_optimizer_under_every_stage(stage):
    for overrides, cls, settings in OPTIMIZER_CHOICES:
        cfg = cfg_of("model=tiny", f"parallel.zero_stage={stage}", *overrides)
        model = build_model(cfg)
        shapes = {n: p.dim() for n, p in model.named_parameters()}
        engine = build_engine(cfg, model, zero.Layout.single())
        opt = engine.optimizer
        assert type(opt) is cls, (overrides, type(opt))
        for k, v in settings.items():
            assert opt.defaults.get(k) == v, (overrides, k, opt.defaults.get(k))
        # two groups: matrices decay, norm gains and other 1-D parameters do not
        decayed, plain = engine.param_group_names
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
        assert all(shapes[n] >= 2 for n in decayed) and all(shapes[n] < 2 for n in plain)
        assert sorted(decayed + plain) == sorted(shapes)
        engine.remove_hooks()


def test_bad_optimizer_choices_are_named():
    model = build_model(cfg_of("model=tiny"))
    for overrides, match in [
        (["optim.impl=sgd"], "optim.impl='sgd'"),
        (["optim.name=lion"], "optim.name='lion'"),
        (["optim.name=sgd", "optim.impl=switchyard"], "optim.impl=switchyard is routing_kernels.FusedAdamW"),
    ]:
        with pytest.raises(ValueError, match=match):
            build_engine(cfg_of("model=tiny", *overrides), model, zero.Layout.single())


@pytest.mark.parametrize(
    "override,error,match",
    [
        ("model.d_modle=64", ConfigCompositionException, "d_modle"),
        ("moe=mixtrl", ConfigCompositionException, "mixtrl"),
        ("experiment=moe_vs_dens", ConfigCompositionException, "moe_vs_dens"),
    ],
)
def test_mistyped_overrides_are_named(override, error, match):
    with pytest.raises(error, match=match):
        cfg_of(override)


@pytest.mark.parametrize(
    "override,match",
    [
        ("moe.top_k=9", r"MoEConfig\.top_k=9"),
        ("moe.capacity_factor=-1", r"MoEConfig\.capacity_factor=-1"),
        ("model.n_heads=3", r"TransformerConfig\.n_heads=3"),
        ("train.batch_size=6", r"train\.batch_size=6 must be divisible by dp=1 x train\.grad_accum=4"),
        ("precision=fp8", "precision='fp8'"),
        ("parallel.zero_stage=5", r"parallel\.zero_stage=5"),
        ("parallel.zero_offload=true", r"parallel\.zero_offload=true needs parallel\.zero_stage >= 1"),
        ("parallel.ep=2", "ep=2 does not divide dp=1"),
        ("parallel.ep_dispatch=node", r"parallel\.ep_dispatch=node needs each ep group to span two or more"),
        ("parallel.ep_dispatch=nodes", r"parallel\.ep_dispatch='nodes' is invalid: expected 'flat'"),
        ("logger.name=tensorboard", "logger.name='tensorboard'"),
    ],
)
def test_bad_values_are_named(override, match, tmp_path, stdlib):
    cfg = cfg_of("model=tiny", "logger=none", "train.grad_accum=4", "train.batch_size=8", override)
    with pytest.raises(ValueError, match=match):
        run(cfg, tmp_path, stdlib)


def test_resuming_a_finished_run_trains_nothing_and_keeps_its_summary(tmp_path, stdlib, capsys):
    """train.resume=auto (the default) on a run that reached train.steps: a requeue or a repeated
    command trains nothing, says so and leaves the run's summary.json as it was; a checkpoint past
    train.steps is refused, naming both steps."""
    ck = tmp_path / "ck"
    over = ["model=tiny", "logger=none", *TINY[4:], f"train.checkpoint.dir={ck}", "train.checkpoint.every=1"]
    first = run(cfg_of(*over), tmp_path, stdlib)
    assert first["tokens_per_s"] > 0 and first["resumed_from_step"] is None
    written = (tmp_path / "run" / "summary.json").read_text()
    rows = (tmp_path / "run" / "metrics.jsonl").read_text()
    capsys.readouterr()
    again = run(cfg_of(*over), tmp_path, stdlib)
    assert "nothing to train: the checkpoint is at step 2, train.steps=2" in capsys.readouterr().out
    assert again["status"] == "completed" and again["resumed_from_step"] == again["last_step"] == 2
    assert again["tokens_per_s"] is None and again["final_val_loss"] == first["final_val_loss"]
    assert (tmp_path / "run" / "summary.json").read_text() == written
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == rows
    # into a fresh run directory: its summary.json is written, with no throughput to report
    run(cfg_of(*over), tmp_path, stdlib, "elsewhere")
    assert json.loads((tmp_path / "elsewhere" / "summary.json").read_text())["tokens_per_s"] is None
    with pytest.raises(ValueError, match=r"checkpoint is at step 2, past train\.steps=1: raise train\.steps"):
        run(cfg_of(*over, "train.steps=1"), tmp_path, stdlib, "fewer")


def test_missing_data_path_is_named(tmp_path):
    with pytest.raises(MissingMandatoryValue, match="data.path"):
        train(cfg_of("model=tiny", "logger=none", "data=text"))
    with pytest.raises(FileNotFoundError, match="no_such_corpus"):
        train(cfg_of("model=tiny", "logger=none", "data=text", f"data.path={tmp_path}/no_such_corpus"))


def test_wandb_sweep_drives_the_same_entry_point():
    for path in sorted((ROOT / "experiments" / "sweeps").glob("*.yaml")):
        sweep = yaml.safe_load(path.read_text())
        assert sweep["command"][2:4] == ["-m", "experiments.train"] and "${args_no_hyphens}" in sweep["command"]
        # every swept key exists in the tree (a renamed key would fail every agent run)
        overrides = [f"{k}={v['values'][-1]}" for k, v in sweep["parameters"].items()]
        cfg = cfg_of(*overrides)
        for k, v in sweep["parameters"].items():
            assert OmegaConf.select(cfg, k) == v["values"][-1]


@pytest.mark.distributed
def test_cli_multirun(tmp_path, stdlib):  # stdlib: the data cache exists before the jobs start
    env = dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    sweep_dir = tmp_path / "sweep"
    cmd = [
        sys.executable,
        "-m",
        "experiments.train",
        "-m",
        "experiment=smoke",
        "moe.num_experts=2,4",
        *TINY,
        f"hydra.sweep.dir={sweep_dir}",
    ]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads((sweep_dir / "sweep_summary.json").read_text())
    assert [r["overrides"][1] for r in rows] == ["moe.num_experts=2", "moe.num_experts=4"]
    assert "final val loss" in p.stdout and all((sweep_dir / str(i) / "metrics.jsonl").exists() for i in (0, 1))
