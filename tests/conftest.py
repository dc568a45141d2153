"""Shared test settings."""

import os

import pytest
import torch

from orthoptim.kernels import cpu_dtype

# The tolerances of the numerical tests are fp32's, on every CI machine: without this the polar
# iterations would run in bf16 on CPUs with bf16 matrix units (the library's default there) and in
# fp32 elsewhere. tests/test_cpu_dtype.py covers the automatic choice and the bf16 path.
# An environment variable, so that subprocesses (distributed ranks, the CLI) inherit it.
os.environ[cpu_dtype.ENV_VAR] = "float32"


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """The tests use small matrices: intra-op threads only add barrier waits (several times slower on a
    shared, busy 2-core CPU). Subprocesses (distributed ranks, the CLI) set their own thread counts."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
