"""titanlite bench train (titanlite.bench.train): runs a config after warm-up and prints one JSON line with the
documented keys; the pipeline bubble measurement (titanlite.bench.bubble.StageActivity) against known compute
times; --compare-pp (PP 2 vs FSDP 2, titanlite.bench.compare)."""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import run_python
from tests.helpers.tiny import TINY_MODEL

REPO = Path(__file__).resolve().parents[2]


def test_bench_prints_json_with_throughput_mfu_memory_and_split(tmp_path):
    out = run_python(
        [
            sys.executable,
            "-m",
            "titanlite",
            "bench",
            "train",
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
    split = result["time_split_s"]  # the last step logs, so it measures the update ratio
    assert set(split) == {"data", "forward_backward", "optimizer", "checkpoint", "update_ratio", "other"}
    assert abs(sum(split.values()) - result["step_time_s"]) < 1e-6 * max(1.0, result["step_time_s"]) + 1e-9
    assert split["forward_backward"] > split["data"]
    cost = result["update_ratio_cost"]
    assert cost["log_steps"] == 1 and cost["s_per_log_step"] == pytest.approx(2 * split["update_ratio"])
    opt = result["optimizer"]  # the tiny model in fp32 with AdamW: 28 bytes per parameter
    assert opt["update_bytes"] == 28 * result["params"] and opt["copy_bandwidth_gb_s"] > 0
    assert opt["floor_s"] == pytest.approx(opt["update_bytes"] / opt["copy_bandwidth_gb_s"] / 1e9)
    assert opt["optimizer_s"] == split["optimizer"] and opt["floor_ratio"] == pytest.approx(
        split["optimizer"] / opt["floor_s"]
    )
    assert (opt["implementation"], opt["clip"]) == ("foreach", "one multi-tensor multiply")
    floors = result["floors"]  # fp32 on CPU, no float8 linears
    assert floors["gemm_dtype"] == "float32" and floors["gemm_tflops"] > 0 and floors["float8_gemm_tflops"] is None
    assert floors["tokens_per_device"] == 128 and floors["step_s"]["optimizer"] == pytest.approx(opt["floor_s"])
    gemm, per_step = floors["gemm_tflops"] * 1e12, floors["step_s"]
    # PaLM's FLOPs per token (MFU's) = the matmuls + twice the causal attention the floor counts + 6 per norm weight
    flops = (per_step["matmul"] + 2 * per_step["attention"]) * gemm / 128 + 6 * (2 * 2 * 64 + 64)
    assert flops == pytest.approx(result["flops_per_token"], rel=1e-9)
    assert per_step["elementwise / norm"] > 0 and per_step["communication"] == per_step["idle (host-bound)"] == 0


def test_bench_bad_parallelism_is_one_line_error(tmp_path):
    out = run_python(
        [
            sys.executable,
            "-m",
            "titanlite",
            "bench",
            "train",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--job.dump_folder",
            str(tmp_path),
        ],
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 2 and out.stderr.startswith("error: parallelism") and "Traceback" not in out.stderr


def _bench_module():
    """The benchmark's module, without an interpreter start."""
    return importlib.import_module("titanlite.bench.train")


def test_busy_seconds_is_the_clipped_union_of_intervals():
    from titanlite.bench import common as bench

    spans = [(1.0, 3.0), (0.0, 2.0), (5.0, 6.0), (2.5, 2.75)]  # overlaps counted once
    assert bench.busy_seconds(spans, 0.5, 5.5) == pytest.approx(1.5 + 1.0 + 0.5)
    assert bench.busy_seconds(spans, 3.0, 5.0) == 0.0
    assert bench.busy_seconds([], 0.0, 1.0) == 0.0


class _SleepyMatmul(torch.autograd.Function):
    """``x @ w`` that takes FORWARD_S to run forward and BACKWARD_S per backward run: known compute times."""

    @staticmethod
    def forward(ctx, x, w):
        time.sleep(FORWARD_S)
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, grad):
        time.sleep(BACKWARD_S)
        x, w = ctx.saved_tensors
        return grad @ w.T, x.T @ grad


FORWARD_S, BACKWARD_S, IDLE_S = 0.04, 0.08, 0.06


class _SleepyStage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return _SleepyMatmul.apply(x, self.w).relu()


def _measure(backward) -> tuple[object, float, float]:
    """Idle, forward, idle, ``backward(out, x, stage)``, idle; the recorder, the window and the idle time slept."""
    from titanlite.bench.bubble import StageActivity

    activity, stage = StageActivity(torch.device("cpu")), _SleepyStage()
    activity.attach(7, stage)
    x = torch.randn(2, 4, requires_grad=True)  # a received activation: the schedule's detached leaf
    start = time.perf_counter()
    time.sleep(IDLE_S)
    out = stage(x)
    time.sleep(IDLE_S)
    backward(out, x, stage)
    time.sleep(IDLE_S)
    return activity, start, time.perf_counter()


def _check_busy(activity, start, end, backward_runs: int) -> None:
    forward = activity.busy(start, end, 7, ("forward",))
    backward = activity.busy(start, end, 7, ("backward",))
    # sleeps last at least their time, a little more on a busy machine
    assert FORWARD_S <= forward < FORWARD_S + 0.05
    assert backward_runs * BACKWARD_S <= backward < backward_runs * BACKWARD_S + 0.05 * backward_runs
    # the idle sleeps are not compute: busy time leaves at least their sum out of the window
    idle = (end - start) - activity.busy(start, end)
    assert idle >= (2 + backward_runs) * IDLE_S
    assert activity.busy(start, end, 8) == 0.0  # another stage computed nothing


def test_stage_activity_measures_forward_and_backward_against_known_times():
    def full_backward(out, x, stage):
        out.sum().backward()

    activity, start, end = _measure(full_backward)
    _check_busy(activity, start, end, backward_runs=1)


def test_stage_activity_measures_a_split_backward_weight_pass():
    """Zero-bubble schedules run the input gradients, then (later) the weight gradients from inside the graph:
    both passes are compute. Through the functions torch's stages call for them (private torch API: this test
    breaks, rather than the bench silently under-counting, if they change)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    def split_backward(out, x, stage):
        _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], iter([stage.w]))
        time.sleep(IDLE_S)
        stage_backward_weight(iter([stage.w]), groups)
        assert stage.w.grad is not None and x.grad is not None

    activity, start, end = _measure(split_backward)
    _check_busy(activity, start, end, backward_runs=2)


def test_compare_pp_runs_both_layouts_and_reports_bubbles(tmp_path, capsys, monkeypatch):
    """PP 2 and FSDP 2 under torchrun (2 processes each) at the same global batch: both throughputs, their ratio,
    and per stage the measured bubble in [0, 1] next to the analytic prediction (p-1)/(m+p-1) of 1F1B. In this
    process (the torchrun runs are bounded by --compare-timeout); the runs' logs go to files."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # two CPU processes, whatever GPUs the machine has
    argv = ["--compare-pp", "--compare-timeout", "120", "--warmup", "1", "--steps", "2", *TINY_MODEL]
    argv += ["--training.seq_len", "32", "--training.local_batch_size", "4", "--training.global_batch_size", "8"]
    argv += ["--metrics.enable_tensorboard", "false", "--job.dump_folder", str(tmp_path)]
    result = _bench_module().main(argv + ["--json-out", str(tmp_path / "c.json")])
    out = capsys.readouterr()
    assert json.loads(out.out) == result == json.loads((tmp_path / "c.json").read_text())  # one line on stdout
    assert [line.split(" run")[0] for line in out.err.splitlines()] == ["fsdp2", "pp2"]  # one line per run
    assert (tmp_path / "compare_pp2_0.log").stat().st_size > 0 and (tmp_path / "compare_fsdp2_0.json").exists()
    pp, fsdp = result["runs"]["pp2"][0], result["runs"]["fsdp2"][0]
    assert pp["parallelism"] == {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "tp": 1}
    assert fsdp["parallelism"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 1}
    assert pp["global_batch_size"] == fsdp["global_batch_size"] == result["global_batch_size"] == 8
    assert pp["tokens_per_step"] == fsdp["tokens_per_step"] == 8 * 32
    assert result["tokens_per_s_global"] == {"pp2": pp["tokens_per_s_global"], "fsdp2": fsdp["tokens_per_s_global"]}
    assert result["ratio_pp2_over_fsdp2"] == pytest.approx(pp["tokens_per_s_global"] / fsdp["tokens_per_s_global"])
    assert "pipeline" not in fsdp
    # the same global batch, the same data and initial weights: both layouts train to the same loss
    assert pp["loss_first"] == pytest.approx(fsdp["loss_first"], rel=1e-5)
    assert pp["loss_last"] == pytest.approx(fsdp["loss_last"], rel=1e-4)
    pipe = result["pipeline"]
    assert pipe == pp["pipeline"] and pipe["schedule"] == "1F1B" and pipe["n_microbatches"] == 4
    assert pipe["bubble_predicted"] == pytest.approx((2 - 1) / (4 + 2 - 1))
    assert [s["stage"] for s in pipe["stages"]] == [0, 1] and [s["pp_rank"] for s in pipe["stages"]] == [0, 1]
    for s in pipe["stages"]:
        assert s["bubble_predicted"] == pipe["bubble_predicted"]
        assert 0 <= s["bubble_measured_in_schedule"] <= s["bubble_measured"] <= 1  # the schedule is part of the step
        assert s["forward_s_per_step"] > 0 and s["backward_s_per_step"] > 0
        busy = s["forward_s_per_step"] + s["backward_s_per_step"]  # one stage per rank: its whole compute
        # the bubble is a fraction of the rank's own timed window, which a loaded machine made 2x the step time
        assert busy <= (1 - s["bubble_measured"]) * s["wall_s_per_step"] * 1.05 + 1e-3


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--parallelism.pipeline_parallel_degree", "2"],
            "error: parallelism.pipeline_parallel_degree=2: --compare-pp",
        ),
        (["--training.global_batch_size", "4"], "error: training.global_batch_size=4 must be a multiple"),
    ],
)
def test_compare_pp_bad_config_is_one_line_error(tmp_path, capsys, args, message):
    """Refused before any run starts: exit status 2 and one line."""
    argv = ["--compare-pp", *TINY_MODEL, "--training.local_batch_size", "4", *args, "--job.dump_folder", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        _bench_module().main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith(message), err
    assert err.count("\n") == 1 and not list(tmp_path.iterdir())  # nothing ran


def test_context_parallel_bench_refuses_an_unknown_mask(capsys):
    """``--masks`` names causal and/or documents: any other name is one usage line and exit status 2, before any
    process starts (``both`` once ran as causal)."""
    from titanlite.bench import context_parallel

    with pytest.raises(SystemExit) as exit_info:
        context_parallel.main(["--masks", "causal,both"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.strip().splitlines()[-1].endswith(
        "--masks: unknown mask 'both' (expected causal and/or documents, comma-separated)"
    ), err


def test_rows_run_in_one_process_each_appended_and_a_failure_skips_only_its_row(tmp_path, capsys):
    """``titanlite bench rows``: three rows (the second's config is bad) give three lines, in order, the bad one with
    its one-line error; no trainer outlives its row; a row's losses are those of the same config benched again
    afterwards in the same process (nothing leaks from row to row)."""
    import gc

    from titanlite.trainer import Trainer

    rows = importlib.import_module("titanlite.bench.rows")
    common = ["--warmup", "1", "--steps", "2", "--no-bandwidth", *TINY_MODEL, "--training.seq_len", "32"]
    common += ["--metrics.enable_tensorboard", "false", "--job.dump_folder", str(tmp_path / "run")]
    jsonl = tmp_path / "train.jsonl"
    argv = ["--jsonl", str(jsonl), "--common", *common, "--row", "b4", "--training.local_batch_size", "4"]
    argv += ["--row", "bad", "--training.local_batch_size", "zero", "--row", "b2", "--training.local_batch_size", "2"]
    results = rows.main(argv)
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert lines == results and [r["row"] for r in lines] == ["b4", "bad", "b2"]
    assert lines[1] == {
        "row": "bad",
        "error": "error: invalid value 'zero' for 'training.local_batch_size' on the command line: expected an integer",
    }
    assert not [o for o in gc.get_objects() if isinstance(o, Trainer)]
    assert [r["local_batch_size"] for r in (lines[0], lines[2])] == [4, 2]
    err = capsys.readouterr().err
    assert "row 'bad': failed: error: invalid value 'zero'" in err and "row 'b2': done" in err
    again = _bench_module().main([*common, "--training.local_batch_size", "4"])
    assert (again["loss_first"], again["loss_last"]) == (lines[0]["loss_first"], lines[0]["loss_last"])


def test_floors_are_left_out_for_a_family_whose_args_are_not_a_llama_decoders():
    """A registered family with other model args (e.g. GPT-2's ``n_embd``) still benches, without floors."""
    from types import SimpleNamespace

    trainer = SimpleNamespace(model_args=SimpleNamespace(n_embd=8, n_layer=2, vocab_size=32))
    assert _bench_module().floors(trainer, None, "float32", 1e9, 1e6) is None


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "expected --jsonl PATH first"),
        (["--jsonl", "x.jsonl"], "expected at least one --row NAME ARGS..."),
        (["--jsonl", "x.jsonl", "--common", "--steps", "2"], "expected at least one --row NAME ARGS..."),
        (["--jsonl", "x.jsonl", "--steps", "2"], "expected --row NAME ARGS..., got '--steps 2'"),
    ],
)
def test_rows_bad_command_line_is_one_line(argv, message, capsys):
    rows = importlib.import_module("titanlite.bench.rows")
    with pytest.raises(SystemExit) as info:
        rows.main(argv)
    assert info.value.code == 2 and capsys.readouterr().err == f"error: titanlite bench rows: {message}\n"
    assert rows.split_rows(["--jsonl", "o", "--common", "-c", "--row", "a", "x", "--row", "b"]) == (
        "o",
        [("a", ["-c", "x"]), ("b", ["-c"])],
    )
