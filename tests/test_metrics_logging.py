"""What a run reports: update/parameter norm ratio, ETA, progress line, summary, metrics.jsonl + TensorBoard."""

import json
import logging
import math

import pytest
import torch
from tiny import TINY_MODEL
from torch import nn

import titanlite.metrics as metrics
from titanlite.metrics import RunProgress, UpdateRatio, format_duration, format_summary
from titanlite.models import load_config
from titanlite.train import Trainer

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
