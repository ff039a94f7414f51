#!/usr/bin/env python
"""Downstream-eval scoring throughput: items/s and tokens/s of ``titanlite.eval.evaluate``, batch 1 vs batch 16.

    python scripts/bench_eval.py [--data-dir D] [--checkpoint STEP_DIR] [--limit 200] [--batch-sizes 1,16] \\
        [--big-limit 24] [--big-task arc_easy] [--skip-big] [--json FILE]

Two models, each timed on every batch size after one untimed warm-up call:

- ``debug``: the Llama 3 debug model (``--checkpoint``'s weights when given, else random ones; the
  weights do not change the cost), on the first ``--limit`` items of every task;
- ``1B``: llama3 flavor "1B" (Llama 3.2 1B's shape, 1.24 B parameters, 128,256-token output layer)
  with random weights, fp32, on the first ``--big-limit`` items of ``--big-task``.

Both read text through the built-in byte-level tokenizer, so a request is as many tokens as its
text has bytes (a real BPE tokenizer makes them about 4x shorter). ``tokens/s`` counts the model's
real input tokens (each request's context + choice, less its last token), not the padding;
``padding`` is the fraction of computed positions that were padding. One JSON object per
measurement on stdout, then a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

try:
    import titanlite  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlite.checkpoint.load_model import load_model
from titanlite.eval import evaluate, get_task, task_names
from titanlite.eval.scoring import PAD_MULTIPLE, build_requests, canonical_batches
from titanlite.models.registry import get_model_spec, make_model_args
from titanlite.tokenizer import build_byte_tokenizer

REPO = Path(__file__).resolve().parents[1]


def random_model(flavor: str, **overrides) -> torch.nn.Module:
    """The llama3 ``flavor`` with random weights, fp32 on CPU, in eval mode."""
    spec = get_model_spec("llama3")
    torch.manual_seed(0)
    model = spec.model_cls(make_model_args("llama3", flavor, **overrides))
    model.init_weights()
    return model.eval()


def workload(tokenizer, task: str, data_dir: Path, limit: int, batch_size: int, max_len: int) -> dict:
    """Items, real input tokens and the padded positions the batches compute (as evaluate() pads them)."""
    items = get_task(task).items(data_dir)[:limit]
    requests = build_requests([items], tokenizer, max_len)
    real = sum(len(r.tokens) - 1 for r in requests)
    padded = 0
    for batch in canonical_batches(requests, batch_size):
        longest = max(len(requests[i].tokens) - 1 for i in batch)
        padded += len(batch) * min(-(-longest // PAD_MULTIPLE) * PAD_MULTIPLE, max_len)
    return dict(items=len(items), requests=len(requests), tokens=real, padding=1 - real / padded)


def measure(name: str, model, tokenizer, task: str, data_dir: Path, limit: int, batch_size: int) -> dict:
    max_len = model.args.max_seq_len
    work = workload(tokenizer, task, data_dir, limit, batch_size, max_len)
    evaluate(model, tokenizer, [task], data_dir, limit=min(limit, 2), batch_size=batch_size)  # warm-up
    start = time.perf_counter()
    evaluate(model, tokenizer, [task], data_dir, limit=limit, batch_size=batch_size)
    seconds = time.perf_counter() - start
    return dict(
        model=name,
        task=task,
        batch_size=batch_size,
        **work,
        seconds=round(seconds, 3),
        items_per_s=round(work["items"] / seconds, 2),
        tokens_per_s=round(work["tokens"] / seconds, 1),
    )


def table(rows: list[dict], batch_sizes: list[int]) -> str:
    """One line per (model, task): items/s and tokens/s for each batch size, side by side."""
    head = "| model | task | items | tokens | " + " | ".join(f"batch {b}: items/s, tokens/s" for b in batch_sizes)
    lines = [head + " |", "|---|---|---:|---:|" + "---:|" * len(batch_sizes)]
    keys = dict.fromkeys((r["model"], r["task"]) for r in rows)
    for model, task in keys:
        by_batch = {r["batch_size"]: r for r in rows if (r["model"], r["task"]) == (model, task)}
        first = next(iter(by_batch.values()))
        cells = [f"{by_batch[b]['items_per_s']:.3g}, {by_batch[b]['tokens_per_s']:,.0f}" for b in batch_sizes]
        lines.append(f"| {model} | {task} | {first['items']} | {first['tokens']:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_data = os.environ.get("TITANLITE_EVAL_DATA") or str(REPO.parent / "shared" / "data" / "eval")
    p.add_argument("--data-dir", default=default_data, help="the eval data folder (default: $TITANLITE_EVAL_DATA)")
    p.add_argument("--checkpoint", help="a debug-model step folder (default: random weights)")
    p.add_argument("--tasks", default=",".join(task_names()), help="tasks for the debug model")
    p.add_argument("--limit", type=int, default=200, help="items per task for the debug model")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--big-task", default="arc_easy")
    p.add_argument("--big-limit", type=int, default=24, help="items for the 1B model")
    p.add_argument("--skip-big", action="store_true", help="no 1B model")
    p.add_argument("--json", help="also write the measurements here")
    a = p.parse_args()
    batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
    data_dir = Path(a.data_dir)
    if a.checkpoint:
        loaded = load_model(a.checkpoint)
        debug, tokenizer = loaded.model, loaded.tokenizer
    else:
        debug, tokenizer = random_model("debugmodel"), build_byte_tokenizer()
    rows = []
    for task in a.tasks.split(","):
        for b in batch_sizes:
            rows.append(measure("debug", debug, tokenizer, task, data_dir, a.limit, b))
            print(json.dumps(rows[-1]), flush=True)
    if not a.skip_big:
        big = random_model("1B", max_seq_len=2048)
        for b in batch_sizes:
            rows.append(measure("1B", big, build_byte_tokenizer(), a.big_task, data_dir, a.big_limit, b))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{torch.get_num_threads()} threads, torch {torch.__version__}\n" + table(rows, batch_sizes))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
