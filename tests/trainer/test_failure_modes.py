"""Failure modes of a run and its dump folder: each ends as the right result or one line, nothing lost.

A second run in a live run's folder, a dump folder that is a file, a resume whose data changed, a
full disk during a save, checkpoints that would run code when unpickled, and the proof that a
resume unpickles nothing but DCP's ``.metadata``.
"""

from __future__ import annotations

import json
import logging
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.helpers.checkpoint_runs import TINY, metrics, run_trainer, steps_in
from tests.helpers.cli import one_line_error
from titanlite.checkpoint import layout
from titanlite.train import main

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_thread")


def test_second_run_in_a_live_runs_folder_refuses_and_names_the_holder(tmp_path, capsys):
    dump = tmp_path / "run"
    partial = dump / "checkpoint" / "step-5.partial-1a2b3c4d"  # the live run's save in progress
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"x" * 100)
    hold = "import sys, time\nfrom titanlite.utils.run_lock import RunLock\nlock = RunLock(sys.argv[1]).acquire()\n"
    hold += "print('locked', flush=True)\ntime.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", hold, str(dump)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(SystemExit) as e:
            main(TINY + ["--job.dump_folder", str(dump)])
        assert e.value.code == 2
        err = one_line_error(capsys)
        assert f"job.dump_folder={dump} is in use by another run (pid {holder.pid} on " in err
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert (partial / "__0_0.distcp").read_bytes() == b"x" * 100  # untouched
    assert not (dump / "config.toml").exists() and not (dump / "metrics.jsonl").exists()


@pytest.mark.parametrize("where", ["is_a_file", "under_a_file"])
def test_dump_folder_that_is_a_file_is_a_one_line_error(where, tmp_path, capsys):
    blocker = tmp_path / "outputs"
    blocker.write_text("not a folder")
    dump = blocker if where == "is_a_file" else blocker / "run"
    with pytest.raises(SystemExit) as e:
        main(TINY + ["--job.dump_folder", str(dump)])
    assert e.value.code == 2
    assert "it, or a folder above it, is a file" in one_line_error(capsys)
    assert blocker.read_text() == "not a folder"


@pytest.fixture(scope="module")
def ten_step_run(tmp_path_factory) -> Path:
    """A finished 10-step run (checkpoints at steps 5 and 10, config.toml); the tests that resume it and must fail
    each get a copy of its folder (they also check that the failure changed nothing)."""
    dump = tmp_path_factory.mktemp("ten_steps") / "run"
    run_trainer(dump, "--training.steps", "10")
    return dump


@pytest.mark.parametrize("key, value, says", [("seq_len", "16", "seq_len=32, this run has 16"), ("seed", "7", "seed=")])
def test_resume_with_changed_data_is_one_line_and_loses_nothing(key, value, says, tmp_path, capsys, ten_step_run):
    dump = shutil.copytree(ten_step_run, tmp_path / "run")
    before = (dump / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(TINY + ["--job.dump_folder", str(dump), "--training.steps", "20", f"--training.{key}", value])
    assert e.value.code == 2
    err = one_line_error(capsys)
    assert f"cannot resume train data: checkpoint has {says}" in err
    assert (dump / "metrics.jsonl").read_bytes() == before  # not rewound by the failed resume
    assert steps_in(dump) == [5, 10]


def test_failed_resume_from_an_older_step_moves_nothing_aside(tmp_path, capsys, ten_step_run):
    """load_step 5 with a changed seq_len fails to resume: the newer step-10 stays where it was (the
    abandoned lineage moves aside only once a resume succeeded), and config.toml is not rewritten."""
    dump = shutil.copytree(ten_step_run, tmp_path / "run")
    config = (dump / "config.toml").read_bytes()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(TINY + ["--job.dump_folder", str(dump), "--checkpoint.load_step", "5", "--training.seq_len", "16"])
    assert e.value.code == 2 and "cannot resume train data" in one_line_error(capsys)
    assert steps_in(dump) == [5, 10] and not list((dump / "checkpoint").glob("abandoned-*"))
    assert (dump / "config.toml").read_bytes() == config


def test_resume_keeps_the_model_args_the_run_trained_with(tmp_path, capsys):
    """A run whose checkpoint records rope_theta 12345 (taken from a seed at its start) resumes with
    it even when the seed is gone; a config that sets another value explicitly is a one-line error."""
    dump = tmp_path / "run"
    run_trainer(dump, "--training.steps", "5", "--model.rope_theta", "12345")
    info = layout.read_info(dump / "checkpoint" / "step-5")
    assert info["model"]["args"]["rope_theta"] == 12345
    trainer = run_trainer(dump, "--training.steps", "6")  # no rope_theta in the config: the flavor's differs
    assert trainer.model_args.rope_theta == 12345
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(TINY + ["--job.dump_folder", str(dump), "--training.steps", "8", "--model.rope_theta", "777"])
    assert e.value.code == 2
    assert "model.rope_theta=777" in one_line_error(capsys)


def test_finished_run_rerun_with_another_model_is_an_error_not_complete(tmp_path, capsys):
    dump = tmp_path / "run"
    main(TINY + ["--job.dump_folder", str(dump), "--training.steps", "5"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(TINY + ["--job.dump_folder", str(dump), "--training.steps", "5", "--model.n_kv_heads", "4"])
    assert e.value.code == 2 and "n_kv_heads" in one_line_error(capsys)  # not "the run is complete"


def _can_mount_tmpfs(tmp_path: Path) -> bool:
    probe = tmp_path / "probe"
    probe.mkdir()
    cmd = ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m none {probe}"]
    try:
        return (
            shutil.which("unshare") is not None and subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
        )
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_disk_full_during_a_save_is_one_line_and_keeps_earlier_checkpoints(mode, tmp_path):
    """A real full disk: the run's dump folder on a 5 MiB tmpfs (a private mount namespace), where
    the step-5 and step-10 checkpoints (2.3 MB each) fit and step-15 does not."""
    if not _can_mount_tmpfs(tmp_path):
        pytest.skip("cannot mount a small tmpfs here (unshare -rm + mount not permitted)")
    disk = tmp_path / "disk"
    disk.mkdir()
    dump, copy = disk / "run", tmp_path / "copy"
    argv = " ".join(TINY + ["--job.dump_folder", str(dump), "--checkpoint.async_mode", mode])
    script = textwrap.dedent(f"""
        mount -t tmpfs -o size=5m none {disk} || exit 90
        {sys.executable} -m titanlite.train {argv} > {tmp_path}/out.txt 2> {tmp_path}/err.txt
        code=$?
        cp -r {dump} {copy}
        exit $code
    """)
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    stderr = (tmp_path / "err.txt").read_text()
    err = [line for line in stderr.splitlines() if line.startswith("error: ")]  # DCP may warn on stderr too
    assert "Traceback" not in stderr
    assert proc.returncode == 2, (tmp_path / "out.txt").read_text()[-3000:] + "\n".join(err)
    if mode == "disabled":  # the save fails in the loop
        assert len(err) == 1 and err[0].startswith("error: disk full: checkpoint step 15 could not be written"), err
        assert "the previous checkpoints are intact (step-5, step-10)" in err[0]
    else:  # the background write fails; the next metrics line may hit the full disk first: either is one line
        assert len(err) == 1 and "disk" in err[0] and "full" in err[0], err
        assert "the previous checkpoints are intact (step-5, step-10)" in err[0]
    assert steps_in(copy) == [5, 10]
    for step in (5, 10):
        assert layout.problem_with(copy / "checkpoint" / f"step-{step}", verify=True) is None
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]  # whole lines only
    assert len(steps) >= 15 and steps == list(range(1, len(steps) + 1))


class _RunsCode:
    """Unpickling this creates a marker file: what a crafted checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickled_state_in_a_checkpoint_is_never_unpickled(tmp_path, caplog):
    """A newer step folder whose train_state is a pickle that runs code: it is refused (falls back
    to the previous checkpoint with one line) and the code never runs."""
    dump = tmp_path / "run"
    run_trainer(dump, "--training.steps", "5")
    good, evil = dump / "checkpoint" / "step-5", dump / "checkpoint" / "step-10"
    marker = tmp_path / "code-ran"
    state = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in _tensor_entries(good).items()}
    dcp.load(state, checkpoint_id=str(good))
    state = {k: v for k, v in state.items() if not k.startswith("train_state.")}
    state["train_state"] = {"json": _RunsCode(marker)}  # DCP writes it with torch.save (a pickle)
    dcp.save(state, checkpoint_id=str(evil), no_dist=True)
    info = layout.read_info(good)
    layout.write_info(evil, {**info, "step": 10, "files": layout.file_checksums(evil)})
    with caplog.at_level(logging.INFO, logger="titanlite"):
        run_trainer(dump, "--training.steps", "12")
    assert not marker.exists()
    assert "step-10 could not be read" in caplog.text and "train_state.json" in caplog.text
    assert "RESUMED from" in caplog.text and "step 5," in caplog.text


def _tensor_entries(path: Path) -> dict:
    return {k: md for k, md in layout.read_metadata(path).state_dict_metadata.items() if hasattr(md, "size")}


def test_resume_unpickles_nothing_but_dcp_metadata(tmp_path, monkeypatch):
    """A full resume (model, optimizer, LR schedule, data position, RNG, guard, loop state) calls no
    plain unpickler: ``.metadata`` goes through safe_load's allowlisted unpickler, and the only
    torch.load calls are DCP's reads of tensor records, all ``weights_only=True``."""
    from titanlite.checkpoint import safe_load

    dump = tmp_path / "run"
    run_trainer(dump, "--training.steps", "5")
    calls: dict[str, list] = {"pickle.load": [], "pickle.loads": [], "torch.load": [], "metadata": []}
    real_torch_load, real_metadata_load = torch.load, safe_load._MetadataUnpickler.load

    def record(name, real=None):
        def wrapped(*args, **kwargs):
            calls[name].append(kwargs.get("weights_only"))
            if real is None:
                raise AssertionError(f"{name} called while resuming")
            return real(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(pickle, "load", record("pickle.load"))
    monkeypatch.setattr(pickle, "loads", record("pickle.loads"))
    monkeypatch.setattr(torch, "load", record("torch.load", real_torch_load))
    monkeypatch.setattr(safe_load._MetadataUnpickler, "load", record("metadata", real_metadata_load))
    trainer = run_trainer(dump, "--training.steps", "7")
    assert trainer.state.step == 7 and [r["step"] for r in metrics(dump)] == list(range(1, 8))
    assert not calls["pickle.load"] and not calls["pickle.loads"]
    assert calls["metadata"] and calls["torch.load"] and set(calls["torch.load"]) == {True}


def test_checksum_cost_is_recorded(tmp_path):
    """SaveStats.checksum_s is part of the write (measured, off the training thread when async)."""
    dump = tmp_path / "run"
    trainer = run_trainer(dump, "--training.steps", "5", "--checkpoint.async_mode", "async")
    (stats,) = trainer.checkpointer.stats
    assert 0 < stats.checksum_s <= stats.write_s
    files = layout.read_info(dump / "checkpoint" / "step-5")["files"]
    assert set(files) == {".metadata", "__0_0.distcp"}
    assert files["__0_0.distcp"]["bytes"] == (dump / "checkpoint" / "step-5" / "__0_0.distcp").stat().st_size
