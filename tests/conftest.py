"""Fixtures shared by several test files, and the order the tests run in."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tests.helpers.dist import TOKEN_CACHE


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models are overhead-bound: one intra-op thread is as fast and does not fight the
    other processes of a busy machine (restored afterwards). Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# The files that take longest, longest first (per-file sums of each test's CPU seconds, TITANLITE_TEST_CPU_LOG, in a
# -n 2 run on the 2-core machine, 2026-11-29; test_docs.py, which mostly waits on its shell, by its wall time).
# scripts/test.sh gives each pytest worker whole files in collection order (--dist loadfile); starting the long ones
# first keeps the run from ending with one worker busy and the other idle. Only the order depends on this list.
LONGEST_FILES = [
    "parallel/test_parallel_parity.py",
    "test_docs.py",
    "parallel/test_pipeline.py",
    "eval/test_eval.py",
    "parallel/test_moe_parallel.py",
    "parallel/test_context_parallel.py",
    "test_library_examples.py",
    "plan/test_planner.py",
    "trainer/test_output_loss.py",
    "eval/test_generate.py",
    "trainer/test_preemption.py",
    "parallel/test_float8.py",
    "tools/test_parallel_bench.py",
    "parallel/test_muon_parallel.py",
    "data/test_hf_tokenizer.py",
    "eval/test_eval_loop.py",
    "parallel/test_parallel_dims.py",
    "checkpoint/test_checkpoint_dist.py",
    "trainer/test_failure_modes.py",
    "parallel/test_float8_fsdp.py",
    "data/test_recipes.py",
    "checkpoint/test_checkpoint.py",
    "optim/test_optimizer_step.py",
    "checkpoint/test_kill_moments.py",
    "tools/test_cli.py",
    "tools/test_plot.py",
    "ext/test_qwen3.py",
    "config/test_train_configs.py",  # the files not named take less
]


def pytest_collection_modifyitems(session, config, items):
    """Tests marked ``memory_measurement`` run first: they compare a fresh process's RSS with a model,
    and after a few hundred other tests the machine's memory state (page cache, reclaim) inflated the
    measured peaks by 30-180% (tests/plan/test_planner.py), while the same test alone stayed within 10%.
    Then the files of ``LONGEST_FILES`` in its order, then the rest as collected."""
    tests = Path(__file__).parent
    rank = {tests / name: i for i, name in enumerate(LONGEST_FILES)}

    def key(item):
        return item.get_closest_marker("memory_measurement") is None, rank.get(item.path, len(rank))

    items.sort(key=key)  # stable: the tests of a file keep their order


def pytest_sessionfinish(session, exitstatus):
    """Stop this process's fork server (tests/helpers/dist.py) and wait for it, so that the CPU time of the processes
    it forked is counted in this process's children (``/usr/bin/time``, ``resource.getrusage``)."""
    import multiprocessing.forkserver

    server = multiprocessing.forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is not None:
        server._stop()


def _cpu_seconds() -> float:
    """CPU seconds used so far by this process, its reaped children and the fork server's (tests/helpers/dist.py)."""
    import multiprocessing.forkserver
    import resource

    total = sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime for who in (0, -1))
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    if pid is not None:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return total
        total += sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ``TITANLITE_TEST_CPU_LOG=<file>``, append each test's CPU seconds (this process, the processes it
    started and the ranks it forked) and its id to the file: the suite is CPU-bound on 2 cores, and wall time under
    load says little about what a test costs."""
    log = os.environ.get("TITANLITE_TEST_CPU_LOG")
    start = _cpu_seconds() if log else 0.0
    yield
    if log:
        with open(log, "a") as f:
            f.write(f"{_cpu_seconds() - start:.2f} {item.nodeid}\n")


def pytest_configure(config):
    """The session's token cache (``tests.helpers.dist.cache_token_stores``): made by the main pytest process,
    before its workers and their ranks start (they inherit the variable), removed when the session ends."""
    if not hasattr(config, "workerinput") and TOKEN_CACHE not in os.environ:
        os.environ[TOKEN_CACHE] = config._titanlite_token_cache = tempfile.mkdtemp(prefix="titanlite_tokens_")


def pytest_unconfigure(config):
    folder = getattr(config, "_titanlite_token_cache", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(TOKEN_CACHE, None)
