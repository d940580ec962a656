import sys
from pathlib import Path

import pytest

# Make ``tests.helpers`` importable however pytest is invoked.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """One intra-op thread: the tests' models are tiny, and on a shared 2-core machine spinning thread pools make
    them several times slower (and DataLoader workers compete with them)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
