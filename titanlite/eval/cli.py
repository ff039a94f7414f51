"""``python -m titanlite.eval --checkpoint DIR --tasks hellaswag,...`` and ``python -m titanlite.eval --watch
DUMP_FOLDER`` (:mod:`titanlite.eval.watch`); docs/evaluation.md, "Downstream evaluation".

Bad input (an unknown task, a missing data file, a checkpoint that cannot be loaded) is one ``error: ...`` line
and exit status 2. ``--output`` is checked before any scoring (writable, and not a run's own file) and written
atomically, so an existing file is only ever replaced by a complete one.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from titanlite.checkpoint import layout
from titanlite.checkpoint.load_model import load_model
from titanlite.data.shards import write_json_atomic
from titanlite.errors import UsageError, UserError, one_line
from titanlite.eval.scoring import evaluate
from titanlite.eval.tasks import get_task, task_names
from titanlite.eval.watch import watch
from titanlite.extensions import load_extensions
from titanlite.utils.argtypes import UsageErrorParser
from titanlite.utils.dtypes import DTYPES
from titanlite.utils.run_lock import LOCK_FILE

DATA_ENV = "TITANLITE_EVAL_DATA"
METRICS_FILE = "metrics.jsonl"
RUN_FILES = (METRICS_FILE, "summary.json", layout.CONFIG_FILE, layout.INFO_FILE, LOCK_FILE)  # a run's own files


def build_parser() -> argparse.ArgumentParser:
    p = UsageErrorParser(
        prog="python -m titanlite.eval",
        description="Score a checkpoint on downstream benchmarks by log-likelihood (see titanlite.eval).",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR", help="a titanlite checkpoint step folder or an HF model folder")
    source.add_argument(
        "--watch", metavar="DUMP_FOLDER", help="score a run's checkpoints as they land (settings: its [eval])"
    )
    p.add_argument("--tasks", help=f"comma-separated task names (known: {', '.join(task_names())})")
    p.add_argument("--limit", type=int, help="score only the first N items of each task")
    p.add_argument("--output", metavar="FILE.json", help="write the metrics and per-item results here")
    p.add_argument("--data-dir", help=f"the eval data folder (default: ${DATA_ENV})")
    p.add_argument("--batch-size", type=int, help="requests (context + one choice) per forward pass (default 16)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="the model's weight dtype (default float32)")
    p.add_argument("--tokenizer", metavar="PATH|bytes", help="override the checkpoint's tokenizer")
    p.add_argument("--extensions", default="", metavar="MODULES", help="comma-separated modules to import first")
    p.add_argument("--compile", action="store_true", help="compile the scoring forward pass (torch.compile)")
    p.add_argument("--max-seq-len", type=int, help="the longest input (default: the model's max_seq_len)")
    watch = p.add_argument_group("--watch only")
    watch.add_argument("--once", action="store_true", help="score the checkpoints there are now, then exit")
    watch.add_argument("--poll-seconds", type=float, default=30.0, help="wait between looks for new checkpoints")
    watch.add_argument("--threads", type=int, help="CPU threads (leave the training run its cores)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        a = build_parser().parse_args(argv)
        for key in ("checkpoint", "watch", "data_dir", "output", "tokenizer"):  # --output=~/x: the shell leaves ~
            if getattr(a, key):
                setattr(a, key, os.path.expanduser(getattr(a, key)))
        a.extensions = [m.strip() for m in a.extensions.split(",") if m.strip()]
        load_extensions(a.extensions)  # they may register tasks
        if a.watch:
            return run_watch(a)
        tasks, data_dir = check_args(a)
        results = evaluate_checkpoint(a.checkpoint, a, tasks, data_dir)
    except UserError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return e.exit_code
    for name in tasks:
        print(summary_line(name, results[name]))
    if a.output:
        write_json_atomic(a.output, results)
    return 0


def run_watch(a: argparse.Namespace) -> int:
    """``--watch``: the run's ``[eval]`` settings, each given option overriding its own (see :func:`watch`)."""
    if a.output or a.dtype:
        raise UsageError("--output and --dtype apply to --checkpoint only (the watcher logs to the run's metrics)")
    if a.poll_seconds <= 0 or (a.threads is not None and a.threads < 1):
        raise UsageError("--poll-seconds must be > 0 and --threads >= 1")
    check_numbers_and_device(a)  # before any checkpoint is read or a record written
    if a.threads:
        torch.set_num_threads(a.threads)
    logging.getLogger("titanlite").setLevel(logging.INFO)
    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()] if a.tasks else None
    watch(
        a.watch,
        tasks=tasks,
        data_dir=a.data_dir,
        limit=a.limit,
        batch_size=a.batch_size,
        device=a.device,
        compile=a.compile,
        max_seq_len=a.max_seq_len,
        tokenizer_path=a.tokenizer,
        extensions=a.extensions,
        poll_seconds=a.poll_seconds,
        once=a.once,
    )
    return 0


def check_args(a: argparse.Namespace) -> tuple[list[str], Path]:
    """The task names and the data folder; everything that can be wrong with them before a model is loaded."""
    tasks = [t.strip() for t in (a.tasks or "").split(",") if t.strip()]
    if not tasks:
        raise UsageError("--tasks: give at least one task name")
    chosen = [get_task(name) for name in tasks]
    a.batch_size = 16 if a.batch_size is None else a.batch_size
    check_numbers_and_device(a)
    data_dir = a.data_dir or os.environ.get(DATA_ENV)
    if not data_dir:
        raise UsageError(f"no eval data folder: pass --data-dir or set ${DATA_ENV}")
    if not Path(data_dir).is_dir():
        raise UsageError(f"--data-dir {data_dir}: no such folder")
    for task in chosen:
        for rel in task.files:
            task.path(data_dir, rel)
    if a.output:
        check_output(a.output)
    return tasks, Path(data_dir)


def check_output(output: str) -> None:
    """``--output``: a new file or an earlier eval output, never a run's own file (its metrics log, config, a file
    in a checkpoint folder), in a folder this process can write; checked before any scoring, so a bad path loses
    no work."""
    path = Path(output)
    if path.is_dir() or not path.resolve().parent.is_dir():
        raise UsageError(f"--output {output}: expected a file path in an existing folder")
    layout.refuse_inside_step_folder(output, f"--output {output}")
    run = _enclosing_run_folder(path)
    if run is not None and (path.name in RUN_FILES or (path.exists() and not _is_eval_output(path))):
        raise UsageError(
            f"--output {output}: a file of the run folder {run} that is not an eval output; writing there would "
            "replace it: choose a new file name"
        )
    try:
        with tempfile.NamedTemporaryFile(dir=path.resolve().parent, prefix=".eval-output-check-"):
            pass
    except OSError as e:
        raise UsageError(f"--output {output}: cannot write in {path.resolve().parent} ({e.strerror or e})") from None


def _enclosing_run_folder(path: Path) -> Path | None:
    """The run's dump folder or checkpoint folder ``path`` lies in (one holding the run lock or a metrics log)."""
    for folder in path.resolve().parents:
        if any((folder / name).is_file() for name in (LOCK_FILE, METRICS_FILE)):
            return folder
    return None


def _is_eval_output(path: Path) -> bool:
    """Whether ``path`` holds the JSON that ``--output`` writes (an object with ``step`` and ``checkpoint``)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"step", "checkpoint"} <= set(data)


def check_numbers_and_device(a: argparse.Namespace) -> None:
    """``--limit``, ``--batch-size`` (when given) and ``--device``, for ``--checkpoint`` and ``--watch`` alike."""
    if a.limit is not None and a.limit < 1:
        raise UsageError(f"--limit must be at least 1, got {a.limit}")
    if a.batch_size is not None and a.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {a.batch_size}")
    if a.max_seq_len is not None and a.max_seq_len < 1:
        raise UsageError(f"--max-seq-len must be at least 1, got {a.max_seq_len}")
    try:
        device = torch.device(a.device)
    except RuntimeError:
        raise UsageError(f"--device {a.device!r}: expected cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {a.device}: CUDA is not available")


def evaluate_checkpoint(path: str, a: argparse.Namespace, tasks: list[str], data_dir: Path) -> dict[str, Any]:
    """Load ``path`` and score it: the results dict of :func:`evaluate` plus ``step`` and ``checkpoint``.
    One call per checkpoint, so a watcher can call it for each new one (``a``: checked by :func:`check_args`)."""
    device, dtype = torch.device(a.device), DTYPES[a.dtype or "float32"]
    loaded = load_model(path, device=device, dtype=dtype, tokenizer_path=a.tokenizer, extensions=a.extensions)
    kw = dict(limit=a.limit, batch_size=a.batch_size, max_seq_len=a.max_seq_len, compile=a.compile)
    results = evaluate(loaded.model, loaded.tokenizer, tasks, data_dir, **kw)
    return {**results, "step": loaded.step, "checkpoint": str(loaded.path)}


def summary_line(name: str, result: dict) -> str:
    """``hellaswag: acc 0.2600 ± 0.0441 acc_norm 0.2800 ± 0.0451 (100 items)`` (every metric, with its
    standard error when it has one, then the counts)."""
    skip = ("items", "num_items", "num_truncated")
    parts = []
    for k, v in result.items():
        if k in skip or k.endswith("_stderr") or not isinstance(v, (int, float)):
            continue
        stderr = result.get(f"{k}_stderr")
        parts.append(f"{k} {v:.4f}" + (f" ± {stderr:.4f}" if isinstance(stderr, float) else ""))
    counts = f"{result['num_items']} items" + (
        f", {result['num_truncated']} truncated" if result["num_truncated"] else ""
    )
    return f"{name}: {' '.join(parts)} ({counts})"
