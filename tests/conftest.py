"""Fixtures shared by several test files."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models are overhead-bound: one intra-op thread is as fast and does not fight the
    other processes of a busy machine (restored afterwards). Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
