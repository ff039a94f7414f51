"""Checkpointing in one process: exact resume after SIGKILL (every async mode), atomic saves,
fallback from a damaged newest checkpoint, user errors, initial loads, retention, export.

The reference is one uninterrupted 20-step run saving every 5 steps (``baseline``). Runs that get
killed are separate processes (``python -c`` drivers) killed with SIGKILL at a chosen moment; the
run that resumes is this (other) process. "Identical" means bitwise: loss, learning rate and
tokens seen of every step, read back from ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import load as dcp_load

import titanlite.data.recipe as recipe
from tests.helpers.checkpoint_runs import STEPS, TINY, metrics, run_trainer, steps_in
from tests.helpers.dist import cache_token_stores
from tests.helpers.launch import run_python
from titanlite.checkpoint import layout
from titanlite.models import load_config
from titanlite.train import main
from titanlite.trainer import Trainer
from titanlite.trainer.metrics_log import rewind_metrics_log
from titanlite.utils.run_lock import LOCK_FILE as LOCK

REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_thread")


def assert_same_run(dump: Path, reference: list[dict]) -> None:
    got = metrics(dump)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(got, reference):
        assert (a["step"], a["loss"], a["lr"], a["tokens_seen"]) == (b["step"], b["loss"], b["lr"], b["tokens_seen"])


# Runs the trainer in a fresh process and SIGKILLs it right after optimizer step KILL_AT_STEP, or
# (KILL_IN_WRITE_OF=N) in the middle of writing the data file of the step-N save. To save time it
# reads the training tokens this process already tokenized, and skips the CPU peak-FLOPs probe.
DRIVER = textwrap.dedent("""
    import os, signal, sys
    import torch
    import torch.distributed.checkpoint.filesystem as fs
    import titanlite.trainer.metrics as metrics
    import titanlite.data.recipe as recipe
    import titanlite.train as train
    from titanlite.models import load_config
    from titanlite.trainer.hooks import Hook
    from titanlite.train import Trainer

    tokens = torch.load(os.environ["TOKENS_FILE"], weights_only=True)
    recipe.load_token_store = lambda dataset, path, split, tokenizer: tokens
    metrics.peak_flops = lambda *a, **k: None

    kill_at = int(os.environ.get("KILL_AT_STEP", "0"))
    kill_in = os.environ.get("KILL_IN_WRITE_OF")
    if kill_in:
        original, calls = fs._write_item, []
        def write_item(transforms, stream, data, write_item, storage_key, fmt):
            if f"step-{kill_in}.partial" in str(getattr(stream, "name", "")):
                calls.append(1)
                if len(calls) == 4:  # a few tensors are on disk, the rest and .metadata are not
                    stream.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
            return original(transforms, stream, data, write_item, storage_key, fmt)
        fs._write_item = write_item

    class Kill(Hook):
        def on_step_end(self, state, result):
            if state.step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    class Killed(Trainer):
        def build_hooks(self):
            return [Kill()] + super().build_hooks()

    Killed(load_config(sys.argv[1:])).train()
""")


def run_killed(dump: Path, env: dict, *extra: str) -> None:
    tokens_file = dump.parent / "train_tokens.pt"
    if not tokens_file.exists():
        cache_token_stores()
        cfg = load_config(TINY)
        from titanlite.models import get_model_spec

        tokenizer = get_model_spec(cfg.model.name).tokenizer_builder(cfg.model.tokenizer_path)
        torch.save(recipe.load_token_store("embedded", "", "train", tokenizer), tokens_file)
    cmd = [sys.executable, "-c", DRIVER, *TINY, "--job.dump_folder", str(dump), *extra]
    proc = run_python(
        cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENS_FILE": str(tokens_file), **env}, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    dump = tmp_path_factory.mktemp("baseline")
    run_trainer(dump)
    assert steps_in(dump) == [5, 10, 15, 20]
    return dump, metrics(dump)


def copy_run(baseline_dump: Path, dest: Path, keep_steps: list[int], keep_metrics_to: int) -> Path:
    (dest / "checkpoint").mkdir(parents=True)
    for s in keep_steps:
        shutil.copytree(baseline_dump / "checkpoint" / f"step-{s}", dest / "checkpoint" / f"step-{s}")
    lines = (baseline_dump / "metrics.jsonl").read_text().splitlines(keepends=True)
    (dest / "metrics.jsonl").write_text("".join(lines[:keep_metrics_to]))
    return dest


# ----------------------------------------------------------------------------- exact resume


@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem"])
def test_sigkill_then_resume_is_bitwise_identical(mode, baseline, tmp_path, caplog):
    """Killed after step 13 (mid-interval, an async write possibly in flight), a new process resumes
    from the newest complete checkpoint and reproduces the uninterrupted run exactly."""
    ref_dump, reference = baseline
    dump = tmp_path / "run"
    run_killed(dump, {"KILL_AT_STEP": "13"}, "--checkpoint.async_mode", mode)
    assert [r["step"] for r in metrics(dump)] == list(range(1, 13))  # step 13 was never logged
    complete = steps_in(dump)
    assert complete and complete[-1] in (5, 10)
    with caplog.at_level(logging.INFO, logger="titanlite"):
        trainer = run_trainer(dump, "--checkpoint.async_mode", mode)
    assert f"RESUMED from {dump / 'checkpoint' / f'step-{complete[-1]}'}: step {complete[-1]}" in caplog.text
    assert_same_run(dump, reference)
    assert steps_in(dump) == [5, 10, 15, 20] and not layout.list_partial_folders(dump / "checkpoint")
    stats = trainer.checkpointer.stats
    assert [s.step for s in stats] == [s for s in (5, 10, 15, 20) if s > complete[-1]]
    assert all(s.write_s is not None for s in stats)
    assert (
        json.loads((dump / "checkpoint" / "step-20" / "checkpoint.json").read_text())["tokens_seen"]
        == reference[-1]["tokens_seen"]
    )


def test_kill_during_write_leaves_nothing_resumable(baseline, tmp_path, caplog):
    """SIGKILL while the step-10 data file is half written: that save is ignored (and removed), the
    run resumes from step 5 and still matches the uninterrupted run."""
    ref_dump, reference = baseline
    dump = tmp_path / "run"
    run_killed(dump, {"KILL_IN_WRITE_OF": "10"})
    assert steps_in(dump) == [5]
    partial = layout.list_partial_folders(dump / "checkpoint")
    assert len(partial) == 1 and partial[0].name.startswith("step-10.partial-")
    assert not (partial[0] / layout.METADATA_FILE).exists()
    with caplog.at_level(logging.INFO, logger="titanlite"):
        run_trainer(dump)
    assert "removing incomplete save" in caplog.text and "RESUMED" in caplog.text and "step 5," in caplog.text
    assert_same_run(dump, reference)


def test_resume_restores_data_position_lr_and_step(baseline, tmp_path):
    ref_dump, reference = baseline
    dump = copy_run(ref_dump, tmp_path / "run", [10], keep_metrics_to=10)
    cache_token_stores()
    trainer = Trainer(load_config(TINY + ["--job.dump_folder", str(dump)]))
    assert trainer.checkpointer.load() == 10
    assert trainer.state.step == 10 and trainer.state.tokens_seen == reference[9]["tokens_seen"]
    assert trainer.lr_scheduler.last_epoch == 10
    assert trainer.optimizer.param_groups[0]["lr"] == reference[10]["lr"]  # the lr of step 11
    state = trainer.train_loader.state_dict()
    assert state["dataset_state"]["pos"] == 10 * 4  # 10 batches of 4 windows consumed
    adam = trainer.optimizer.state[trainer.model.tok_embeddings.weight]
    assert float(adam["step"]) == 10 and adam["exp_avg_sq"].abs().sum() > 0
    trainer.checkpointer.close()


# ----------------------------------------------------------------------------- damaged checkpoints


@pytest.mark.parametrize(
    "damage, message",
    [
        ("truncate", "__0_0.distcp has "),
        ("delete_data", "__0_0.distcp is missing"),
        ("delete_metadata", ".metadata is missing"),
        ("garble_metadata", ".metadata has 9 bytes"),
        ("overwrite_4k", "__0_0.distcp fails its checksum"),
    ],
)
def test_damaged_newest_falls_back_to_previous(damage, message, baseline, tmp_path, caplog):
    ref_dump, reference = baseline
    dump = copy_run(ref_dump, tmp_path / "run", [10, 15], keep_metrics_to=17)
    newest = dump / "checkpoint" / "step-15"
    data = newest / "__0_0.distcp"
    if damage == "truncate":
        os.truncate(data, data.stat().st_size // 2)
    elif damage == "delete_data":
        data.unlink()
    elif damage == "delete_metadata":
        (newest / ".metadata").unlink()
    elif damage == "overwrite_4k":  # sizes intact: only the checksum recorded at save can tell
        with open(data, "r+b") as f:
            f.seek(data.stat().st_size // 3)
            f.write(os.urandom(4096))
    else:
        (newest / ".metadata").write_bytes(b"\x80\x04garbage")
    with caplog.at_level(logging.INFO, logger="titanlite"):
        run_trainer(dump)
    lines = [r.getMessage() for r in caplog.records if "step-15 is damaged" in r.getMessage()]
    assert len(lines) == 1 and message in lines[0] and "\n" not in lines[0], caplog.text
    assert "falling back to the previous one" in lines[0]
    assert "RESUMED from" in caplog.text and "step 10," in caplog.text
    assert_same_run(dump, reference)


def test_unreadable_data_detected_only_at_load_falls_back(baseline, tmp_path, caplog):
    """Bytes flipped inside the data file (sizes intact) of a checkpoint whose recorded checksums match the
    damaged bytes (damaged before they were computed) fail the DCP read itself: fall back too."""
    ref_dump, reference = baseline
    dump = copy_run(ref_dump, tmp_path / "run", [10, 15], keep_metrics_to=15)
    data = dump / "checkpoint" / "step-15" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[: len(raw)] = bytes(len(raw))  # zeroed: every record is unreadable
    data.write_bytes(bytes(raw))
    info = layout.read_info(dump / "checkpoint" / "step-15")
    info["files"] = layout.file_checksums(dump / "checkpoint" / "step-15")
    layout.write_info(dump / "checkpoint" / "step-15", info)
    with caplog.at_level(logging.INFO, logger="titanlite"):
        run_trainer(dump)
    assert "step-15 could not be read" in caplog.text and "step 10," in caplog.text
    assert_same_run(dump, reference)


def test_only_checkpoint_damaged_is_an_error_not_a_fresh_start(baseline, tmp_path, capsys):
    ref_dump, _ = baseline
    dump = copy_run(ref_dump, tmp_path / "run", [10], keep_metrics_to=10)
    (dump / "checkpoint" / "step-10" / ".metadata").unlink()
    with pytest.raises(SystemExit) as e:
        main(TINY + ["--job.dump_folder", str(dump)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no usable checkpoint") and "step-10" in err[0]
    assert (dump / "checkpoint" / "step-10" / "__0_0.distcp").exists()  # nothing was deleted


# ----------------------------------------------------------------------------- load_step / initial load


def test_load_step_picks_that_checkpoint_and_missing_one_is_an_error(baseline, tmp_path, capsys):
    ref_dump, reference = baseline
    dump = copy_run(ref_dump, tmp_path / "run", [5, 10, 15], keep_metrics_to=15)
    with pytest.raises(SystemExit) as e:
        main(TINY + ["--job.dump_folder", str(dump), "--checkpoint.load_step", "7"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: checkpoint.load_step=7: no checkpoint step-7 in {dump / 'checkpoint'} "
        "(complete checkpoints: 5, 10, 15)"
    ]
    assert steps_in(dump) == [5, 10, 15]
    cache_token_stores()
    trainer = Trainer(load_config(TINY + ["--job.dump_folder", str(dump), "--checkpoint.load_step", "5"]))
    trainer.train()
    assert_same_run(dump, reference)


def test_model_config_mismatch_is_a_one_line_error(baseline, tmp_path, capsys):
    ref_dump, _ = baseline
    dump = copy_run(ref_dump, tmp_path / "run", [10], keep_metrics_to=10)
    with pytest.raises(SystemExit) as e:
        main(TINY + ["--job.dump_folder", str(dump), "--model.n_kv_heads", "4"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.n_kv_heads=4 is set in the config but the checkpoint" in err[0], err
    assert "has n_kv_heads=2" in err[0]


def test_initial_load_path_only_when_nothing_to_resume(baseline, tmp_path, caplog):
    ref_dump, _ = baseline
    source = ref_dump / "checkpoint" / "step-20"
    dump = tmp_path / "run"
    extra = [
        "--job.dump_folder",
        str(dump),
        "--checkpoint.initial_load_path",
        str(source),
        "--training.steps",
        "1",
        "--checkpoint.interval",
        "1",
        "--lr_scheduler.warmup_steps",
        "0",
    ]
    cache_token_stores()
    with caplog.at_level(logging.INFO, logger="titanlite"):
        trainer = Trainer(load_config(TINY + extra))
        trainer.checkpointer.load()
    assert "loaded model weights only from initial_load_path" in caplog.text

    expected = {k: torch.empty_like(v) for k, v in trainer.model.state_dict().items()}
    dcp_load({"model": expected}, checkpoint_id=str(source))
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert trainer.state.step == 0 and not trainer.optimizer.state  # model only: fresh optimizer, step 0
    trainer.train()
    assert steps_in(dump) == [1]
    # now there is a checkpoint to resume: initial_load_path is ignored, and the log says so
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="titanlite"):
        again = Trainer(load_config(TINY + extra + ["--training.steps", "2"]))
        again.checkpointer.load()
    assert "initial_load_path" in caplog.text and "is ignored" in caplog.text and again.state.step == 1
    again.checkpointer.close()


def test_initial_load_path_errors(tmp_path, capsys):
    missing = tmp_path / "nope"
    with pytest.raises(SystemExit) as e:
        main(TINY + ["--job.dump_folder", str(tmp_path / "a"), "--checkpoint.initial_load_path", str(missing)])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: checkpoint.initial_load_path={missing}: no such folder"
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        main(
            TINY + ["--job.dump_folder", str(tmp_path / "a"), "--checkpoint.initial_load_path", str(tmp_path / "empty")]
        )
    assert "is not a DCP checkpoint folder (no .metadata)" in capsys.readouterr().err


def test_forced_save_and_load_latest(baseline, tmp_path):
    """``save(force=True)`` (preemption) writes a full checkpoint off the interval, replacing an
    existing folder of that step atomically; ``load_latest`` (rollback) ignores ``load_step``."""
    ref_dump, reference = baseline
    dump = copy_run(ref_dump, tmp_path / "run", [5, 10], keep_metrics_to=12)
    cache_token_stores()
    t = Trainer(
        load_config(
            TINY
            + [
                "--job.dump_folder",
                str(dump),
                "--checkpoint.load_step",
                "5",
                "--checkpoint.interval",
                "100",
                "--checkpoint.async_mode",
                "async",
            ]
        )
    )
    assert t.checkpointer.load() == 5 and t.state.step == 5
    assert not t.checkpointer.save(5) and t.checkpointer.save(5, force=True)
    t.checkpointer.wait()
    assert steps_in(dump) == [5] and not list((dump / "checkpoint").glob("*.replaced-*"))
    aside = list((dump / "checkpoint").glob("abandoned-after-step-5-*/step-10"))  # the abandoned lineage
    assert len(aside) == 1 and layout.problem_with(aside[0], verify=True) is None
    info = layout.read_info(dump / "checkpoint" / "step-5")
    assert not info["model_only"] and info["tokens_seen"] == reference[4]["tokens_seen"]
    assert layout.problem_with(dump / "checkpoint" / "step-5", verify=True) is None
    t.state.step = 7
    assert t.checkpointer.save(7, force=True)
    assert t.checkpointer.load_latest() == 7 and t.state.step == 7  # the newest, whatever load_step says
    t.checkpointer.close()


# ----------------------------------------------------------------------------- retention and export


def test_keep_latest_k_and_model_only_last_save(tmp_path):
    dump = tmp_path / "run"
    t = run_trainer(
        dump,
        "--training.steps",
        "8",
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "1",
        "--checkpoint.last_save_model_only",
        "true",
        "--checkpoint.export_dtype",
        "bfloat16",
    )
    # k=1 keeps the newest (the step-8 export) and, always, the newest resumable checkpoint
    assert steps_in(dump) == [6, 8]
    info = layout.read_info(dump / "checkpoint" / "step-8")
    assert info["model_only"] and info["dtype"] == "bfloat16" and info["model"]["args"]["dim"] == 64
    md = layout.read_metadata(dump / "checkpoint" / "step-8").state_dict_metadata
    assert md and all(k.startswith("model.") for k in md)
    assert {m.properties.dtype for m in md.values()} == {torch.bfloat16}
    full = layout.read_metadata(dump / "checkpoint" / "step-6").state_dict_metadata
    assert any(k.startswith("optimizer.") for k in full)
    assert "dataloader.dp_rank_0.json" in full and "rng.rank_0.json" in full
    assert load_config(["--config", str(dump / "checkpoint" / "step-6" / "config.toml")]) == t.cfg
    assert t.checkpointer.stats[-1].model_only


def test_resume_skips_model_only_export(tmp_path, caplog):
    """Extending a finished run (raising steps) resumes the last full checkpoint, not the final
    model-only export, which is moved aside with the abandoned lineage instead of being overwritten."""
    dump = tmp_path / "run"
    run_trainer(
        dump, "--training.steps", "4", "--checkpoint.interval", "2", "--checkpoint.last_save_model_only", "true"
    )
    cache_token_stores()
    export = (dump / "checkpoint" / "step-4" / "__0_0.distcp").read_bytes()
    with caplog.at_level(logging.INFO, logger="titanlite"):
        t = Trainer(
            load_config(TINY + ["--job.dump_folder", str(dump), "--training.steps", "6", "--checkpoint.interval", "2"])
        )
        assert t.checkpointer.load() == 2
    assert "step-4 holds model weights only (export); not resumable" in caplog.text
    assert steps_in(dump) == [2, 4]  # untouched until the resume is committed (the trainer does it after iter)
    t.checkpointer.commit_resume()
    assert steps_in(dump) == [2]
    (moved,) = (dump / "checkpoint").glob("abandoned-after-step-2-*/step-4")
    assert (moved / "__0_0.distcp").read_bytes() == export
    t.checkpointer.close()


def test_rerun_of_a_finished_run_is_complete_and_touches_nothing(tmp_path, caplog):
    """Re-running the command of a finished run (even one whose last save is a model-only export)
    says so and exits 0 without retraining or writing anything."""
    dump = tmp_path / "run"
    argv = TINY + ["--job.dump_folder", str(dump), "--training.steps", "4", "--checkpoint.interval", "2"]
    main(argv + ["--checkpoint.last_save_model_only", "true"])

    def files():  # the lock file is rewritten by each start, by design
        return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in dump.rglob("*") if p.is_file() and p.name != LOCK}

    before = files()
    with caplog.at_level(logging.INFO, logger="titanlite"):
        main(argv + ["--checkpoint.last_save_model_only", "true"])  # returns: exit status 0
    assert files() == before
    assert "the run is complete" in caplog.text and "RESUMED" not in caplog.text


def test_load_step_and_keep_latest_k_never_purge_the_new_lineage(tmp_path):
    """A finished 12-step run restarted from step 4 with keep_latest_k = 2: the new run's checkpoints
    are kept (the abandoned 6..12 are moved aside, not counted), and a later plain restart resumes
    the new lineage, not the abandoned step 10."""
    dump = tmp_path / "run"
    base = TINY + ["--job.dump_folder", str(dump), "--checkpoint.interval", "2"]
    main(base + ["--training.steps", "12"])
    assert steps_in(dump) == [2, 4, 6, 8, 10, 12]
    abandoned = {p.name: p.read_bytes() for p in (dump / "checkpoint" / "step-10").iterdir()}
    cache_token_stores()
    cfg = load_config(
        base + ["--training.steps", "9", "--checkpoint.load_step", "4", "--checkpoint.keep_latest_k", "2"]
    )
    Trainer(cfg).train()
    assert steps_in(dump) == [8, 9]  # the new lineage's two newest
    (aside,) = (dump / "checkpoint").glob("abandoned-after-step-4-*")
    assert sorted(p.name for p in aside.iterdir()) == ["step-10", "step-12", "step-6", "step-8"]
    assert {p.name: p.read_bytes() for p in (aside / "step-10").iterdir()} == abandoned
    t = Trainer(load_config(base + ["--training.steps", "10"]))
    assert t.checkpointer.load() == 9
    t.checkpointer.close()


# ----------------------------------------------------------------------------- pieces


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_async_save_is_a_snapshot_taken_before_the_next_update(mode, tmp_path):
    """An asynchronous save holds the weights as they were when it started: the loop only has to
    wait for staging (wait_for_staging) before changing them, not for the write."""
    from titanlite.checkpoint import CheckpointManager
    from titanlite.config.sections import Checkpoint

    model = torch.nn.Linear(256, 256)
    section = Checkpoint(enable=True, async_mode=mode, interval=1, keep_latest_k=0)
    manager = CheckpointManager(section, tmp_path, {"model": model})
    for step in (1, 2):  # the second save reuses the pinned stager's buffers
        before = model.weight.detach().clone()
        assert manager.save(step)
        manager.wait_for_staging()
        with torch.no_grad():
            model.weight.add_(1.0)  # the optimizer step that follows
        manager.wait()
        saved = {"model.weight": torch.empty_like(before), "model.bias": torch.empty_like(model.bias)}
        dcp_load(saved, checkpoint_id=str(tmp_path / f"step-{step}"))
        assert torch.equal(saved["model.weight"], before) and not torch.equal(before, model.weight)
    manager.close()


def test_rewind_metrics_log(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 1.0} for s in range(1, 8)] + [{"step": 5, "val_loss": 2.0}]
    path.write_text(
        "".join(json.dumps(r) + "\n" for r in rows[:5])
        + json.dumps(rows[7])
        + "\n"
        + "".join(json.dumps(r) + "\n" for r in rows[5:7])
        + '{"step": 8, "lo'
    )
    with open(path, "a") as appender:  # a logger that already holds the file open keeps working
        assert rewind_metrics_log(path, 5) == 3
        appender.write(json.dumps({"step": 6, "loss": 0.5}) + "\n")
    got = [json.loads(l) for l in path.read_text().splitlines()]
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 5, 6] and got[-1]["loss"] == 0.5


def test_initial_load_path_takes_an_hf_folder(baseline, tmp_path, caplog):
    """A stage can start from a Hugging Face folder: the weights load through the family's adapter and
    equal the step folder they were exported from; the optimizer is fresh."""
    from titanlite.checkpoint.hf_export import dcp_to_hf

    ref_dump, _ = baseline
    source = ref_dump / "checkpoint" / "step-20"
    hf_dir = dcp_to_hf(source, tmp_path / "hf")
    extra = ["--training.steps", "1", "--lr_scheduler.warmup_steps", "0", "--checkpoint.initial_load_path"]
    cache_token_stores()
    with caplog.at_level(logging.INFO, logger="titanlite"):
        trainer = Trainer(load_config(TINY + ["--job.dump_folder", str(tmp_path / "run"), *extra, str(hf_dir)]))
        trainer.checkpointer.load()
    assert "loaded model weights only from initial_load_path" in caplog.text
    expected = {k: torch.empty_like(v) for k, v in trainer.model.state_dict().items()}
    dcp_load({"model": expected}, checkpoint_id=str(source))
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert trainer.state.step == 0 and not trainer.optimizer.state
    # a model of another shape is refused before anything is loaded: config.json's args are the seed's
    with pytest.raises(ValueError, match="model.dim=96 is set in the config but the checkpoint .*hf has dim=64"):
        Trainer(
            load_config(TINY + ["--job.dump_folder", str(tmp_path / "b"), "--model.dim", "96", *extra, str(hf_dir)])
        )
    with pytest.raises(ValueError, match="Hugging Face folder .weights only.: set checkpoint.initial_load_model_only"):
        args = ["--checkpoint.initial_load_model_only", "false", *extra, str(hf_dir)]
        Trainer(load_config(TINY + ["--job.dump_folder", str(tmp_path / "c"), *args]))
