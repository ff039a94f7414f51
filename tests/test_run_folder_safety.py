"""What a tool may run, delete or overwrite because of what a folder says (issue 27, items 1, 2, 3 and 5).

- the eval watcher imports only the modules on its own ``--extensions``, never the ``[job] extensions`` of the
  ``config.toml`` it watches (a module file beside it would run);
- ``prepare_data --overwrite`` deletes only plain shard files inside its output folder, whatever its manifest or
  journal list (tests/data/test_prepare_data.py);
- the run lock covers the checkpoint folder wherever it lives, and a ``CheckpointManager`` used as a library takes
  it too;
- nothing writes into a checkpoint step folder (a dump folder there, ``eval --output <step>/checkpoint.json``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.checkpoint_runs import TINY, run_trainer
from tests.helpers.cli import one_line_error
from tests.helpers.launch import run_python
from tests.helpers.shared_data import shared_file
from tests.helpers.tiny import TINY_MODEL
from titanlite.config import config_to_toml
from titanlite.models import load_config

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- 1. the watcher imports only its own --extensions
def watched_run(dump: Path, extensions: list[str], model: str = "llama3") -> None:
    """A run folder as a run leaves it when it starts (config.toml), with ``[job] extensions`` set in the file
    only (loading them here would import them)."""
    cfg = load_config([*TINY_MODEL, "--checkpoint.enable", "--job.dump_folder", str(dump)])
    text = config_to_toml(cfg).replace("extensions = []", f"extensions = {json.dumps(extensions)}", 1)
    dump.mkdir(parents=True)
    (dump / "config.toml").write_text(text.replace('name = "llama3"', f'name = "{model}"', 1))


def test_watcher_never_imports_the_extensions_the_watched_config_names(tmp_path):
    """Run from inside the watched folder, ``python -m`` puts that folder first on the path: a module there named
    by the run's config.toml used to be imported (and run) by the watcher."""
    eval_data = shared_file("eval")
    dump = tmp_path / "run"
    watched_run(dump, ["planted_ext_27"])
    marker = tmp_path / "planted_ran"
    (dump / "planted_ext_27.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "titanlite.eval", "--watch", str(dump), "--once", "--tasks", "piqa"]
    done = run_python([*argv, "--data-dir", str(eval_data)], cwd=dump, env=env)  # python -m: dump first on sys.path
    assert not marker.exists(), "the watcher imported a module named by the watched config.toml"
    assert done.returncode == 0, done.stderr  # a core family: the run's extensions are not needed to watch it


def test_watcher_names_the_extension_a_family_needs_instead_of_importing_it(tmp_path, capsys):
    from titanlite.eval import cli

    dump = tmp_path / "run"
    watched_run(dump, ["planted_family_ext_27"], model="planted_family")
    (dump / "planted_family_ext_27.py").write_text("raise SystemExit('imported')\n")
    sys.path.insert(0, str(dump))
    try:
        assert cli.main(["--watch", str(dump), "--once", "--data-dir", str(tmp_path)]) == 2
    finally:
        sys.path.remove(str(dump))
    err = one_line_error(capsys)
    assert "model family 'planted_family' comes from the run's [job] extensions" in err
    assert err.endswith("pass --extensions planted_family_ext_27")
    assert "planted_family_ext_27" not in sys.modules


# ---------------------------------------------------------------- 3. the lock covers the checkpoint folder
HOLDER = """
import sys, time, torch
from titanlite.checkpoint import CheckpointManager
from titanlite.config import parse_config
argv = ["--checkpoint.enable", "--checkpoint.interval", "10", "--checkpoint.keep_latest_k", "0"]
section = parse_config(argv).checkpoint
manager = CheckpointManager(section, sys.argv[1], {"model": torch.nn.Linear(2, 2)})
manager.save(10)
manager.save(20)
print("saved", flush=True)
time.sleep(120)
"""


@pytest.fixture(scope="module")
def live_checkpoints(tmp_path_factory):
    """A process that uses ``run1/checkpoint`` through a CheckpointManager (as a library) and saved steps 10 and 20
    (the tests refuse to touch it, so they share it)."""
    folder = tmp_path_factory.mktemp("live") / "run1" / "checkpoint"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "saved"
        yield folder, holder.pid
    finally:
        holder.kill()
        holder.wait(timeout=30)


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("spelling", ["relative", "absolute"])
def test_a_run_pointed_into_a_live_checkpoint_folder_is_refused(live_checkpoints, spelling, capsys):
    from titanlite.train import main

    folder, pid = live_checkpoints
    before = folder_bytes(folder)
    run2 = folder.parent.parent / f"run2_{spelling}"  # beside run1
    where = "../run1/checkpoint" if spelling == "relative" else str(folder)
    with pytest.raises(SystemExit) as e:
        main(TINY + ["--job.dump_folder", str(run2), "--checkpoint.folder", where])
    assert e.value.code == 2
    err = one_line_error(capsys)
    assert f"checkpoint.folder={run2 / where if spelling == 'relative' else folder} is in use" in err
    assert f"(pid {pid} on " in err
    assert folder_bytes(folder) == before


def test_a_second_checkpoint_manager_on_a_live_folder_is_refused(live_checkpoints):
    """A library user's second process on the same folder, resuming an older step, used to move step-20 aside."""
    import torch

    from titanlite.checkpoint import CheckpointManager

    folder, pid = live_checkpoints
    before = folder_bytes(folder)
    section = load_config(["--checkpoint.enable", "--checkpoint.load_step", "10"]).checkpoint
    with pytest.raises(ValueError, match=rf"checkpoint.folder={folder} is in use by another run \(pid {pid} on "):
        manager = CheckpointManager(section, folder, {"model": torch.nn.Linear(2, 2)})
        manager.load()
        manager.commit_resume()
    assert folder_bytes(folder) == before and (folder / "step-20").is_dir()


PROBE = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
try:
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("free")
except OSError:
    print("held")
"""


def lock_state(folder: Path) -> str:
    """Whether another process can take the lock of ``folder`` (plain fcntl, not titanlite's RunLock)."""
    probe = [sys.executable, "-c", PROBE, str(folder / ".titanlite.lock")]
    return subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip()


def test_one_process_can_lock_a_folder_twice_and_holds_it_until_the_last_release(tmp_path):
    """A checkpoint folder that is the dump folder (or a trainer built again in a notebook): the same process locks
    it twice; releasing one must not release the other's lock (closing any descriptor of the file would)."""
    from titanlite.utils.run_lock import RunLock

    first = RunLock(tmp_path, "job.dump_folder").acquire()
    second = RunLock(tmp_path / ".." / tmp_path.name, "checkpoint.folder").acquire()
    assert lock_state(tmp_path) == "held"
    first.release()
    assert lock_state(tmp_path) == "held"
    second.release()
    assert lock_state(tmp_path) == "free"
    run_trainer(tmp_path / "run", "--training.steps", "5", "--checkpoint.folder", ".")  # both locks on one file
    assert lock_state(tmp_path / "run") == "free"  # released when the run ended


# ---------------------------------------------------------------- 5. nothing writes into a checkpoint step folder
@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    dump = tmp_path_factory.mktemp("finished") / "run"
    run_trainer(dump, "--training.steps", "5")
    return dump / "checkpoint" / "step-5"


@pytest.mark.parametrize("inside", [False, True])
def test_a_dump_folder_in_a_checkpoint_step_folder_is_refused(finished, inside, capsys):
    """It used to write config.toml over the step's own, metrics and a nested checkpoint/ into the finished step."""
    from titanlite.train import main

    before = folder_bytes(finished)
    dump = finished / "again" if inside else finished
    with pytest.raises(SystemExit) as e:
        main(TINY + ["--job.dump_folder", str(dump), "--training.steps", "10"])
    assert e.value.code == 2
    where = "lies inside" if inside else "is"
    assert one_line_error(capsys) == (
        f"error: job.dump_folder={dump} {where} the checkpoint step folder {finished}: writing there would change or "
        "replace that checkpoint's files; choose a path outside it"
    )
    assert folder_bytes(finished) == before and sorted(p.name for p in finished.iterdir()) == sorted(before)


def test_eval_output_into_a_checkpoint_step_folder_is_refused(finished, tmp_path, capsys):
    """``--output <step>/checkpoint.json`` used to replace the checkpoint's description: the step no longer loaded."""
    from titanlite.checkpoint.load_model import load_model
    from titanlite.eval import cli

    eval_data = shared_file("eval")
    before = folder_bytes(finished)
    output = finished / "checkpoint.json"
    argv = ["--checkpoint", str(finished), "--tasks", "piqa", "--limit", "2", "--data-dir", str(eval_data)]
    assert cli.main([*argv, "--output", str(output)]) == 2
    assert f"--output {output} lies inside the checkpoint step folder {finished}" in one_line_error(capsys)
    assert folder_bytes(finished) == before
    assert load_model(finished).step == 5


def test_a_checkpoint_folder_in_a_step_folder_is_refused(finished):
    import torch

    from titanlite.checkpoint import CheckpointManager

    before = folder_bytes(finished)
    section = load_config(["--checkpoint.enable"]).checkpoint
    with pytest.raises(ValueError, match=rf"^checkpoint.folder={finished}/checkpoint lies inside the checkpoint step"):
        CheckpointManager(section, finished / "checkpoint", {"model": torch.nn.Linear(2, 2)})
    assert folder_bytes(finished) == before
