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


def pytest_collection_modifyitems(session, config, items):
    """Tests marked ``memory_measurement`` run first: they compare a fresh process's RSS with a model,
    and after a few hundred other tests the machine's memory state (page cache, reclaim) inflated the
    measured peaks by 30-180% (tests/plan/test_planner.py), while the same test alone stayed within 10%."""
    items.sort(key=lambda item: item.get_closest_marker("memory_measurement") is None)  # stable sort
