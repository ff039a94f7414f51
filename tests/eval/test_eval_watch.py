"""The checkpoint watcher (``python -m titanlite.eval --watch``): each checkpoint scored once, into the run's
metrics.jsonl and TensorBoard under its step; restarts go on where they stopped; a checkpoint deleted while
it is read is skipped. The scoring itself is swapped for a probe of the loaded weights here (the real tasks
are checked against the in-loop scores in tests/eval/test_eval_loop.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.tiny import TINY_MODEL
from titanlite.checkpoint import safe_load
from titanlite.checkpoint.load_model import load_model
from titanlite.eval.watch import watch
from titanlite.models import load_config
from titanlite.trainer import Trainer

STEPS = 6


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished tiny run with checkpoints at steps 2, 4 and 6, and TensorBoard on."""
    dump = tmp_path_factory.mktemp("run")
    args = [*TINY_MODEL, "--training.seq_len", "64", "--training.steps", str(STEPS), "--job.dump_folder", str(dump)]
    args += ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]
    args += ["--metrics.enable_tensorboard", "--eval.data_dir", "/nonexistent/unused-by-the-probe"]
    Trainer(load_config(args)).train()
    return dump


def probe(model, tokenizer, tasks, data_dir, **kw):
    """A stand-in for titanlite.eval.evaluate: a number that identifies the weights it was given."""
    return {
        "probe": {
            "weights": float(model.norm.weight.detach().double().sum() + model.output.weight.detach().double().sum())
        }
    }


def expected(folder) -> float:
    return probe(load_model(folder).model, None, None, None)["probe"]["weights"]


def watcher_records(dump) -> list[dict]:
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("eval_source") == "watcher"]


def copy_run(run, tmp_path):
    dump = tmp_path / "run"
    shutil.copytree(run, dump)
    return dump


def test_each_checkpoint_is_scored_once_under_its_step(run, tmp_path):
    dump = copy_run(run, tmp_path)
    assert watch(dump, evaluate_fn=probe, poll_seconds=0.01) == [2, 4, 6]  # returns after the final step
    records = watcher_records(dump)
    assert [r["step"] for r in records] == [2, 4, 6]
    for r in records:
        assert r["eval/probe/weights"] == expected(dump / "checkpoint" / f"step-{r['step']}")
    assert len({r["eval/probe/weights"] for r in records}) == 3  # three different checkpoints were read
    before = (run / "metrics.jsonl").read_text()
    assert "loss" in before and (dump / "metrics.jsonl").read_text().startswith(before)  # appended, nothing lost

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(dump / "tb")).Reload()
    assert [(e.step, e.value) for e in tb.Scalars("eval/probe/weights")] == [
        (r["step"], pytest.approx(r["eval/probe/weights"])) for r in records
    ]


def test_a_restarted_watcher_goes_on_where_it_stopped(run, tmp_path):
    dump = copy_run(run, tmp_path)
    calls = []

    def stopped_at_step_4(model, *args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the watcher is killed while it scores step 4
        return probe(model, *args, **kw)

    with pytest.raises(KeyboardInterrupt):
        watch(dump, evaluate_fn=stopped_at_step_4, once=True)
    assert [r["step"] for r in watcher_records(dump)] == [2]
    assert watch(dump, evaluate_fn=probe, once=True) == [4, 6]
    assert watch(dump, evaluate_fn=probe, once=True) == []
    assert [r["step"] for r in watcher_records(dump)] == [2, 4, 6]  # no step twice


def test_records_a_rewind_of_the_run_drops_are_scored_again(run, tmp_path, monkeypatch):
    """The run resumes (or its guard rolls back) to step 2 while the watcher waits: rewinding the log drops every
    record past step 2, the watcher's record of step 4 with it (its step 2 record stays). The live watcher must
    score step 4 again, not only a restarted one."""
    from titanlite.eval import watch as watch_module
    from titanlite.trainer.metrics_log import rewind_metrics_log

    dump = copy_run(run, tmp_path)
    shutil.move(dump / "checkpoint" / "step-6", tmp_path / "step-6")  # the run stopped after saving step 4

    def the_run_resumes(seconds):
        if (tmp_path / "step-6").exists():
            rewind_metrics_log(dump / "metrics.jsonl", 2)
            shutil.move(tmp_path / "step-6", dump / "checkpoint" / "step-6")

    monkeypatch.setattr(watch_module.time, "sleep", the_run_resumes)
    assert watch(dump, evaluate_fn=probe, poll_seconds=0.01) == [2, 4, 4, 6]
    assert [r["step"] for r in watcher_records(dump)] == [2, 4, 6]


def test_a_checkpoint_deleted_while_it_is_read_is_skipped(run, tmp_path, monkeypatch, caplog):
    dump = copy_run(run, tmp_path)
    real = safe_load.load

    def deleted_midway(state, path, **kw):
        if Path(path).name == "step-4":  # keep_latest_k removes it after its metadata and checksums were read
            shutil.rmtree(path)
        return real(state, path, **kw)

    monkeypatch.setattr(safe_load, "load", deleted_midway)
    with caplog.at_level("INFO", logger="titanlite"):
        assert watch(dump, evaluate_fn=probe, poll_seconds=0.01) == [2, 6]
    assert "step-4 was removed while it was read" in caplog.text
    assert [r["step"] for r in watcher_records(dump)] == [2, 6]


def test_a_damaged_checkpoint_is_reported_and_skipped(run, tmp_path, caplog):
    dump = copy_run(run, tmp_path)
    data = next(p for p in (dump / "checkpoint" / "step-2").iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:100])  # truncated
    with caplog.at_level("INFO", logger="titanlite"):
        assert watch(dump, evaluate_fn=probe, once=True) == [4, 6]
    assert "step-2 cannot be evaluated" in caplog.text and "damaged" in caplog.text


def test_a_folder_that_is_no_run_is_a_clear_error(tmp_path, run):
    with pytest.raises(ValueError, match="has no config.toml"):
        watch(tmp_path, evaluate_fn=probe)
    dump = copy_run(run, tmp_path)
    cfg = (dump / "config.toml").read_text().split("[checkpoint]")
    (dump / "config.toml").write_text(cfg[0] + "[checkpoint]" + cfg[1].replace("enable = true", "enable = false", 1))
    with pytest.raises(ValueError, match="checkpoint.enable is false"):
        watch(dump, evaluate_fn=probe)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--watch", "DUMP", "--output", "x.json"], "--output and --dtype apply to --checkpoint only"),
        (["--watch", "DUMP", "--poll-seconds", "0"], "--poll-seconds must be > 0"),
        (["--watch", "DUMP", "--tasks", "piqa,mmlu", "--data-dir", "DUMP"], "mmlu"),
        (["--watch", "DUMP", "--checkpoint", "DUMP"], "not allowed with argument"),
        (["--watch", "NOWHERE"], "NOWHERE: no such folder"),
        (["--watch", "DUMP", "--limit", "0"], "--limit must be at least 1"),  # not NaN scores in the run's log
        (["--watch", "DUMP", "--batch-size", "0"], "--batch-size must be at least 1"),
        (["--watch", "DUMP", "--device", "bogus"], "--device 'bogus': expected cpu, cuda or cuda:N"),
    ],
)
def test_watcher_command_line_errors_are_one_line(run, tmp_path, capsys, argv, message):
    from titanlite.eval import cli

    dump = copy_run(run, tmp_path)
    argv = [str(dump) if a == "DUMP" else str(tmp_path / a) if a == "NOWHERE" else a for a in argv]
    before = (dump / "metrics.jsonl").read_bytes()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err
    assert (dump / "metrics.jsonl").read_bytes() == before
