"""Downstream-eval scoring throughput of ``titanlite.eval.evaluate``: tokens/s and MFU, eager and compiled,
side by side with (``--baseline REF``) another titanlite's scoring.

    titanlite bench eval [--data-dir D] [--checkpoint STEP_DIR] [--tasks hellaswag,...] [--limit 100]
        [--batch-sizes 1,16] [--modes eager,compiled] [--baseline 5c7a1f4] [--repeats 2]
        [--big-flavor 1B] [--big-task arc_easy] [--big-limit 24] [--skip-big]
        [--device cpu|cuda] [--dtype float32|bfloat16] [--json FILE] [--jsonl FILE]

Two models, each timed on every task and batch size after one untimed warm-up call per mode (which
compiles, for ``compiled``):

- ``debug``: the Llama 3 debug model (``--checkpoint``'s weights when given, else random ones; the
  weights do not change the cost), on the first ``--limit`` items of every task;
- ``big``: llama3 flavor ``--big-flavor`` (default "1B": Llama 3.2 1B's shape, 1.24 B parameters,
  128,256-token output layer) with random weights, on the first ``--big-limit`` items of ``--big-task``.

Modes: ``eager`` (``evaluate``'s default), ``compiled`` (``compile=True``) and ``baseline``
(``evaluate`` of the titanlite at git revision REF in a worker process, :mod:`bench_baseline`); they
alternate within each of ``--repeats`` rounds and the median is reported. Text goes through the
built-in byte-level tokenizer, so a request is as many tokens as its text has bytes (a BPE tokenizer
makes them about 4x shorter). ``tokens/s`` counts the requests' real input tokens (each request's
context + choice, less its last token: what a per-request scorer computes), whatever the scorer runs.

MFU counts the FLOPs this titanlite's scorer actually runs: each forward pass's real tokens (a shared
context once, padding not counted) at 2 FLOPs per matmul parameter plus the attention over the tokens
before each (PaLM's forward third), over the time, over the peak (CUDA: the datasheet rate of the
matmul dtype; CPU: this machine's matmul rate, measured again after each row's timings). The
baseline ran more FLOPs per request token (every choice recomputed its context), so its MFU is not
shown. One JSON object per measurement on
stdout (and ``--jsonl``), then a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from titanlite.bench.baseline import Baseline, imported_from, serve
from titanlite.checkpoint.load_model import load_model
from titanlite.dtypes import DTYPES
from titanlite.eval import evaluate, get_task, task_names
from titanlite.eval.scoring import build_requests
from titanlite.models.registry import get_model_spec, make_model_args
from titanlite.tokenizer import build_byte_tokenizer

REPO = Path(__file__).resolve().parents[2]  # the checkout
MODES = ("eager", "compiled")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Runner:
    """A model, its tokenizer and timed ``evaluate`` calls (the same code serves ``--baseline``)."""

    def __init__(self, which: str, a: argparse.Namespace):
        self.device, self.data_dir = torch.device(a.device), Path(a.data_dir)
        if which == "debug" and a.checkpoint:
            loaded = load_model(a.checkpoint, device=self.device, dtype=DTYPES[a.dtype])
            self.model, self.tokenizer = loaded.model, loaded.tokenizer
        else:
            flavor, extra = ("debugmodel", {}) if which == "debug" else (a.big_flavor, {"max_seq_len": 2048})
            torch.manual_seed(0)
            with torch.device(self.device):
                self.model = get_model_spec("llama3").model_cls(make_model_args("llama3", flavor, **extra))
                self.model.init_weights()
            self.model = self.model.to(DTYPES[a.dtype]).eval()
            self.tokenizer = build_byte_tokenizer()

    def handle(self, r: dict) -> dict:
        """``{"task", "limit", "batch_size", "mode"}`` -> ``{"seconds"}`` of one ``evaluate`` call."""
        kw = {"compile": True} if r["mode"] == "compiled" else {}
        synchronize(self.device)
        start = time.perf_counter()
        kw.update(limit=r["limit"], batch_size=r["batch_size"])
        evaluate(self.model, self.tokenizer, [r["task"]], self.data_dir, **kw)
        synchronize(self.device)
        return {"seconds": time.perf_counter() - start}


def workload(runner: Runner, task: str, limit: int) -> dict:
    """Items, request tokens (each request's input) and the tokens the scorer runs (a shared context once)."""
    from titanlite.eval.packing import group_requests  # this titanlite's (not the baseline worker's)

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


def measure(name: str, runner: Runner, baseline: Baseline | None, task: str, limit: int, batch: int, a) -> dict:
    modes = [*a.modes, *(["baseline"] if baseline else [])]
    work = workload(runner, task, limit)
    request = {"task": task, "limit": limit, "batch_size": batch}
    for mode in modes:  # warm-up (compiles, for compiled)
        call = baseline.call if mode == "baseline" else runner.handle
        call({**request, "limit": min(limit, 4), "mode": "eager" if mode == "baseline" else mode})
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(a.repeats):
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            call = baseline.call if mode == "baseline" else runner.handle
            seconds[mode].append(call({**request, "mode": "eager" if mode == "baseline" else mode})["seconds"])
    row = dict(model=name, task=task, batch_size=batch, **work, device=a.device, dtype=a.dtype, repeats=a.repeats)
    flops = work["run_tokens"] * forward_flops_per_token(runner.model, work["mean_len"])
    if runner.device.type == "cpu":  # a shared CPU's rate drifts: measured again right after the timings
        from titanlite.trainer.peaks import measure_cpu_matmul_peak

        a.peak = measure_cpu_matmul_peak.__wrapped__(a.dtype, threads=torch.get_num_threads())
    row["peak_tflops"] = None if a.peak is None else round(a.peak / 1e12, 4)
    for mode in modes:
        s = statistics.median(seconds[mode])
        row[f"{mode}_s"] = round(s, 3)
        row[f"{mode}_tok_s"] = round(work["tokens"] / s, 1)
        if mode != "baseline" and a.peak:
            row[f"{mode}_mfu"] = round(flops / s / a.peak, 4)
    if baseline is not None:
        row["baseline"] = a.baseline
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="titanlite bench eval", description=__doc__.split("\n\n")[0])
    default_data = os.environ.get("TITANLITE_EVAL_DATA") or str(REPO.parent / "shared" / "data" / "eval")
    p.add_argument("--data-dir", default=default_data, help="the eval data folder (default: $TITANLITE_EVAL_DATA)")
    p.add_argument("--checkpoint", help="a debug-model step folder (default: random weights)")
    p.add_argument("--tasks", default=",".join(task_names()), help="tasks for the debug model")
    p.add_argument("--limit", type=int, default=100, help="items per task for the debug model")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--baseline", metavar="REF", help="also time evaluate() of titanlite at this git revision")
    p.add_argument("--repeats", type=int, default=2, help="timed rounds per mode (median reported)")
    p.add_argument("--big-flavor", default="1B")
    p.add_argument("--big-task", default="arc_easy")
    p.add_argument("--big-limit", type=int, default=24, help="items for the big model")
    p.add_argument("--skip-big", action="store_true", help="no big model")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--json", help="also write the measurements here (a JSON list)")
    p.add_argument("--jsonl", help="append one JSON object per measurement to this file")
    p.add_argument("--serve", metavar="MODEL", help=argparse.SUPPRESS)  # the --baseline worker
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
        baseline = Baseline(a.baseline, "titanlite.bench.eval", ["--serve", name, *common]) if a.baseline else None
        for _, task, limit in (x for x in plan if x[0] == name):
            for b in batch_sizes:
                rows.append(measure(name if name == "debug" else a.big_flavor, runner, baseline, task, limit, b, a))
                print(json.dumps(rows[-1]), flush=True)
                if a.jsonl:
                    with open(a.jsonl, "a") as f:
                        f.write(json.dumps({"bench": "eval", **rows[-1]}) + "\n")
        if baseline is not None:
            baseline.close()
    peak = "no peak (MFU unknown)" if not a.peak else f"peak {a.peak / 1e12:.3g} TFLOP/s"
    setup = f"{a.device}, {a.dtype}, {torch.get_num_threads()} threads, torch {torch.__version__}, {peak}"
    modes = [*a.modes, *(["baseline"] if a.baseline else [])]
    print(f"\n{setup}, titanlite from {imported_from()}\n" + table(rows, modes))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
