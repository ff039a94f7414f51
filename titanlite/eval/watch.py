"""Evaluate a run's checkpoints as they land, beside the run: ``python -m titanlite.eval --watch DUMP_FOLDER``
(docs/evaluation.md, "Evaluating beside the run").

The run's ``config.toml`` gives the checkpoint folder, tasks and precision; each new step's scores are appended
to ``metrics.jsonl`` as the in-loop keys plus ``"eval_source": "watcher"``, one ``write`` of one whole line in
append mode (the kernel appends it after the run's lines). Those records are the watcher's memory: a restarted
watcher skips the steps they cover, and a run that rewinds its log gets those steps scored again. It imports only
its own ``extensions``, never those the watched file names (importing runs code).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from titanlite.checkpoint import layout
from titanlite.checkpoint.load_model import load_model
from titanlite.errors import ConfigError, NotFoundError, one_line
from titanlite.eval.records import eval_record, scores_line
from titanlite.extensions import load_extensions
from titanlite.trainer.metrics_log import strict_json_line
from titanlite.trainer.runtime import Runtime
from titanlite.utils.metrics_records import parse_record

logger = logging.getLogger("titanlite")

SOURCE = "watcher"


def read_run_config(dump_folder: Path, extensions: Sequence[str] = ()):
    """The run's ``config.toml`` as a :class:`~titanlite.config.JobConfig`. Its ``[job] extensions`` are never
    imported (a module file in the watched folder, or the folder the watcher runs in, would run): the family must
    be registered already, by core or by one of ``extensions`` (the watcher's own ``--extensions``)."""
    from titanlite.config import ConfigError, parse_config
    from titanlite.models import model_names
    from titanlite.models.registry import registered_schema

    path = dump_folder / "config.toml"
    if not path.is_file():
        raise ConfigError(f"{dump_folder} has no config.toml (a titanlite run writes it when it starts)")

    def schema(cfg):
        missing = [m for m in cfg.job.extensions if m not in extensions]
        if cfg.model.name not in model_names() and missing:
            raise ConfigError(
                f"{path}: model family {cfg.model.name!r} comes from the run's [job] extensions, which the watcher "
                f"never imports from its config (importing runs code): pass --extensions {','.join(missing)}"
            )
        return registered_schema(cfg)

    cfg = parse_config(["--config", str(path)], schema)
    if not cfg.checkpoint.enable:
        raise ConfigError(f"{path}: checkpoint.enable is false, so the run saves no checkpoints to evaluate")
    return cfg


def watched_steps(metrics_file: Path) -> set[int]:
    """Steps that already have a watcher record in ``metrics_file`` (a torn or non-UTF-8 line is ignored)."""
    steps = set()
    with contextlib.suppress(FileNotFoundError), open(metrics_file, "rb") as f:
        for line in f:
            record = parse_record(line)
            if record is not None and record.get("eval_source") == SOURCE:
                steps.add(record["step"])
    return steps


def append_record(metrics_file: Path, record: dict[str, Any]) -> None:
    """Append one line in one ``write`` to a file opened now (see the module docstring)."""
    line = strict_json_line(record)  # no bare NaN (an empty task's score): null plus a "nonfinite" flag
    with open(metrics_file, "ab", buffering=0) as f:
        if f.write(line) != len(line):
            raise OSError(f"{metrics_file}: short write of the record of step {record['step']}")


def watch(
    dump_folder: str | os.PathLike,
    *,
    tasks: Sequence[str] | None = None,
    data_dir: str | None = None,
    limit: int | None = None,
    batch_size: int | None = None,
    device: str = "cpu",
    tokenizer_path: str | None = None,
    extensions: Sequence[str] = (),
    compile: bool = False,
    max_seq_len: int | None = None,
    poll_seconds: float = 30.0,
    once: bool = False,
    evaluate_fn: Callable[..., dict[str, dict[str, Any]]] | None = None,
) -> list[int]:
    """Score the run's checkpoints as they appear; returns the steps scored. ``tasks``, ``data_dir``, ``limit``,
    ``batch_size``: the run's ``[eval]`` values unless given (``data_dir`` also from ``$TITANLITE_EVAL_DATA``);
    ``compile``, ``max_seq_len``: passed to ``evaluate_fn`` (:func:`titanlite.eval.evaluate` unless given)."""
    dump = Path(dump_folder)
    if not dump.is_dir():
        raise NotFoundError(f"{dump}: no such folder")
    layout.refuse_inside_step_folder(dump, f"--watch {dump} (the run's dump folder, where scores are logged)")
    load_extensions(extensions)  # the caller's own modules only (see read_run_config)
    cfg = read_run_config(dump, extensions)
    e = cfg.eval
    tasks = list(tasks or e.tasks)
    data_dir = data_dir or e.data_dir or os.environ.get("TITANLITE_EVAL_DATA", "")
    if not data_dir:
        raise ConfigError("no evaluation data folder: pass --data-dir, or set eval.data_dir in the run's config")
    limit = limit if limit is not None else (None if e.limit == -1 else e.limit)
    batch_size = batch_size or e.batch_size
    # bf16 runs: bf16 autocast on the saved weights (an FSDP run computes with bf16 weights instead: close, not equal)
    autocast = torch.bfloat16 if cfg.training.mixed_precision_param == "bfloat16" else None
    folder, final = dump / cfg.checkpoint.folder, cfg.training.steps
    metrics_file = dump / "metrics.jsonl"
    writer = None
    if cfg.metrics.enable_tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(dump / cfg.metrics.save_tb_folder), filename_suffix=".eval_watcher")
    if evaluate_fn is None:
        from titanlite.eval import evaluate as evaluate_fn
        from titanlite.eval import get_task

        for task in [get_task(name) for name in tasks]:  # unknown names, then bad data: errors now, not later
            task.items(data_dir)
    skipped, scored = set(), []
    logger.info(
        "watching %s: tasks %s, %d step(s) already scored", folder, ",".join(tasks), len(watched_steps(metrics_file))
    )
    try:
        while True:
            done = watched_steps(metrics_file)  # read again each pass: a rewind of the run may drop records
            for f in layout.list_step_folders(folder):
                if f.step in done or f.step in skipped:
                    continue
                try:
                    loaded = load_model(f.path, device=device, tokenizer_path=tokenizer_path, extensions=extensions)
                except (ValueError, OSError) as err:
                    skipped.add(f.step)
                    if not f.path.exists():
                        logger.info("%s was removed while it was read (keep_latest_k); skipped", f.path)
                    else:
                        logger.warning("%s cannot be evaluated: %s", f.path, one_line(err))
                    continue
                results = evaluate_fn(
                    loaded.model,
                    loaded.tokenizer,
                    tasks,
                    data_dir,
                    limit=limit,
                    batch_size=batch_size,
                    compile=compile,
                    max_seq_len=max_seq_len or loaded.args.max_seq_len,
                    runtime=Runtime(torch.device(device), compute_dtype=autocast),
                )
                record = {**eval_record(f.step, results), "eval_source": SOURCE}
                append_record(metrics_file, record)
                if writer is not None:
                    for key, value in record.items():
                        if key.startswith("eval/"):
                            writer.add_scalar(key, value, f.step)
                    writer.flush()
                done.add(f.step)
                scored.append(f.step)
                logger.info("step %d | eval (watcher) | %s", f.step, scores_line(results))
            if once or final in done | skipped:
                return scored
            time.sleep(poll_seconds)
    finally:
        if writer is not None:
            writer.close()
