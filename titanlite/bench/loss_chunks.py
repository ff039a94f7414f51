"""The chunked output layer + loss side by side: peak memory and step time for several ``[training] loss_chunks``.

Each setting is one ``bench train`` run in its own process (peak RSS on CPU, peak allocated memory on CUDA),
alternating order between repeats (a shared machine's speed drifts); the table gives the median and the ratio to
``loss_chunks = 0``, with the whole run's CPU time beside the wall time (which on a shared CPU mostly measures the
others' load). Defaults: the debug model at Llama 3's vocabulary, checkpoints off.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
from pathlib import Path

from titanlite.bench.common import alternating, run_bench_train, write_json

DEFAULT_CONFIG = ["--config", "train_configs/debug_model.toml", "--model.vocab_size", "128256"]
QUIET = ["--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false"]


def run(chunks: int, args: argparse.Namespace, config: list[str], timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["--warmup", str(args.warmup), "--steps", str(args.steps), *config, *QUIET, "--job.dump_folder", tmp]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        argv += ["--training.loss_chunks", str(chunks)]
        result = run_bench_train(argv, Path(tmp) / "result.json", timeout, f"loss_chunks={chunks}: bench train")
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return {**result, "run_cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime}


def table(results: dict[int, list[dict]]) -> tuple[list[dict], str]:
    """Per setting the medians over repeats and the ratios to the first setting (``loss_chunks = 0`` first)."""
    rows, base = [], None
    for chunks, runs in results.items():
        row = {
            "loss_chunks": chunks,
            "peak_memory_gib": statistics.median(r["peak_memory_gib"] for r in runs),
            "step_time_s": statistics.median(r["step_time_s"] for r in runs),
            "run_cpu_s": statistics.median(r["run_cpu_s"] for r in runs),
            "loss_last": runs[-1]["loss_last"],
            "runs": len(runs),
        }
        base = base or row
        row["memory_vs_first"] = row["peak_memory_gib"] / base["peak_memory_gib"]
        row["step_time_vs_first"] = row["step_time_s"] / base["step_time_s"]
        row["run_cpu_vs_first"] = row["run_cpu_s"] / base["run_cpu_s"]
        rows.append(row)
    lines = [
        "| loss_chunks | peak memory (GiB) | vs first | step time (s) | vs first | CPU time per run (s) | vs first "
        "| last loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['loss_chunks']} | {r['peak_memory_gib']:.2f} | {r['memory_vs_first']:.2f} | "
            f"{r['step_time_s']:.2f} | {r['step_time_vs_first']:.2f} | {r['run_cpu_s']:.1f} | "
            f"{r['run_cpu_vs_first']:.2f} | {r['loss_last']:.4f} |"
        )
    return rows, "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="titanlite bench loss-chunks", description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", default="0,2,4,8,16", help="comma-separated loss_chunks settings, first = base")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each setting, alternating the order")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of each run")
    parser.add_argument("--steps", type=int, default=3, help="timed steps of each run")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per run")
    parser.add_argument("--json-out", default="", help="also write the rows (JSON) to this file")
    args, config = parser.parse_known_args(argv)
    settings = [int(c) for c in args.chunks.split(",")]
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0 or min(settings) < 0:
        parser.error("--repeats and --steps must be >= 1, --warmup and every chunk count >= 0")
    config = config or DEFAULT_CONFIG
    results: dict[int, list[dict]] = {c: [] for c in settings}
    for _, chunks in alternating(settings, args.repeats):
        results[chunks].append(r := run(chunks, args, config, args.timeout))
        print(
            f"loss_chunks={chunks}: {r['peak_memory_gib']:.2f} GiB, {r['step_time_s']:.2f} s/step, "
            f"run CPU {r['run_cpu_s']:.1f} s",
            flush=True,
        )
    rows, text = table(results)
    device = next(iter(results.values()))[0]["device"]
    print(f"\n{device}, {' '.join(config)}, median of {args.repeats}\n{text}")
    if args.json_out:
        write_json(args.json_out, rows, indent=None)
    return rows


if __name__ == "__main__":
    main()
