"""scripts/bench.py: runs a config after warm-up and prints one JSON line with the documented keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tiny import TINY_MODEL

REPO = Path(__file__).resolve().parents[1]


def test_bench_prints_json_with_throughput_mfu_memory_and_split(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "scripts/bench.py",
            "--warmup",
            "1",
            "--steps",
            "2",
            "--json-out",
            str(tmp_path / "b.json"),
            *TINY_MODEL,
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "4",
            "--job.dump_folder",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads([l for l in out.stdout.splitlines() if l.startswith("{")][-1])
    assert result == json.loads((tmp_path / "b.json").read_text())
    assert result["timed_steps"] == 2 and result["warmup_steps"] == 1 and result["tokens_per_step"] == 128
    assert result["tokens_per_s_per_device"] > 0 and 0 < result["mfu"] < 1
    assert result["peak_source"] == "measured matmul rate of this CPU" and result["peak_tflops"] > 0
    assert result["peak_memory_gib"] > 0
    split = result["time_split_s"]
    assert set(split) == {"data", "forward_backward", "optimizer", "checkpoint", "other"}
    assert abs(sum(split.values()) - result["step_time_s"]) < 1e-6 * max(1.0, result["step_time_s"]) + 1e-9
    assert split["forward_backward"] > split["data"]


def test_bench_bad_parallelism_is_one_line_error(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "scripts/bench.py",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--job.dump_folder",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 2 and out.stderr.startswith("error: parallelism") and "Traceback" not in out.stderr
