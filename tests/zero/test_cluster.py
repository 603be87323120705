"""Clusters: ranks from SLURM's environment (zero.slurm_environment, zero.init_distributed) and
Hydra multiruns through the submitit plugin (conf/hydra/launcher/{slurm,local}.yaml).

There is no SLURM here: the environment tests set the variables an srun task gets, and the launcher
test runs a sweep through submitit's local executor, which runs each job the way a SLURM job runs
it (the pickled Hydra job in its own process, its submitit folder of logs and results).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import zero
from zero.layout import SLURM_PORT_BASE, SLURM_PORT_SPAN, slurm_environment

ROOT = Path(__file__).resolve().parents[2]

# what srun gives task 5 of a 16-task step over 2 nodes of 8 GPUs, under sbatch
SRUN_TASK = {
    "SLURM_JOB_ID": "734562",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "5",
    "SLURM_NTASKS": "16",
    "SLURM_STEP_NUM_TASKS": "16",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NODELIST": "gpu[017-018]",
    "SLURM_STEP_NODELIST": "gpu[017-018]",
    "SLURM_LAUNCH_NODE_IPADDR": "10.1.2.17",
}
JOB_PORT = str(SLURM_PORT_BASE + 734562 % SLURM_PORT_SPAN)


@pytest.fixture
def no_scontrol(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # the node list is read by zero itself


def test_an_srun_task_gets_its_rank_world_and_master(no_scontrol):
    assert slurm_environment(SRUN_TASK) == {
        "RANK": "5",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "5",
        "MASTER_ADDR": "gpu017",
        "MASTER_PORT": JOB_PORT,
    }
    # a step on part of the job's nodes: its own node list and task count
    step = dict(SRUN_TASK, SLURM_STEP_NODELIST="gpu[018]", SLURM_STEP_NUM_TASKS="8", SLURM_PROCID="3")
    assert slurm_environment(step)["MASTER_ADDR"] == "gpu018" and slurm_environment(step)["WORLD_SIZE"] == "8"


@pytest.mark.parametrize(
    "nodelist,first",
    [("node7", "node7"), ("gpu[003-005,9],cpu1", "gpu003"), ("rack[2-3]-n[08,1]", "rack2-n08"), ("a1,b[1-2]", "a1")],
)
def test_first_host_of_a_node_list(no_scontrol, nodelist, first):
    env = dict(SRUN_TASK, SLURM_STEP_NODELIST=nodelist)
    assert slurm_environment(env)["MASTER_ADDR"] == first


def test_scontrol_expands_the_node_list_when_installed(monkeypatch, tmp_path):
    scontrol = tmp_path / "scontrol"
    log = tmp_path / "args"
    scontrol.write_text(f'#!/bin/sh\necho "$@" > {log}\necho gpu017-ib\necho gpu018-ib\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert slurm_environment(SRUN_TASK)["MASTER_ADDR"] == "gpu017-ib"
    assert log.read_text().split() == ["show", "hostnames", "gpu[017-018]"]


def test_given_master_and_fallbacks(no_scontrol):
    env = dict(SRUN_TASK, MASTER_ADDR="10.0.0.1", MASTER_PORT="29511")
    assert slurm_environment(env)["MASTER_ADDR"] == "10.0.0.1" and slurm_environment(env)["MASTER_PORT"] == "29511"
    bare = {k: v for k, v in SRUN_TASK.items() if "NODELIST" not in k and k != "SLURM_STEP_NUM_TASKS"}
    assert slurm_environment(bare) == {
        "RANK": "5",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "5",
        "MASTER_ADDR": "10.1.2.17",
        "MASTER_PORT": JOB_PORT,
    }


def test_torchrun_wins_and_a_batch_script_is_no_task():
    torchrun = dict(SRUN_TASK, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    assert slurm_environment(torchrun) is None
    # a batch script (or an salloc shell) has SLURM_PROCID=0 and the job's task count, but no step
    batch = {k: v for k, v in SRUN_TASK.items() if not k.startswith("SLURM_STEP")} | {"SLURM_PROCID": "0"}
    assert slurm_environment(batch) is None


@pytest.mark.parametrize(
    "change,match",
    [
        ({"SLURM_PROCID": "16"}, r"SLURM_PROCID=16 is not a rank of the step's 16 tasks \(valid: 0 to 15\)"),
        ({"SLURM_STEP_NUM_TASKS": "many"}, r"SLURM_STEP_NUM_TASKS='many' in the environment is not an integer"),
        ({"SLURM_JOB_ID": ""}, r"SLURM_JOB_ID or SLURM_JOBID is not set"),
    ],
)
def test_bad_slurm_values_are_named(no_scontrol, change, match):
    with pytest.raises(ValueError, match=match):
        slurm_environment(dict(SRUN_TASK, **change))


def _clear_launch_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("SLURM_") or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(k)


def test_init_distributed_single_task_and_batch_script(monkeypatch, no_scontrol):
    _clear_launch_env(monkeypatch)
    for k, v in dict(
        SRUN_TASK, SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NTASKS="1", SLURM_STEP_NUM_TASKS="1"
    ).items():
        monkeypatch.setenv(k, v)
    assert zero.init_distributed() is False and "RANK" not in os.environ  # one task: one process
    for k in ("SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_NTASKS", "4")
    with pytest.warns(UserWarning, match="SLURM_NTASKS=4 but this process is not a task of an srun step"):
        assert zero.init_distributed() is False


def test_slurm_launcher_config_composes():
    # what Hydra's plugin discovery does before a command-line run: register the plugin's configs
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher.config")
    from experiments.training import schema  # noqa: F401  (registers the trainer's structured configs, as experiments.train does)

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "train", overrides=["hydra/launcher=slurm", "hydra.launcher.tasks_per_node=4"], return_hydra_config=True
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.gpus_per_node == 4 and launcher.signal_delay_s == 300 and launcher.nodes == 1


@pytest.mark.distributed
def test_multirun_through_the_submitit_local_launcher(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from experiments.training.data import load_stdlib
    from tests.support.training import TINY

    load_stdlib()  # the data cache exists before the two jobs start
    env = dict(os.environ, OMP_NUM_THREADS="1")
    sweep_dir = tmp_path / "sweep"
    cmd = [
        sys.executable,
        "-m",
        "experiments.train",
        "-m",
        "hydra/launcher=local",
        "experiment=smoke",
        "moe.num_experts=2,4",
        *TINY,
        f"hydra.sweep.dir={sweep_dir}",
    ]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (
        "Submitit 'local' sweep output dir" in p.stderr + p.stdout
    )  # submitit ran the jobs, not Hydra's basic launcher
    results = sorted(sweep_dir.glob(".submitit/*/*_result.pkl"))
    assert len(results) == 2, results
    for job, experts in ((0, 2), (1, 4)):
        summary = json.loads((sweep_dir / str(job) / "summary.json").read_text())
        assert (
            summary["steps"] == 2
            and summary["skipped_steps"] == 0
            and f"moe.num_experts={experts}" in summary["overrides"]
        )
    rows = json.loads((sweep_dir / "sweep_summary.json").read_text())
    assert [r["job"] for r in rows] == ["0", "1"]
