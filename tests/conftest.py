"""Fixtures every test folder shares, and the guard that keeps the ``distributed`` marker honest.

``python -m pytest -m "not distributed"`` runs the single-process suite: a test that starts another
process (gloo ranks through ``tests.support.dist.run_distributed``, torchrun agents, a fresh
interpreter) carries ``@pytest.mark.distributed`` (tests/test_markers.py checks every test file), and
``run_distributed`` refuses to start in a test without it.

The suite runs on two pytest-xdist workers (pyproject's ``addopts``); ``-n 0`` runs it in this
process.
"""

import os

import pytest
import torch

from tests.support.dist import MARKED_ENV

# Triton picks its interpreter when it is first imported (its library functions are decorated then)
# and when a kernel is decorated. Without CUDA triton can only run interpreted, so it and the
# project's kernels are imported that way before any test module can import them otherwise: the
# kernel tests then run in this process (tests/kernels/test_triton_ops.py), not in a fresh one.
if not torch.cuda.is_available():
    _previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import routing_kernels.triton_ops  # noqa: F401
    except ImportError:  # no triton (not Linux): the kernel tests skip themselves
        pass
    finally:
        if _previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = _previous


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns the group into the test's id
def pytest_collection_modifyitems(config, items):
    # under pytest-xdist (pyproject's addopts: two workers, --dist loadgroup) a module's distributed
    # tests form one group, which runs on one worker: its module-scoped fixtures (trained runs,
    # checkpoints) are built once. Two modules' groups may run at once, one a worker: their ranks
    # wait on each other's collectives more than they compute (the suite's processes kept 0.9 of
    # the 2 cores busy with every distributed test on one worker)
    for item in items:
        if item.get_closest_marker("distributed"):
            item.add_marker(pytest.mark.xdist_group(f"distributed:{item.module.__name__}"))


def pytest_configure(config):
    # a worker's intra-op threads: the cores divided among the workers, so that tests which do not
    # ask for one thread (``one_thread``) or two (the lane tests) do not oversubscribe the machine
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


def pytest_runtest_setup(item):
    # before the item's fixtures, module-scoped ones included (they may start ranks too)
    os.environ[MARKED_ENV] = "1" if item.get_closest_marker("distributed") else "0"


def pytest_runtest_teardown(item):
    os.environ.pop(MARKED_ENV, None)


@pytest.fixture
def one_thread():
    """Run a test on one intra-op thread. Test tensors are tiny, so a second thread gains nothing,
    and on a shared, oversubscribed machine every OpenMP/MKL barrier waits for a descheduled
    thread: a 256-token forward took 10-600 ms with two threads, 3 ms with one. Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def stdlib():
    """The embedded stdlib corpus, cached under $SWITCHYARD_CACHE or ~/.cache/switchyard after the first read."""
    from experiments.training.data import load_stdlib

    return load_stdlib()
