"""Preemption in the trainer: the signals a scheduler sends before it stops a job become a flag
every rank agrees on after each step (it rides in the optimizer step's gradient-norm all-reduce),
so all of them save and stop at the same step; the handler that was installed before the
trainer's (submitit's requeue) runs once the run has saved.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import torch


def preemption_signals(environ=os.environ) -> tuple[signal.Signals, ...]:
    """SIGTERM and SIGUSR1, and in a submitit job (``SUBMITIT_EXECUTOR`` set) submitit's preemption
    signal too: ``SUBMITIT_PREEMPT_SIGNAL`` without its ``SIG``, USR2 by default, which is what its
    SLURM jobs are sent ``signal_delay_s`` before their time limit (``--signal``)."""
    signals = [signal.SIGTERM, signal.SIGUSR1]
    if environ.get("SUBMITIT_EXECUTOR"):
        name = environ.get("SUBMITIT_PREEMPT_SIGNAL") or "USR2"
        s = getattr(signal, "SIG" + name, None)
        if not isinstance(s, signal.Signals):
            raise ValueError(
                f"SUBMITIT_PREEMPT_SIGNAL={name!r} is not a signal: expected a name without SIG, "
                "e.g. USR2, USR1 or TERM"
            )
        if s not in signals:
            signals.append(s)
    return tuple(signals)


class Preemption:
    """SIGTERM and SIGUSR1 (what schedulers send before they stop a job), and submitit's preemption
    signal in a submitit job (``preemption_signals``), set a flag instead of ending the process;
    ``requested()`` is True on every rank once any rank has it, from the flags the optimizer step
    summed in its gradient norm's all-reduce (``flag()``, ``engine.step(extra_sums=...)``): no
    collective and no host sync of its own (at 2,048 ranks a ring all-reduce of its own would take
    4,094 latency steps every step). Handlers are installed only in the main thread, and
    ``close()`` puts the previous ones back. The handler that was installed before ours for the
    signal that came is remembered: ``hand_over()``, after the save, runs it when it is a Python
    function (submitit's, which requeues the job)."""

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}
        self._next = None  # the previous handler of the signal that came
        if threading.current_thread() is threading.main_thread():
            for s in preemption_signals():
                self._previous[s] = signal.signal(s, self._handler)

    def _handler(self, signum, frame) -> None:
        if self.signum is not None:  # a second signal: stop now, the way the process would have without us
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        self._next = self._previous.get(signum)

    def flag(self) -> torch.Tensor:
        """This rank's flag, 1.0 once a signal came: what the trainer hands ``engine.step`` as
        ``extra_sums``, to be summed over every rank in the all-reduce of the gradient norm."""
        return torch.tensor([0.0 if self.signum is None else 1.0])

    def requested(self, ranks_flagged: float) -> bool:
        """Whether any rank has had a signal, from ``flag()`` summed over every rank by the step just
        taken (``engine.last_extra_sums``): the same answer on every rank, with no collective of its
        own."""
        return ranks_flagged > 0

    def hand_over(self) -> None:
        """Once the run has saved and written its summary: the handler that was installed before ours
        for the signal this process received, when it is a Python function, runs now as if the
        signal had just come (after ``close()``, so with the previous handlers back). It may raise
        SystemExit: submitit's checkpoints the job's callable, requeues the job and exits (on its
        rank 0; on other ranks it only logs). SIG_DFL, SIG_IGN, a handler installed outside Python
        or no signal on this rank (another rank's): nothing, and the trainer returns "preempted"."""
        handler, self._next = self._next, None
        if callable(handler):
            name = getattr(handler, "__qualname__", repr(handler))
            print(
                f"handing {signal.Signals(self.signum).name} over to the handler installed before the trainer's "
                f"({getattr(handler, '__module__', '?')}.{name})",
                flush=True,
            )
            handler(self.signum, sys._getframe(0))

    def close(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}
