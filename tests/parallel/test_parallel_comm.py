"""Collective timeouts ([comm]): a rank that never joins a collective makes the others fail fast. And the
command-line exit under torchrun: the exit status kept, the interpreter's finalization skipped."""

from __future__ import annotations

import json
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

# One fresh interpreter pays for the imports once, then forks a child per case that runs EXIT_SCRIPT as
# ``python entry.py <folder> <outcome>`` would: its own stdout/stderr files and WORLD_SIZE, and the script's end
# (or its uncaught exception) ends the child through the interpreter's own exit and finalization.
FORKING_LAUNCHER = """
import json, os, runpy, sys
import titanlite.parallel.distributed  # noqa: F401 - the import every case makes, paid once before the forks

script, cases = sys.argv[1], json.loads(sys.argv[2])
for folder, outcome, world_size in cases:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.environ["WORLD_SIZE"] = world_size
        for fd, name in ((1, "stdout"), (2, "stderr")):
            handle = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(handle, fd)
            os.close(handle)
        sys.argv = [script, folder, outcome]
        runpy.run_path(script, run_name="__main__")
        raise SystemExit(0)  # the script ran to its end: python's own exit
    status = os.waitpid(pid, 0)[1]
    with open(os.path.join(folder, "status"), "w") as f:
        f.write(str(os.waitstatus_to_exitcode(status)))
"""

CASES = [
    (outcome, code, world_size) for world_size in ("1", "2") for outcome, code in (("ok", 0), ("3", 3), ("error", 1))
]


@pytest.fixture(scope="module")
def exits(tmp_path_factory) -> dict:
    """Each case's folder after EXIT_SCRIPT ran in it (status, stdout, stderr, log.txt, finalized?)."""
    root = tmp_path_factory.mktemp("exits")
    script = root / "entry.py"
    script.write_text(textwrap.dedent(EXIT_SCRIPT))
    folders = {(outcome, world_size): root / f"{outcome}-{world_size}" for outcome, _, world_size in CASES}
    for folder in folders.values():
        folder.mkdir()
    cases = [[str(folders[o, w]), o, w] for o, _, w in CASES]
    launcher = subprocess.run(
        [sys.executable, "-c", FORKING_LAUNCHER, str(script), json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert launcher.returncode == 0, launcher.stderr[-3000:]
    return folders


@pytest.mark.parametrize("outcome,code,world_size", CASES)
def test_main_then_exit_keeps_the_status_and_skips_finalization_under_torchrun(exits, outcome, code, world_size):
    """Under torchrun (WORLD_SIZE > 1) a finished rank leaves with os._exit, after logging and stdout are
    flushed, so no gloo thread meets a finalizing interpreter (atexit handlers do not run); one process
    exits as Python does. Either way the status is the entry's."""
    folder = exits[outcome, world_size]
    stderr = (folder / "stderr").read_text()
    assert int((folder / "status").read_text()) == code, stderr
    assert (folder / "stdout").read_text() == "partial line without a newline"
    assert "INFO:t:trained" in (folder / "log.txt").read_text()
    assert (folder / "finalized").exists() == (world_size == "1")
    assert ("RuntimeError: a bug" in stderr) == (outcome == "error")
