"""Kill-and-resume at random points: ``torchrun --max-restarts=2`` on 2 ranks (ep2, ZeRO-3) where
one rank is SIGKILLed (tests/ckpt_restart_worker.py) in the first attempt and one in the second:
once inside a save (its data files written, no manifest yet) and once in the middle of a training
step (in a forward, or between backward and optimizer step), in an order, at steps and on ranks
drawn at random. torchrun restarts the group each time, the trainer resumes on its own from the
newest complete checkpoint (or starts afresh when there is none), and the run must end as the
uninterrupted run of the same layout does, bit for bit (losses, every metrics row, every tensor of
the final checkpoint), and within 1e-6 of one process.

The draw comes from ``SWITCHYARD_KILL_SEED`` when set (an integer), else from a fresh random seed;
the seed and what it drew are printed and are part of every assertion message, so a failure is
reproduced with ``SWITCHYARD_KILL_SEED=<seed> pytest tests/experiments/test_kill_resume.py``.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support import ckpt_cases as cc
from tests.support.ckpt_restart_worker import MOMENTS
from tests.support.dist import require_distributed_marker
from zero import checkpoint as zc

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY = 8, 2
RUN = [*cc.TRAIN, f"train.steps={STEPS}", f"train.checkpoint.every={EVERY}", "parallel=ep2", "parallel.zero_stage=3"]
LOSS_RTOL = 1e-6  # another layout than one process: summation order only (tests/zero/test_checkpoint.py)
TIMEOUT_S = 300


def kill_seed() -> int:
    raw = os.environ.get("SWITCHYARD_KILL_SEED")
    if raw is None or raw == "":
        return secrets.randbelow(2**31)
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"SWITCHYARD_KILL_SEED={raw!r} is invalid: expected an integer (or unset for a random one)"
        ) from None


def newest_complete_before(step: int) -> int:
    """The step of the newest complete checkpoint when a kill comes in step ``step`` or in its save
    (0: none, a fresh start): a step's own save comes after it, and a killed save never finishes."""
    return EVERY * ((step - 1) // EVERY)


def draw_kills(seed: int) -> list[tuple[str, int, int]]:
    """[(moment, step, rank)] for torchrun's attempts 0 and 1: one kill inside a save (a multiple of
    EVERY, the final save included), one mid-step (any step), in a random order; the second at a
    step its attempt reaches (after the checkpoint the first kill leaves it to resume from)."""
    rng = random.Random(seed)
    moments = ["save", rng.choice([m for m in MOMENTS if m != "save"])]
    rng.shuffle(moments)
    kills, resume = [], 0
    for moment in moments:
        if moment == "save":
            step = rng.choice([d for d in range(EVERY, STEPS + 1, EVERY) if d > resume])
        else:
            step = rng.randint(resume + 1, STEPS)
        kills.append((moment, step, rng.randrange(2)))
        resume = newest_complete_before(step)
    return kills


def describe(kills) -> str:
    return "; ".join(f"rank {r} killed in the {m} of step {s}" for m, s, r in kills)


def torchrun(run_dir: Path, env: dict, label: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """torchrun in a session of its own: on a timeout the agent and its workers are all killed."""
    require_distributed_marker(f"torchrun ({label})")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=2",
        "-m",
        "tests.support.ckpt_restart_worker",
        *RUN,
        f"hydra.run.dir={run_dir}",
    ]
    # without its own rendezvous store per attempt a restarted group reads the old attempt's
    # addresses (README: Restarts); --standalone serves the rendezvous on a port the OS picks
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONPATH=str(ROOT), **env)
    p = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"{label}: torchrun did not finish within {timeout} s:\n{out[-2000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from experiments.train import train
    from experiments.training.data import build_data

    seed = kill_seed()
    kills = draw_kills(seed)
    specs = [f"{m}:{s}:{r}" for m, s, r in kills]
    what = f"[SWITCHYARD_KILL_SEED={seed}: {describe(kills)}]"
    print(what, flush=True)
    root = tmp_path_factory.mktemp("kill")
    cfg = cc.train_cfg(*RUN[len(cc.TRAIN) :])
    build_data(cfg.data, seed=cfg.seed)  # the data cache exists before the ranks start
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = train(cc.train_cfg(f"train.steps={STEPS}", f"train.checkpoint.every={EVERY}"), run_dir=root / "single")
    finally:
        torch.set_num_threads(n)
    exits = root / "ref_exits.txt"
    ref = torchrun(root / "ref", {"SWITCHYARD_TEST_EXIT_MARK": str(exits)}, f"{what} the uninterrupted run")
    assert ref.returncode == 0, f"{what} the uninterrupted run failed:\n{ref.stdout[-2000:]}\n{ref.stderr[-3000:]}"
    mark = root / "killed.txt"
    killed = torchrun(
        root / "killed", {"SWITCHYARD_TEST_KILL": ",".join(specs), "SWITCHYARD_TEST_KILL_MARK": str(mark)}, what
    )
    return dict(
        what=what, specs=specs, kills=kills, root=root, single=single, ref=ref, killed=killed, mark=mark, exits=exits
    )


@pytest.mark.distributed
def test_the_killed_run_restarts_and_resumes_from_the_newest_complete_checkpoint(runs):
    what, p = runs["what"], runs["killed"]
    assert p.returncode == 0, f"{what}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    kills = runs["mark"].read_text().splitlines() if runs["mark"].is_file() else []
    assert kills == runs["specs"], f"{what} the kills that happened: {kills}"
    starts = [newest_complete_before(step) for _, step, _ in runs["kills"]]
    for start in starts:  # each restarted attempt says where it resumed (nothing when it started afresh)
        assert start == 0 or f"at step {start} " in p.stdout, f"{what} no resume at step {start}:\n{p.stdout[-3000:]}"
    summary = json.loads((runs["root"] / "killed" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["last_step"] == STEPS, f"{what} {summary}"
    want = starts[-1] or None  # None: killed before the first checkpoint was complete, a fresh start
    assert summary["resumed_from_step"] == want, f"{what} resumed from {summary['resumed_from_step']}, expected {want}"
    ckpts = runs["root"] / "killed" / "checkpoints"
    # the killed saves were redone or pruned; keep_last=2
    assert [s for s, _ in zc.list_checkpoints(ckpts)] == [STEPS, STEPS - EVERY], f"{what} {sorted(os.listdir(ckpts))}"
    assert all(zc.verify(path) is None for _, path in zc.list_checkpoints(ckpts)), what


@pytest.mark.distributed
def test_a_finished_run_releases_its_process_group_before_the_interpreter_ends(runs):
    # a process that exits holding a gloo group can abort in the interpreter's finalization
    # (SIGABRT, "terminate called without an active exception") after a run that succeeded
    # (experiments.train.release_process_group_at_exit): both ranks let it go in an exit handler
    lines = sorted(runs["exits"].read_text().splitlines())
    assert lines == ["0 False", "1 False"], lines


@pytest.mark.distributed
def test_the_resumed_run_logs_the_uninterrupted_runs_rows(runs):
    what = runs["what"]
    assert runs["killed"].returncode == 0, what
    got, want = metric_rows(runs["root"] / "killed"), metric_rows(runs["root"] / "ref")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), f"{what} duplicated or missing rows"
    assert [r["step"] for r in want] == list(range(1, STEPS + 1)), what
    for a, b in zip(got, want):
        a.pop("tokens_per_s"), b.pop("tokens_per_s")
        assert a == b, f"{what} step {b['step']}: {a} != {b}"
    summaries = [json.loads((runs["root"] / d / "summary.json").read_text()) for d in ("killed", "ref")]
    assert summaries[0]["train_losses"] == summaries[1]["train_losses"], what
    assert summaries[0]["val_history"] == summaries[1]["val_history"], what
    # the same layout trains like one process, within rounding
    torch.testing.assert_close(
        torch.tensor(summaries[0]["train_losses"]),
        torch.tensor(runs["single"]["train_losses"]),
        rtol=LOSS_RTOL,
        atol=0,
        msg=lambda m: f"{what} against one process: {m}",
    )


@pytest.mark.distributed
def test_the_final_checkpoint_is_the_uninterrupted_runs_bit_for_bit(runs):
    """Every tensor of the last checkpoint: weights, optimizer moments and step counts, buffers (the
    expert biases), each rank's torch RNG state. Not Python's ``random`` state: the trainer seeds
    torch (``seed``) but not ``random``, which starts from os.urandom in every process and which
    training does not use, so two uninterrupted runs differ there too."""
    what = runs["what"]
    assert runs["killed"].returncode == 0, what
    mine = zc.step_dir(runs["root"] / "killed" / "checkpoints", STEPS)
    ref = zc.step_dir(runs["root"] / "ref" / "checkpoints", STEPS)
    saved, want = (zc.SafeReader(p).read_metadata().state_dict_metadata for p in (mine, ref))
    assert set(saved) == set(want), f"{what} {sorted(set(saved) ^ set(want))}"
    assert any(k.startswith(zc.PARAM) for k in want) and any(k.startswith(zc.OPTIM) for k in want), what
    for key, md in want.items():  # every tensor, RNG states included, bit for bit (NaN marks no cached gauss)
        a, b = (torch.empty(md.size, dtype=md.properties.dtype) for _ in range(2))
        zc.read_tensors(mine, {key: a})
        zc.read_tensors(ref, {key: b})
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), (
            f"{what} {key} differs from the uninterrupted run's"
        )


# ----- preemption handed over to the scheduler's own handler (submitit's requeue) ------------------
@pytest.mark.parametrize("async_save", [False, True])
def test_sigusr1_hands_over_to_the_previous_python_handler_after_the_save(tmp_path, async_save):
    """A Python handler installed before the trainer's (submitit's is one) runs once, after the
    coordinated save (an async one's manifest included) and summary.json, and is the signal's
    handler again afterwards."""
    from experiments.train import train

    calls = []

    def stand_in(signum, frame):
        summary = tmp_path / "summary.json"
        calls.append(
            (
                signum,
                zc.verify(zc.step_dir(tmp_path / "checkpoints", 4)),
                json.loads(summary.read_text())["status"] if summary.is_file() else None,
            )
        )

    previous = signal.signal(signal.SIGUSR1, stand_in)
    undo = cc.signal_at(3, signal.SIGUSR1)  # while drawing step index 3's batch: step 4 runs, then the save
    try:
        summary = train(cc.train_cfg(f"train.checkpoint.async_save={str(async_save).lower()}"), run_dir=tmp_path)
        assert signal.getsignal(signal.SIGUSR1) is stand_in
    finally:
        undo()
        signal.signal(signal.SIGUSR1, previous)
    assert summary["status"] == "preempted" and summary["last_step"] == 4, summary
    # one call, with the signal, once step 4's checkpoint was complete and the summary written
    assert calls == [(signal.SIGUSR1, None, "preempted")], calls


def _submitit_task(folder: Path, job_id: str) -> subprocess.CompletedProcess:
    """What a submitit job's task runs, in submitit's local environment: load the job pickle,
    install submitit's signal handlers, run it (``submitit.core.submission.process_job``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC_"))}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT),
        SUBMITIT_EXECUTOR="local",
        SUBMITIT_LOCAL_JOB_ID=job_id,
        SUBMITIT_LOCAL_NTASKS="1",
        SUBMITIT_LOCAL_JOB_NUM_NODES="1",
        SUBMITIT_LOCAL_NODEID="0",
        SUBMITIT_LOCAL_GLOBALID="0",
        SUBMITIT_LOCAL_LOCALID="0",
    )
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.run(
        [sys.executable, "-m", "submitit.core._submit", str(folder)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.mark.distributed
def test_submitit_requeues_a_preempted_job_after_its_save_and_the_requeued_job_resumes(tmp_path):
    """submitit's own handler, driven locally: its preemption signal (USR2) in step 4 of 6; the
    trainer finishes the step, saves, writes its summary, then hands over to submitit's handler,
    which calls the job's checkpoint() (the Hydra launcher resubmits itself there), requeues (the
    local environment's requeue is exit status 144, which submitit's local controller restarts)
    and exits. The requeued job resumes at step 4 and ends as the uninterrupted run."""
    pytest.importorskip("submitit")
    from submitit.helpers import DelayedSubmission
    from submitit.local.local import LOCAL_REQUEUE_RETURN_CODE

    from experiments.train import train

    folder, run_dir, job_id = tmp_path / "submitit", tmp_path / "run", "4242"
    folder.mkdir()
    job = DelayedSubmission(cc.SubmititJob(str(run_dir), [], signal_step=3))
    job.set_timeout(60, 0)  # 60 min, no timeouts left: a preemption (not a time limit) is still requeued
    job.dump(folder / f"{job_id}_submitted.pkl")
    result = folder / f"{job_id}_0_result.pkl"

    first = _submitit_task(folder, job_id)
    out = f"{first.stdout[-2000:]}\n{first.stderr[-3000:]}"
    assert first.returncode == LOCAL_REQUEUE_RETURN_CODE, out
    log = first.stdout + first.stderr
    assert "Caught signal SIGUSR2" in log and f"Requeued job {job_id}" in log and "handing SIGUSR2 over" in log, out
    handed = json.loads((run_dir / "handed_over_0.json").read_text())
    assert handed["complete"] and handed["complete"][0] == 4, handed  # saved before submitit took over
    assert handed["summary"]["status"] == "preempted" and handed["summary"]["last_step"] == 4, handed
    assert not result.exists()  # no result: submitit sees a job to run again, not a finished one

    second = _submitit_task(folder, job_id)
    out = f"{second.stdout[-2000:]}\n{second.stderr[-3000:]}"
    assert second.returncode == 0 and "resumed from" in second.stdout, out
    status, summary = __import__("pickle").loads(result.read_bytes())
    assert status == "success", summary
    assert summary["status"] == "completed" and summary["resumed_from_step"] == 4, summary
    torch.set_num_threads(1)  # the job's thread count (one_thread puts the old one back)
    full = train(cc.train_cfg(), run_dir=tmp_path / "full")
    assert summary["train_losses"] == full["train_losses"]
    assert [r["step"] for r in metric_rows(run_dir)] == list(range(1, 7))


def test_the_preemption_signals_in_and_out_of_a_submitit_job():
    from experiments.training.preemption import preemption_signals

    term, usr1, usr2 = signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2
    assert preemption_signals({}) == (term, usr1)
    assert preemption_signals({"SUBMITIT_EXECUTOR": "slurm"}) == (term, usr1, usr2)  # submitit's default
    assert preemption_signals({"SUBMITIT_EXECUTOR": "slurm", "SUBMITIT_PREEMPT_SIGNAL": "USR1"}) == (term, usr1)
    with pytest.raises(
        ValueError, match=r"SUBMITIT_PREEMPT_SIGNAL='SIGUSR2' is not a signal: expected a name without SIG"
    ):
        preemption_signals({"SUBMITIT_EXECUTOR": "local", "SUBMITIT_PREEMPT_SIGNAL": "SIGUSR2"})


@pytest.mark.distributed
def test_a_kill_right_after_a_resume_loses_no_metrics_row(tmp_path):
    """A resumed run keeps the rows up to its checkpoint and drops the later ones. A kill before the
    resumed run's first row is flushed must leave those kept rows on disk (the kill seed 178465144
    found this: killed in the save of step 8, then in step 7 of the resumed run, the log kept only
    steps 7 and 8). ``os._exit`` skips every Python-level flush, like a SIGKILL."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 9)) + '{"step": 9, "lo')
    code = (
        "import os, sys; from experiments.training.tracking import MetricsFile; "
        "m = MetricsFile(sys.argv[1], keep_until=6); os._exit(9)"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 9, p.stderr
    assert [r["step"] for r in metric_rows(tmp_path)] == list(range(1, 7))
    # and the next resume appends after them (the row cut short by the kill was dropped)
    from experiments.training.tracking import MetricsFile

    m = MetricsFile(path, keep_until=6)
    m.write({"step": 7, "loss": 0.5})
    m.close()
    assert [r["step"] for r in metric_rows(tmp_path)] == list(range(1, 8))
