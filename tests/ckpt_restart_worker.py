"""torchrun entry point of the restart test: ``experiments.train`` itself, except that in torchrun's
first attempt rank 1 SIGKILLs itself inside the save of step ``SWITCHYARD_TEST_KILL_AT``, once its
data files are written and before any manifest exists (the worst moment: a checkpoint that looks
almost complete). torchrun must then restart the group, and the trainer resume on its own."""
import os
import signal
from pathlib import Path

from zero import checkpoint as zc

if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and os.environ.get("RANK") == "1":
    _kill_in = zc.step_dir("", int(os.environ["SWITCHYARD_TEST_KILL_AT"])).name
    _write_data = zc._Writer.write_data

    def _write_and_die(self, plan, planner):
        fut = _write_data(self, plan, planner)
        if Path(self.path).name == _kill_in:
            os.kill(os.getpid(), signal.SIGKILL)
        return fut

    zc._Writer.write_data = _write_and_die

if __name__ == "__main__":
    from experiments.train import main

    main()
