"""[profiling]: torch.profiler traces of chosen steps; memory snapshots need CUDA; nothing when off."""

import json
import logging

import pytest
import torch

from titanlite.config.sections import Profiling
from titanlite.models import load_config
from titanlite.trainer import Trainer
from titanlite.trainer.profiling import build_profiler

TINY = [
    "--model.dim",
    "64",
    "--model.n_layers",
    "1",
    "--model.n_heads",
    "4",
    "--model.n_kv_heads",
    "2",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--lr_scheduler.warmup_steps",
    "0",
]


def test_profiler_writes_a_trace_of_the_chosen_step(tmp_path, caplog):
    cfg = load_config(
        TINY
        + [
            "--training.steps",
            "3",
            "--job.dump_folder",
            str(tmp_path),
            "--profiling.enable_profiling",
            "true",
            "--profiling.profile_freq",
            "2",
            "--profiling.profiler_warmup",
            "0",
            "--profiling.profiler_active",
            "1",
            "--profiling.enable_memory_snapshot",
            "true",
        ]
    )
    with caplog.at_level(logging.INFO, logger="titanlite"):
        Trainer(cfg).train()
    traces = sorted((tmp_path / "profile_traces").rglob("*.pt.trace.json"))
    assert [p.relative_to(tmp_path).as_posix() for p in traces] == ["profile_traces/iteration_2/rank0.pt.trace.json"]
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert "aten::mm" in names or "aten::addmm" in names  # the step's matmuls are in it
    # CPU: no allocator history to snapshot, said clearly, nothing written
    assert "enable_memory_snapshot needs CUDA" in caplog.text
    assert not (tmp_path / "memory_snapshot").exists()


def test_off_means_nothing_and_bad_schedule_is_an_error(tmp_path):
    assert build_profiler(Profiling(), str(tmp_path), 0, torch.device("cpu")) is None
    with pytest.raises(ValueError, match="profiler_warmup .* must be <= profile_freq"):
        build_profiler(
            Profiling(enable_profiling=True, profile_freq=2, profiler_warmup=2), str(tmp_path), 0, torch.device("cpu")
        )
