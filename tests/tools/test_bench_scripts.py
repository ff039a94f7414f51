"""titanlite.bench.trace_summary and titanlite.bench.table (``titanlite bench trace-summary | table``): the numbers
they print, from known inputs."""

from __future__ import annotations

import importlib
import json

import pytest


def script(name: str):
    return importlib.import_module(f"titanlite.bench.{name}")


def kernel(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_trace_summary_counts_gpu_time_by_kind_with_overlap_once():
    summary = script("trace_summary")
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#5", "ts": 0.0, "dur": 10_000.0},
        kernel("sm90_xmma_gemm_e4m3e4m3_bf16_tn", 0.0, 4_000.0),  # float8 matmul
        kernel("nvjet_tst_128x256_64x4_bf16", 4_000.0, 2_000.0),  # other matmul
        kernel("triton_red_fused_abs_amax_0", 5_000.0, 2_000.0),  # overlaps the last 1 ms of the matmul
        kernel("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", 8_000.0, 1_000.0),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 9_500.0, "dur": 100.0},
    ]
    text = summary.summarize(events, top=3)
    assert "wall time 10.00 ms" in text
    assert "GPU busy (kernels, overlap counted once): 8.10 ms (81.0% of the wall time)" in text
    assert "| matmul, float8 | 4.00 | 44.0% |" in text  # of 9.1 ms of kernel time
    assert "| matmul, other | 2.00 | 22.0% |" in text
    assert "| fused by compile (triton) | 2.00 | 22.0% |" in text
    assert "| optimizer (multi-tensor) | 1.00 | 11.0% |" in text
    assert "| copies and fills | 0.10 | 1.1% |" in text
    assert text.count("| `") == 3  # the top 3 kernels


def test_trace_summary_sets_each_part_of_the_step_beside_its_floor(tmp_path, capsys):
    """Matmuls, attention, element-wise (compile's kernels, copies, the rest), optimizer, communication, and idle:
    the step's wall time no kernel covers; per step (2 profiled steps), against ``--floors``."""
    summary = script("trace_summary")
    events = [
        {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "ts": 10_000.0 * i, "dur": 10_000.0}
        for i in (5, 6)
    ]
    for start in (50_000.0, 60_000.0):  # each step: 8 ms of kernels, 2 ms idle
        events += [
            kernel("nvjet_tst_128x256_64x4_bf16", start, 4_000.0),
            kernel("flash_fwd_kernel", start + 4_000.0, 1_000.0),
            kernel("triton_per_fused_add_mul_rsqrt_0", start + 5_000.0, 1_000.0),
            kernel("elementwise_kernel<silu>", start + 6_000.0, 500.0),
            kernel("ncclDevKernel_AllReduce_Sum_f32", start + 6_500.0, 500.0),
            kernel("multi_tensor_apply_kernel<FusedAdamMathFunctor>", start + 7_000.0, 1_000.0),
        ]
    for name in ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80", "cudnn_generated_fort_native_sdpa_sm90_knob_7"):
        assert summary.kind_of(name) == "attention", name  # not a matmul, though cutlass and cuDNN build them
    floors = {"matmul": 0.002, "attention": 0.0005, "elementwise / norm": 0.0003, "optimizer": 0.0008}
    text = summary.summarize(events, floors={**floors, "communication": 0.0, "idle (host-bound)": 0.0})
    assert "| matmul | 4.00 | 40.0% | 2.00 | 2.00x |" in text
    assert "| attention | 1.00 | 10.0% | 0.50 | 2.00x |" in text
    assert "| elementwise / norm | 1.50 | 15.0% | 0.30 | 5.00x |" in text
    assert "| optimizer | 1.00 | 10.0% | 0.80 | 1.25x |" in text
    assert "| communication | 0.50 | 5.0% | 0.00 | (floor 0) |" in text
    assert "| idle (host-bound) | 2.00 | 20.0% | 0.00 | (floor 0) |" in text
    assert "| **step** | 10.00 | 100% | 3.60 | 2.78x |" in text
    trace, result = tmp_path / "t.json", tmp_path / "bench.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    result.write_text(json.dumps({"floors": {"step_s": floors}}))
    summary.main([str(trace), "--floors", str(result)])
    assert "| matmul | 4.00 | 40.0% | 2.00 | 2.00x |" in capsys.readouterr().out
    result.write_text(json.dumps({"mfu": 0.5}))
    with pytest.raises(SystemExit) as info:
        summary.main([str(trace), "--floors", str(result)])
    assert str(info.value).startswith(f"error: {result}: expected the JSON of `titanlite bench train` with floors")


def test_bench_table_rows_ratios_and_failures(tmp_path):
    table = script("table")
    base = {"params": 10, "local_batch_size": 4, "seq_len": 2048, "device": "NVIDIA H100 80GB HBM3"}
    rows = [
        {
            "row": "1B, batch 4, compiled, cuDNN attention first",
            "compile": True,
            "sdpa_kernel": "cudnn",
            "tokens_per_s_per_device": 33_000.0,
            **base,
        },
        {
            "row": "1B, batch 4, compiled",
            "compile": True,
            "tokens_per_s_per_device": 60_000.0,
            "mfu": 0.5,
            "peak_memory_gib": 30.0,
            "time_split_frac": {"forward_backward": 0.85, "optimizer": 0.1},
            "optimizer": {"floor_ratio": 1.2},
            **base,
        },
        {
            "row": "1B, batch 4, compiled, float8",
            "compile": True,
            "float8": True,
            "tokens_per_s_per_device": 66_000.0,
            "mfu": 0.3,
            "mfu_vs_bf16_peak": 0.6,
            "peak_memory_gib": 25.0,
            **base,
        },
        {
            "row": "transformers 1B, batch 4, compiled",
            "compile": True,
            "tokens_per_s_per_device": 48_000.0,
            "mfu": 0.4,
            "peak_memory_gib": 34.6,
            **base,
        },
        {"row": "1B, batch 4, eager", "error": "timed out"},
        {  # a profiled row and one with cuDNN attention first: no ratios, never a float8 row's baseline
            "row": "1B, batch 4, compiled, profiled",
            "compile": True,
            "profiled": True,
            "tokens_per_s_per_device": 30_000.0,
            **base,
        },
        {
            "row": "optimizer step alone, 1B",
            "params": 1.24e9,
            "floor_s": 0.0115,
            "clip_then_step_s": 0.0215,
            "merged_s": 0.0138,
            "step_only_s": 0.0125,
            "clip_then_step_floor_ratio": 1.87,
            "merged_floor_ratio": 1.2,
            "step_only_floor_ratio": 1.087,
            "device": "NVIDIA H100 80GB HBM3",
        },
    ]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = table.table([json.loads(x) for x in path.read_text().splitlines()])
    lines = text.splitlines()
    assert lines[0] == "Device: NVIDIA H100 80GB HBM3"
    assert "| 1B, batch 4, compiled | 60,000 | 50.0% | 30.0 GiB | 85% / 10% / 5% | 1.20x | 1.25x | - |" in lines
    assert "| 1B, batch 4, compiled, float8 | 66,000 | 60.0% | 25.0 GiB | - / - / - | - | 1.38x | 1.10x |" in lines
    assert "| transformers 1B, batch 4, compiled | 48,000 | 40.0% | 34.6 GiB | - / - / - | - | - | - |" in lines
    assert "| 1B, batch 4, eager | timed out | | | | | | |" in lines
    assert "| 1B, batch 4, compiled, profiled | 30,000 | - | - | - / - / - | - | - | - |" in lines
    assert "| 1B, batch 4, compiled, cuDNN attention first | 33,000 | - | - | - / - / - | - | 0.69x | - |" in lines
    assert (
        lines[-1]
        == "| optimizer step alone, 1B | 1,240 M | 11.5 ms | 21.5 ms (1.87x) | 13.8 ms (1.20x) | 12.5 ms (1.09x) |"
    )
    assert not any(line.startswith("| optimizer step alone") for line in lines[:-3])  # a table of its own


@pytest.mark.parametrize("name", ["trace_summary", "table"])
def test_unreadable_input_is_one_line_error(name, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        script(name).main([str(tmp_path / "missing.json")])
    assert str(e.value).startswith("error: cannot read")


OTHER_JSON = ["[1, 2]", '"s"', "null", '{"a": 1}']


@pytest.mark.parametrize(
    "line",
    [*OTHER_JSON, '{"row": "x"}', '{"row": "x", "tokens_per_s_per_device": "fast"}', '{"row": 3, "error": "e"}']
    + ['{"row": "opt", "merged_s": 0.1, "params": 1}'],  # an optimizer row without its other timings
)
def test_bench_table_names_a_line_that_is_no_row(line, tmp_path, capsys):
    """Other JSON ended in a traceback (AttributeError, KeyError, TypeError): one line naming the line instead."""
    path = tmp_path / "r.jsonl"
    good = {"row": "1B", "tokens_per_s_per_device": 1000.0}
    path.write_text(json.dumps(good) + "\n\n" + line + "\n")
    with pytest.raises(SystemExit) as e:
        script("table").main([str(path)])
    msg = str(e.value)
    assert msg.startswith(f"error: cannot read {path}: line 3 is no row of bench train, hf-baseline or optimizer")
    assert "\n" not in msg and not capsys.readouterr().out


@pytest.mark.parametrize("text", [*OTHER_JSON, '{"traceEvents": {"ph": "X"}}', '{"traceEvents": [1]}'])
def test_trace_summary_refuses_other_json(text, tmp_path, capsys):
    path = tmp_path / "trace.json"
    path.write_text(text)
    with pytest.raises(SystemExit) as e:
        script("trace_summary").main([str(path)])
    assert str(e.value) == (
        f"error: cannot read the trace {path}: not a Chrome trace (expected a JSON list of event objects or an "
        "object with traceEvents)"
    )
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0}]}))
    with pytest.raises(SystemExit, match="event 0 is a complete event"):
        script("trace_summary").main([str(path)])
    assert not capsys.readouterr().out


@pytest.mark.parametrize("flag, value", [("--checksum-gb", "nan"), ("--checksum-gb", "-1"), ("--checksum-files", "0")])
def test_bench_checkpoint_refuses_checksum_sizes_out_of_range(flag, value, capsys):
    """``--checksum-gb nan`` was true enough to start writing and failed in int(nan): refused as parsed."""
    with pytest.raises(SystemExit) as e:
        script("checkpoint").main([flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: titanlite bench checkpoint: argument {flag}: expected a") and repr(value) in err


def test_bench_eval_names_a_missing_checkpoint(tmp_path, capsys):
    missing = tmp_path / "nope"
    argv = ["--checkpoint", str(missing), "--skip-big", "--tasks", "arc_easy", "--device", "cpu"]
    with pytest.raises(SystemExit) as e:
        script("eval").main(argv)
    assert str(e.value) == f"error: --checkpoint {missing}: {missing}: no such folder"
    assert not capsys.readouterr().out
