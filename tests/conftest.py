"""Fixtures every test folder shares, and the guard that keeps the ``distributed`` marker honest.

``python -m pytest -m "not distributed"`` runs the single-process suite; a test that spawns ranks
(``tests.support.dist.run_distributed``) or torchrun agents must carry ``@pytest.mark.distributed``
(or a module-level ``pytestmark``), and one that does not fails at once, naming the marker.
"""

import os

import pytest
import torch

from tests.support.dist import MARKED_ENV


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
