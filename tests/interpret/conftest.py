"""Interpreter tests: run only with TRITON_INTERPRET=1 (tests/test_triton_kernels.py starts
them in a child process, one per file)."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ helpers


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise pytest.UsageError("tests/interpret/ needs TRITON_INTERPRET=1 (run them through "
                                "tests/test_triton_kernels.py)")


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    """The interpreter runs many tiny numpy ops, which one thread does fastest (torch's intra-op
    pool spins on a loaded 2-core runner). Restored afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
