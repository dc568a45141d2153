"""Shared test settings."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """The tests use small matrices: intra-op threads only add barrier waits (several times slower on a
    shared, busy 2-core CPU). Subprocesses (distributed ranks, the CLI) set their own thread counts."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
