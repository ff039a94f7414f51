"""What a run reports: update/parameter norm ratio, ETA, progress line, summary, metrics.jsonl + TensorBoard."""

import errno
import json
import logging
import math
import os
import re

import pytest
import torch
from torch import nn

import titanlite.trainer.metrics as metrics
import titanlite.trainer.metrics_log as metrics_log
from tests.helpers.tiny import TINY_MODEL
from titanlite.checkpoint import layout
from titanlite.models import load_config
from titanlite.trainer import Trainer
from titanlite.trainer.metrics import RunProgress, UpdateRatio, format_duration, format_summary
from titanlite.utils import fsio

TINY = [
    *TINY_MODEL,
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "4",
    "--lr_scheduler.warmup_steps",
    "1",
]


def test_update_ratio_by_hand():
    """SGD: update = -lr * grad, so the ratio is lr * ||grad|| / ||weights before the step||."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4, bias=False), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    tracker = UpdateRatio(model, per_layer=True)
    tracker.before_step()
    opt.step()
    out = tracker.after_step()

    def norm(ts):
        return math.sqrt(sum(float(t.square().sum()) for t in ts))

    assert out["update_ratio"] == pytest.approx(0.1 * norm(grads) / norm(before), rel=1e-5)
    assert out["update_ratio/0"] == pytest.approx(0.1 * norm(grads[:1]) / norm(before[:1]), rel=1e-5)
    assert out["update_ratio/1"] == pytest.approx(0.1 * norm(grads[1:]) / norm(before[1:]), rel=1e-5)
    assert tracker.after_step() == {}  # nothing saved: nothing measured


def test_eta_and_summary(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    p = RunProgress(total_steps=10, start_step=0)
    clock[0] = 105.0  # step 1 includes start-up: not used for the ETA
    p.step_done(1)
    assert p.eta_seconds() is None
    p.record({"step": 1, "loss": 5.0, "tokens_per_s": 10.0, "mfu": 0.01, "tokens_seen": 100}, 5.0, 1)
    clock[0] = 107.0
    p.step_done(3)  # 2 steps in 2 s -> 1 s/step, 7 to go
    assert p.eta_seconds() == pytest.approx(7.0)
    p.record({"step": 3, "loss": 4.0, "tokens_per_s": 100.0, "mfu": 0.1, "tokens_seen": 300}, 2.0, 2)
    clock[0] = 110.0
    p.step_done(6)
    p.record({"step": 6, "loss": 3.0, "tokens_per_s": 200.0, "mfu": 0.2, "tokens_seen": 600}, 3.0, 3)
    p.validation(3.5)
    s = p.summary()
    # the first window is left out of the means; the others are weighted by their duration
    assert s["mean_tokens_per_s"] == pytest.approx((100 * 2 + 200 * 3) / 5)
    assert s["mean_mfu"] == pytest.approx((0.1 * 2 + 0.2 * 3) / 5)
    assert (s["steps"], s["tokens_seen"], s["last_loss"], s["last_val_loss"]) == (6, 600, 3.0, 3.5)
    assert s["wall_s"] == pytest.approx(10.0)
    line = format_summary(s)
    assert "6 steps" in line and "600 tokens" in line and "mean MFU 16.00%" in line and "3.5000" in line
    p.restart(4)  # after a rollback the ETA clock restarts
    assert p.eta_seconds() is None


def test_format_duration():
    assert format_duration(None) == "?"
    assert format_duration(9.54) == "9.5s"
    assert format_duration(252) == "4m12s"
    assert format_duration(3 * 3600 + 300) == "3h05m"
    assert format_duration(50 * 3600) == "2d02h"


def test_run_reports_everything(tmp_path, caplog):
    """A short run: progress lines with ETA, metrics.jsonl keys, TensorBoard events, summary.json."""
    cfg = load_config(
        TINY
        + [
            "--training.steps",
            "4",
            "--metrics.log_freq",
            "2",
            "--job.dump_folder",
            str(tmp_path),
            "--metrics.enable_tensorboard",
            "true",
            "--metrics.update_ratio_per_layer",
            "true",
            "--validation.enable",
            "true",
            "--validation.freq",
            "4",
            "--validation.steps",
            "1",
        ]
    )
    with caplog.at_level(logging.INFO, logger="titanlite"):
        records = Trainer(cfg).train()
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 4]
    r = steps[-1]
    for key in (
        "tokens_per_s",
        "tokens_per_s_global",
        "mfu",
        "mem_rss_gib",
        "mem_peak_rss_gib",
        "data_wait_frac",
        "eta_s",
        "guard_nonfinite",
        "guard_spikes",
        "guard_skipped_steps",
        "guard_rollbacks",
        "update_ratio",
        "update_ratio/layers.0",
        "update_ratio/layers.1",
        "update_ratio/output",
    ):
        assert key in r, key
    assert 0 <= r["data_wait_frac"] <= 1 and r["eta_s"] == 0.0
    assert 1e-6 < steps[0]["update_ratio"] < 1e-1
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == json.loads(json.dumps(records))  # same records in the file
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["tokens_seen"] == 4 * 4 * 32
    assert summary["last_loss"] == r["loss"] and summary["last_val_loss"] == records[-1]["val_loss"]
    text = caplog.text
    assert "step    2/4 (50%)" in text and "| eta " in text and "tok/s" in text and "mfu" in text
    assert "run summary: 4 steps" in text


LOGGED = TINY + ["--metrics.log_freq", "1", "--training.seed", "3"]


def _steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


def test_restart_before_first_checkpoint_logs_each_step_once(tmp_path):
    """Killed (SIGKILL) before any checkpoint, then the same command again (here in-process): the new run
    starts at step 0, so the log is rewound to step 0 and holds each step once, with the rerun's values (equal
    to the first run's: same seed)."""
    import sys
    import time

    from tests.helpers.launch import kill_python, start_python
    from titanlite.train import main

    args = [*LOGGED, "--training.steps", "8", "--job.dump_folder", str(tmp_path)]
    args += ["--checkpoint.enable", "true", "--checkpoint.interval", "1000"]
    metrics_file = tmp_path / "metrics.jsonl"
    first = start_python([sys.executable, "-m", "titanlite.train", *args], env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 120
        while not (metrics_file.exists() and len(_steps(metrics_file)) >= 3):
            assert first.exitcode is None and time.monotonic() < deadline, "the first run did not reach step 3"
            time.sleep(0.02)
    finally:
        kill_python(first)
    killed = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.endswith("}")]
    assert not list((tmp_path / "checkpoint").glob("step-*"))
    main(args)
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))  # each once, no torn line
    assert [r["loss"] for r in records[: len(killed)]] == [r["loss"] for r in killed]


def test_failed_resume_leaves_the_metrics_log_alone(tmp_path):
    """The log is rewound only once a resume has loaded its checkpoint: building a trainer (which opens the
    log) changes nothing, and a resume whose checkpoint cannot be read keeps every record."""
    cfg_args = LOGGED + ["--training.steps", "6", "--job.dump_folder", str(tmp_path)]
    cfg_args += ["--checkpoint.enable", "true", "--checkpoint.interval", "3"]
    Trainer(load_config(cfg_args)).train()  # steps 1..6 logged, step-3 resumable (step-6: model only)
    path = tmp_path / "metrics.jsonl"
    before = path.read_bytes()
    assert _steps(path) == [1, 2, 3, 4, 5, 6]
    step3 = tmp_path / "checkpoint" / "step-3"
    for data in step3.glob("*.distcp"):  # same size: passes the planning checks ...
        data.write_bytes(bytes(data.stat().st_size))
    info = layout.read_info(step3)
    info["files"] = layout.file_checksums(step3)  # ... with checksums of the damaged bytes: the read itself fails
    layout.write_info(step3, info)
    trainer = Trainer(load_config(cfg_args + ["--training.steps", "8"]))  # 6 steps are done: extend the run
    assert path.read_bytes() == before  # opening the log truncated nothing
    with pytest.raises(ValueError, match="could be loaded"):
        trainer.train()
    assert path.read_bytes() == before


class _FullDisk:
    """A raw file whose write takes the first ``room`` bytes, then raises ENOSPC (like a filling disk)."""

    def __init__(self, real, room: int, err: int):
        self.real, self.room, self.err = real, room, err

    def fileno(self) -> int:
        return self.real.fileno()

    def write(self, data) -> int:
        if self.room <= 0:
            raise OSError(self.err, os.strerror(self.err))
        n = self.real.write(bytes(data[: self.room]))
        self.room -= n
        return n

    def close(self) -> None:
        self.real.close()


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT])
def test_disk_full_during_a_write_leaves_no_torn_line(tmp_path, err):
    cfg = load_config(TINY + ["--job.dump_folder", str(tmp_path)])
    log = metrics.MetricsLogger(cfg.metrics, tmp_path)
    log.log({"step": 1, "loss": 2.5})
    before = log.path.read_bytes()
    log.file = _FullDisk(log.file, room=7, err=err)  # part of the next line fits
    with pytest.raises(metrics_log.DiskFullError) as full:
        log.log({"step": 2, "loss": 2.25})
    log.close()
    assert log.path.read_bytes() == before == b'{"step": 1, "loss": 2.5}\n'  # the partial line was cut off
    msg = str(full.value)
    assert "\n" not in msg and str(log.path) in msg and "the record of step 2 was not written" in msg
    assert msg.startswith("the disk is full (errno ENOSPC)" if err == errno.ENOSPC else "the disk quota is exceeded")
    assert full.value.errno == err and log.failed


def test_other_write_errors_are_cut_back_and_raised_as_they_are(tmp_path):
    cfg = load_config(TINY + ["--job.dump_folder", str(tmp_path)])
    log = metrics.MetricsLogger(cfg.metrics, tmp_path)
    log.file = _FullDisk(log.file, room=3, err=errno.EIO)
    with pytest.raises(OSError) as failed:
        log.log({"step": 1, "loss": 2.5})
    log.close()
    assert type(failed.value) is OSError and failed.value.errno == errno.EIO
    assert log.path.read_bytes() == b""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device that is always full)")
def test_disk_full_on_the_command_line_is_one_line_and_exit_2(tmp_path, capsys):
    """A real ENOSPC: metrics.jsonl is a link to /dev/full. One ``error:`` line naming the file, status 2."""
    from titanlite.train import main

    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    with pytest.raises(SystemExit) as stopped:
        main([*LOGGED, "--training.steps", "3", "--job.dump_folder", str(tmp_path)])
    err = capsys.readouterr().err
    assert stopped.value.code == 2, err
    assert err.splitlines() == [
        f"error: the disk is full (errno ENOSPC): could not write {tmp_path / 'metrics.jsonl'}; "
        "the record of step 1 was not written"
    ]
    assert not (tmp_path / "summary.json").exists()


def test_summary_write_on_a_full_disk_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    path.write_text('{"steps": 4}\n')
    real_open = open

    class HalfThenFull:  # the file the write goes to: part of the text lands, then the disk is full
        def __init__(self, *args, **kw):
            self.f = real_open(*args, **kw)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def writelines(self, chunks):
            self.f.write(b"".join(chunks)[:5])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fsio, "open", HalfThenFull, raising=False)  # titanlite.utils.fsio's writes go through open()
    with pytest.raises(metrics_log.DiskFullError, match=re.escape(f"could not write {path}; it was left as it was")):
        metrics_log.write_file_whole(path, '{"steps": 8}\n')
    monkeypatch.undo()
    assert path.read_text() == '{"steps": 4}\n' and [p.name for p in tmp_path.iterdir()] == ["summary.json"]
    metrics_log.write_file_whole(path, '{"steps": 8}\n')
    assert path.read_text() == '{"steps": 8}\n'


def test_an_implausible_cpu_mfu_remeasures_the_peak_then_says_so(tmp_path, monkeypatch, caplog):
    """MFU above 100% on CPU (a peak measured while the CPU was busy): the peak is measured again and the higher
    one used; still above 100%, one warning and MFU unknown from then on (111-163% were logged silently)."""
    from titanlite.config.sections import Metrics
    from titanlite.trainer.hooks import LoopState
    from titanlite.trainer.metrics import MetricsHook
    from titanlite.trainer.metrics_log import MetricsLogger
    from titanlite.trainer.step import StepResult

    def hook_with_peak(peak: float, reprobe: float) -> MetricsHook:
        log = MetricsLogger(Metrics(log_freq=1), tmp_path / str(peak), 0)
        hook = MetricsHook(Metrics(log_freq=1), log, device=torch.device("cpu"), flops_per_token=10**9)
        hook.peak_flops = peak  # what the start-up measurement found
        probes.clear()
        monkeypatch.setattr(metrics, "reprobe_cpu_matmul_peak", lambda dtype: probes.append(dtype) or reprobe)
        return hook

    def step(hook: MetricsHook, state: LoopState) -> dict:
        state.step += 1
        result = StepResult(state.step, torch.tensor(2.0), torch.tensor(1.0), 1000, 1e-3, 0.0)
        hook.on_step_end(state, result)
        return state.records[-1]

    probes: list = []
    hook, state = hook_with_peak(1e6, reprobe=1e30), LoopState(total_steps=3)
    hook.on_train_start(state)
    assert 0 < step(hook, state)["mfu"] < 1e-10 and probes == ["float32"] and hook.peak_flops == 1e30
    hook, state = hook_with_peak(1e6, reprobe=2e6), LoopState(total_steps=3)
    hook.on_train_start(state)
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        assert step(hook, state)["mfu"] is None and step(hook, state)["mfu"] is None
    assert probes == ["float32"] and caplog.text.count("is not plausible") == 1
    assert "measured matmul peak (0.0 GFLOP/s, 0.0 measured again)" in caplog.text
