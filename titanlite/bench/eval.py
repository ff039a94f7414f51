"""Downstream-eval scoring throughput of ``titanlite.eval.evaluate``: tokens/s and MFU, eager and compiled,
side by side.

Two models, each timed on every task and batch size after one untimed warm-up call per mode: ``debug`` (the Llama 3
debug model, ``--checkpoint``'s weights or random ones, on the first ``--limit`` items of every task) and ``big``
(llama3 ``--big-flavor``, random weights, the first ``--big-limit`` items of ``--big-task``). The modes, the tokens
counted and the MFU: docs/benchmarks.md, "Downstream evaluation scoring". One JSON object per measurement, then a
Markdown table.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
from pathlib import Path

import torch

from titanlite.bench.common import (
    REPO,
    add_device_args,
    append_jsonl,
    imported_from,
    interleaved,
    mode_caller,
    seconds,
    serve,
    write_json,
)
from titanlite.checkpoint.load_model import load_model
from titanlite.errors import one_line
from titanlite.eval import evaluate, get_task, task_names
from titanlite.eval.scoring import build_requests
from titanlite.models import build_model
from titanlite.tokenizer import build_byte_tokenizer
from titanlite.utils.dtypes import DTYPES

MODES = ("eager", "compiled")


class Runner:
    """A model, its tokenizer and timed ``evaluate`` calls (the same code serves a reference worker)."""

    def __init__(self, which: str, a: argparse.Namespace):
        self.device, self.data_dir = torch.device(a.device), Path(a.data_dir)
        if which == "debug" and a.checkpoint:
            try:
                loaded = load_model(a.checkpoint, device=self.device, dtype=DTYPES[a.dtype])
            except (ValueError, OSError) as e:  # load_model's one-line errors: a missing or wrong folder
                raise SystemExit(f"error: --checkpoint {a.checkpoint}: {one_line(e)}") from None
            self.model, self.tokenizer = loaded.model, loaded.tokenizer
        else:
            flavor, extra = ("debugmodel", {}) if which == "debug" else (a.big_flavor, {"max_seq_len": 2048})
            torch.manual_seed(0)
            self.model = build_model("llama3", flavor, device=self.device, **extra).to(DTYPES[a.dtype]).eval()
            self.tokenizer = build_byte_tokenizer()

    def handle(self, r: dict) -> dict:
        """``{"task", "limit", "batch_size", "mode"}`` -> ``{"seconds"}`` of one ``evaluate`` call."""
        kw = {"compile": True} if r["mode"] == "compiled" else {}
        kw.update(limit=r["limit"], batch_size=r["batch_size"])
        run = functools.partial(evaluate, self.model, self.tokenizer, [r["task"]], self.data_dir, **kw)
        return {"seconds": seconds(run, self.device)}


def workload(runner: Runner, task: str, limit: int) -> dict:
    """Items, request tokens (each request's input) and the tokens the scorer runs (a shared context once)."""
    from titanlite.eval.packing import group_requests  # this titanlite's (not the reference worker's)

    items = get_task(task).items(runner.data_dir)[:limit]
    requests = build_requests([items], runner.tokenizer, runner.model.args.max_seq_len)
    groups = group_requests(requests, share_context=True)  # as this titanlite's scorer runs them
    run = sum(len(g.context) + sum(len(c) - 1 for c in g.continuations) for g in groups)
    lengths = [len(r.tokens) - 1 for r in requests]
    mean = statistics.mean(lengths)
    return dict(items=len(items), requests=len(requests), tokens=sum(lengths), run_tokens=run, mean_len=mean)


def forward_flops_per_token(model: torch.nn.Module, seq_len: float) -> float:
    """PaLM's forward FLOPs per token: 2 per matmul parameter (the input embedding is a lookup) plus
    4 x layers x heads x head_dim x the mean number of keys a token attends to (half the length)."""
    a = model.args
    params = sum(p.numel() for p in model.parameters())
    if not a.tie_word_embeddings:
        params -= model.tok_embeddings.weight.numel()
    return 2 * params + 4 * a.n_layers * a.n_heads * a.head_dim * seq_len / 2


def measure(name: str, runner: Runner, worker, task: str, limit: int, batch: int, a) -> dict:
    """One row: ``runner``'s modes (and ``worker``'s, as ``baseline``) timed on ``task`` at batch size ``batch``."""
    modes, call = [*a.modes, *(["baseline"] if worker else [])], mode_caller(runner.handle, worker)
    work = workload(runner, task, limit)
    request = {"task": task, "limit": limit, "batch_size": batch}
    warmup = functools.partial(call, {**request, "limit": min(limit, 4)})  # compiles, for compiled
    runs = interleaved(modes, a.repeats, functools.partial(call, request), warmup)
    row = dict(model=name, task=task, batch_size=batch, **work, device=a.device, dtype=a.dtype, repeats=a.repeats)
    flops = work["run_tokens"] * forward_flops_per_token(runner.model, work["mean_len"])
    if runner.device.type == "cpu":  # a shared CPU's rate drifts: measured again right after the timings
        from titanlite.trainer.peaks import measure_cpu_matmul_peak

        a.peak = measure_cpu_matmul_peak.__wrapped__(a.dtype, threads=torch.get_num_threads())
    row["peak_tflops"] = None if a.peak is None else round(a.peak / 1e12, 4)
    for mode in modes:
        s = statistics.median(x["seconds"] for x in runs[mode])
        row[f"{mode}_s"] = round(s, 3)
        row[f"{mode}_tok_s"] = round(work["tokens"] / s, 1)
        if mode != "baseline" and a.peak:
            row[f"{mode}_mfu"] = round(flops / s / a.peak, 4)
    if worker is not None:
        row["baseline"] = worker.ref
    return row


def table(rows: list[dict], modes: list[str]) -> str:
    """One line per (model, task, batch size): tokens/s of each mode, their ratios to the baseline, MFU."""
    head = "| model | task | batch | items | tokens | " + " | ".join(f"{m} tokens/s" for m in modes)
    ratios = [m for m in modes if m != "baseline"] if "baseline" in modes else []
    mfus = [m for m in modes if f"{m}_mfu" in (rows[0] if rows else {})]
    head += "".join(f" | {m} / baseline" for m in ratios) + "".join(f" | {m} MFU" for m in mfus) + " |"
    lines = [head, "|---|---|---:|---:|---:|" + "---:|" * (len(modes) + len(ratios) + len(mfus))]
    for r in rows:
        cells = [f"{r[m + '_tok_s']:,.0f}" for m in modes]
        cells += [f"{r[m + '_tok_s'] / r['baseline_tok_s']:.2f}x" for m in ratios]
        cells += [f"{100 * r[m + '_mfu']:.1f}%" for m in mfus]
        lead = f"| {r['model']} | {r['task']} | {r['batch_size']} | {r['items']} | {r['tokens']:,} | "
        lines.append(lead + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None, reference=None) -> None:
    """``reference``: also time the ``baseline`` mode in its workers (see :mod:`titanlite.bench.common`)."""
    p = argparse.ArgumentParser(prog="titanlite bench eval", description=__doc__.split("\n\n")[0])
    default_data = os.environ.get("TITANLITE_EVAL_DATA") or str(REPO.parent / "shared" / "data" / "eval")
    p.add_argument("--data-dir", default=default_data, help="the eval data folder (default: $TITANLITE_EVAL_DATA)")
    p.add_argument("--checkpoint", help="a debug-model step folder (default: random weights)")
    p.add_argument("--tasks", default=",".join(task_names()), help="tasks for the debug model")
    p.add_argument("--limit", type=int, default=100, help="items per task for the debug model")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--repeats", type=int, default=2, help="timed rounds per mode (median reported)")
    p.add_argument("--big-flavor", default="1B")
    p.add_argument("--big-task", default="arc_easy")
    p.add_argument("--big-limit", type=int, default=24, help="items for the big model")
    p.add_argument("--skip-big", action="store_true", help="no big model")
    add_device_args(p)
    p.add_argument("--json", help="also write the measurements here (a JSON list)")
    p.add_argument("--jsonl", help="append one JSON object per measurement to this file")
    p.add_argument("--serve", metavar="MODEL", help=argparse.SUPPRESS)  # a reference worker
    a = p.parse_args(argv)
    if a.serve:
        serve(Runner(a.serve, a).handle)
        return
    a.modes = [m for m in a.modes.split(",") if m]
    if set(a.modes) - set(MODES) or a.repeats < 1:
        p.error(f"--modes: of {', '.join(MODES)}; --repeats >= 1")
    from titanlite.trainer.peaks import matmul_dtype, peak_flops

    device = torch.device(a.device)
    a.peak = peak_flops(device, matmul_dtype(a.dtype, device=device))
    batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
    common = [f"--data-dir={a.data_dir}", f"--device={a.device}", f"--dtype={a.dtype}", f"--big-flavor={a.big_flavor}"]
    common += [f"--checkpoint={a.checkpoint}"] if a.checkpoint else []
    plan = [("debug", task, a.limit) for task in a.tasks.split(",") if task]  # --tasks "": the big model only
    plan += [] if a.skip_big else [("big", a.big_task, a.big_limit)]
    rows = []
    for name in dict.fromkeys(n for n, _, _ in plan):
        runner = Runner(name, a)
        worker = reference.start("titanlite.bench.eval", ["--serve", name, *common]) if reference else None
        for _, task, limit in (x for x in plan if x[0] == name):
            for b in batch_sizes:
                rows.append(measure(name if name == "debug" else a.big_flavor, runner, worker, task, limit, b, a))
                print(json.dumps(rows[-1]), flush=True)
                append_jsonl(a.jsonl, {"bench": "eval", **rows[-1]})
        if worker is not None:
            worker.close()
    peak = "no peak (MFU unknown)" if not a.peak else f"peak {a.peak / 1e12:.3g} TFLOP/s"
    setup = f"{a.device}, {a.dtype}, {torch.get_num_threads()} threads, torch {torch.__version__}, {peak}"
    modes = [*a.modes, *(["baseline"] if reference else [])]
    print(f"\n{setup}, titanlite from {imported_from()}\n" + table(rows, modes))
    if a.json:
        write_json(a.json, rows)


if __name__ == "__main__":
    main()
