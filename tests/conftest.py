import pytest
import torch


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
