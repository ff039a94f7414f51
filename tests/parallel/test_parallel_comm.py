"""Collective timeouts ([comm]): a rank that never joins a collective makes the others fail fast. And the
command-line exit under torchrun: the exit status kept, the interpreter's finalization skipped."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.helpers.dist import backends, run_workers


def missing_rank_worker(args: dict) -> dict:
    """Rank 1 skips an all-reduce; rank 0 must get an error after ~the timeout, not hang."""
    import torch
    import torch.distributed as dist

    from titanlite.parallel.distributed import init_distributed, set_collective_timeout, world_from_env

    world = world_from_env()
    init_distributed(world, timeout_seconds=args["init_timeout"])
    dist.barrier()
    if args["train_timeout"] is not None:
        set_collective_timeout(args["train_timeout"])
    out = {"error": None, "seconds": None}
    if world.rank == 0:
        start = time.perf_counter()
        try:
            dist.all_reduce(torch.ones(4, device=world.device))
        except Exception as e:  # the timeout surfaces as a (backend-specific) RuntimeError
            out["error"] = f"{type(e).__name__}: {e}"
        out["seconds"] = time.perf_counter() - start
    else:
        time.sleep(args["sleep"])  # alive but absent: a hang, not a crash
    dist.destroy_process_group()  # the group is broken: leave without the launcher's final barrier
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", backends(2))
def test_hung_collective_fails_after_timeout(backend):
    """The process group starts with a long ([comm] init_timeout_seconds-like) timeout, lowered by
    set_collective_timeout as the Trainer does after its first step ([comm] train_timeout_seconds):
    the hung all-reduce then fails after ~1 s instead of waiting for the other rank."""
    res = run_workers(
        missing_rank_worker, 2, {"init_timeout": 300, "train_timeout": 1, "sleep": 5}, backend=backend, timeout=120
    )
    assert res[0]["error"] is not None, res[0]
    assert 0.8 <= res[0]["seconds"] < 4.5, res[0]


EXIT_SCRIPT = """
import atexit, logging, sys
from pathlib import Path
from titanlite.parallel.distributed import main_then_exit

out = Path(sys.argv[1])
logging.basicConfig(filename=out / "log.txt", level=logging.INFO)
atexit.register(lambda: (out / "finalized").write_text("yes"))

def entry():
    logging.getLogger("t").info("trained")
    sys.stdout.write("partial line without a newline")
    outcome = sys.argv[2]
    if outcome == "error":
        raise RuntimeError("a bug")
    if outcome != "ok":
        raise SystemExit(int(outcome))

main_then_exit(entry)
"""


@pytest.mark.parametrize("outcome,code", [("ok", 0), ("3", 3), ("error", 1)])
@pytest.mark.parametrize("world_size", ["1", "2"])
def test_main_then_exit_keeps_the_status_and_skips_finalization_under_torchrun(tmp_path, outcome, code, world_size):
    """Under torchrun (WORLD_SIZE > 1) a finished rank leaves with os._exit, after logging and stdout are
    flushed, so no gloo thread meets a finalizing interpreter (atexit handlers do not run); one process
    exits as Python does. Either way the status is the entry's."""
    script = tmp_path / "entry.py"
    script.write_text(textwrap.dedent(EXIT_SCRIPT))
    env = dict(os.environ, WORLD_SIZE=world_size)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path), outcome], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == code, out.stderr
    assert out.stdout == "partial line without a newline"
    assert "INFO:t:trained" in (tmp_path / "log.txt").read_text()
    assert (tmp_path / "finalized").exists() == (world_size == "1")
    assert ("RuntimeError: a bug" in out.stderr) == (outcome == "error")
