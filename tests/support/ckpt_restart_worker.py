"""torchrun entry point of the kill-and-resume tests (tests/experiments/test_kill_resume.py): ``experiments.train``
itself, except that one rank SIGKILLs itself at the point ``SWITCHYARD_TEST_KILL`` names for this
attempt, so torchrun must restart the group and the trainer resume on its own.
``SWITCHYARD_TEST_KILL`` is a comma-separated list of ``<moment>:<step>:<rank>``, the i-th for
torchrun's attempt i (``TORCHELASTIC_RESTART_COUNT``); later attempts run undisturbed. The moments:

- ``save``: inside the save of step ``<step>``, once this rank's data files are written and before
  any manifest exists (a checkpoint that looks almost complete;
  ``zero.checkpoint.storage._Writer.write_data`` is where a rank's files are done);
- ``forward``: inside the model's forward of training step ``<step>`` (1-based), as it enters its
  first MoE layer (the blocks before it ran; the other rank then waits in that layer's all-to-all);
- ``optimizer``: after the backward of step ``<step>``, before the engine reduces the gradients and
  steps the optimizer.

Before dying the rank appends ``<moment>:<step>:<rank>`` as a line to ``SWITCHYARD_TEST_KILL_MARK``
(fsynced), so the test knows which kills happened. Nothing is patched without ``SWITCHYARD_TEST_KILL``.
With ``SWITCHYARD_TEST_EXIT_MARK`` each rank that exits normally appends whether it still held a
process group when the last exit handler ran.
"""

import os
import signal
from pathlib import Path

MOMENTS = ("save", "forward", "optimizer")


def parse_kill(spec: str) -> tuple[str, int, int]:
    """``<moment>:<step>:<rank>`` -> (moment, step, rank); an error names the value and what is valid."""
    parts = spec.split(":")
    if (
        len(parts) != 3
        or parts[0] not in MOMENTS
        or not parts[1].isdigit()
        or not parts[2].isdigit()
        or int(parts[1]) < 1
    ):
        raise ValueError(
            f"SWITCHYARD_TEST_KILL={spec!r} is invalid: expected <moment>:<step>:<rank> with moment one of "
            f"{MOMENTS}, step >= 1 and rank >= 0, e.g. 'save:4:1'"
        )
    return parts[0], int(parts[1]), int(parts[2])


def _die(spec: str) -> None:
    mark = os.environ.get("SWITCHYARD_TEST_KILL_MARK")
    if mark:
        with open(mark, "a") as f:
            f.write(spec + "\n")
            f.flush()
            os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


def install(spec: str, rank: int) -> None:
    """Patch this process to die at ``spec`` if it is the rank it names."""
    moment, step, victim = parse_kill(spec)
    if rank != victim:
        return
    if moment == "save":
        from zero import checkpoint as zc
        from zero.checkpoint.storage import _Writer

        kill_in = zc.step_dir("", step).name
        write_data = _Writer.write_data

        def write_and_die(self, plan, planner):
            fut = write_data(self, plan, planner)
            if Path(self.path).name == kill_in:
                _die(spec)
            return fut

        _Writer.write_data = write_and_die
        return
    # the training step being taken (1-based): the batch drawn last for the train split
    from experiments.training.data import LMData

    current = [0]
    get_batch = LMData.get_batch

    def tracking_get_batch(self, split, s, *args, **kw):
        if split == "train":
            current[0] = s + 1
        return get_batch(self, split, s, *args, **kw)

    LMData.get_batch = tracking_get_batch
    if moment == "forward":
        from moe.layer import MoELayer

        forward = MoELayer.forward

        def forward_and_die(self, x):
            if self.training and current[0] == step:
                _die(spec)
            return forward(self, x)

        MoELayer.forward = forward_and_die
    else:
        import zero

        engine_step = zero.ZeroEngine.step

        def step_and_die(self, *args, **kw):
            if current[0] == step:
                _die(spec)
            return engine_step(self, *args, **kw)

        zero.ZeroEngine.step = step_and_die


def _record_exit(path: str) -> None:
    """At this process's exit, after every other exit handler (registered first, so run last): append
    ``<rank> <whether a process group is still initialized>`` to ``path``."""
    import atexit

    def record():
        import torch.distributed as dist

        with open(path, "a") as f:
            f.write(f"{os.environ.get('RANK', '0')} {dist.is_initialized()}\n")

    atexit.register(record)


if os.environ.get("SWITCHYARD_TEST_EXIT_MARK"):
    _record_exit(os.environ["SWITCHYARD_TEST_EXIT_MARK"])

_kills = [k for k in os.environ.get("SWITCHYARD_TEST_KILL", "").split(",") if k]
_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if _attempt < len(_kills):
    install(_kills[_attempt], int(os.environ.get("RANK", "0")))

if __name__ == "__main__":
    from experiments.train import main

    main()
