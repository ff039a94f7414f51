"""metrics.jsonl as a log others read (issue 27, item 4 and "strict JSON"): a rewind keeps every valid record up to
the resumed step and quarantines the lines that are no record, and every line is strict JSON (RFC 8259: no bare
NaN or Infinity), read back here with a parser that refuses them."""

from __future__ import annotations

import json
import logging
import math

import pytest

from tests.helpers.tiny import TINY_MODEL
from titanlite.config import parse_config
from titanlite.eval.watch import append_record
from titanlite.trainer.metrics_log import MetricsLogger, rewind_metrics_log


def strict(line: str | bytes):
    """Python's json.loads refuses NaN / Infinity / -Infinity only when told to: this is the reader of other tools."""

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(line, parse_constant=refuse)


def rec(step, **kw) -> bytes:
    return (json.dumps({"step": step, **kw}) + "\n").encode()


def test_rewind_keeps_every_valid_record_around_an_unreadable_line(tmp_path, caplog):
    """One unreadable line in the middle used to make the rewind drop every valid record after it."""
    path = tmp_path / "metrics.jsonl"
    garbage, stepless = b'{"step": 3, "loss": 0.\xff\n', b'{"loss": 1.0}\n'
    lines = [rec(1), rec(2), garbage, rec(3), rec(4), stepless, rec(6), rec(2, eval_source="watcher"), rec(5)]
    path.write_bytes(b"".join(lines) + b'{"step": 7, "lo')  # and a last line torn by a crash
    with caplog.at_level(logging.INFO, logger="titanlite"):
        assert rewind_metrics_log(path, 5) == 4  # three lines quarantined, step 6 dropped
    assert path.read_bytes() == b"".join([rec(1), rec(2), rec(3), rec(4), rec(2, eval_source="watcher"), rec(5)])
    assert (tmp_path / "metrics.jsonl.quarantine").read_bytes() == garbage + stepless + b'{"step": 7, "lo\n'
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "3 line(s) are no JSON record with an integer step (line 3, 6, 10); skipped" in warning
    assert "metrics.jsonl.quarantine" in warning
    assert rewind_metrics_log(path, 5) == 0  # nothing left to do


def test_the_run_logger_appends_to_the_rewritten_log(tmp_path):
    """A rewind that is no plain cut rewrites the file: the run's logger, which holds it open, must follow."""
    section = parse_config([]).metrics
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(rec(1) + b"not json\n" + rec(2) + rec(3))
    log = MetricsLogger(section, tmp_path)
    log.rewind(2)
    log.log({"step": 3, "loss": 0.5})
    log.close()
    assert [strict(line) for line in path.read_text().splitlines()] == [
        {"step": 1},
        {"step": 2},
        {"step": 3, "loss": 0.5},
    ]


def test_non_finite_values_are_null_plus_a_flag(tmp_path):
    section = parse_config([]).metrics
    log = MetricsLogger(section, tmp_path)
    log.log({"step": 1, "loss": math.nan, "grad_norm": math.inf, "samples": [{"score": -math.inf}], "lr": 1e-3})
    log.close()
    append_record(tmp_path / "metrics.jsonl", {"step": 1, "eval/piqa/acc": math.nan, "eval_source": "watcher"})
    first, second = [strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert first == {
        "step": 1,
        "loss": None,
        "grad_norm": None,
        "samples": [{"score": None}],
        "lr": 1e-3,
        "nonfinite": {"loss": "nan", "grad_norm": "inf", "samples[0].score": "-inf"},
    }
    assert second == {"step": 1, "eval/piqa/acc": None, "eval_source": "watcher", "nonfinite": {"eval/piqa/acc": "nan"}}


@pytest.mark.usefixtures("one_thread")
def test_a_run_with_a_nan_step_writes_strict_json(tmp_path):
    from titanlite.models import load_config as load_model_config
    from titanlite.trainer import Trainer

    argv = [
        *TINY_MODEL,
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        "3",
        "--metrics.log_freq",
        "1",
    ]
    argv += ["--guard.policy", "skip_step", "--guard.debug_inject_nan_at_step", "2", "--job.dump_folder", str(tmp_path)]
    Trainer(load_model_config(argv)).train()
    records = [strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step2 = [r for r in records if r["step"] == 2 and "loss" in r]
    assert step2 and step2[0]["loss"] is None and step2[0]["nonfinite"]["loss"] == "nan"
    assert isinstance(strict((tmp_path / "summary.json").read_text()), dict)
