"""The 20-step tiny run the checkpoint and run-folder tests save every 5 steps, kill and resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.helpers.dist import cache_token_stores
from tests.helpers.tiny import TINY_MODEL
from titanlite.checkpoint import layout
from titanlite.models import load_config
from titanlite.trainer import Trainer

STEPS = 20
TINY = [
    *TINY_MODEL,
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "4",
    "--training.steps",
    str(STEPS),
    "--optimizer.lr",
    "3e-3",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "5",
    "--checkpoint.keep_latest_k",
    "0",
    "--checkpoint.last_save_model_only",
    "false",
]


def run_trainer(dump: Path, *extra: str) -> Trainer:
    cache_token_stores()
    trainer = Trainer(load_config(TINY + ["--job.dump_folder", str(dump), *extra]))
    trainer.train()
    return trainer


def metrics(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def steps_in(dump: Path) -> list[int]:
    return [f.step for f in layout.list_step_folders(dump / "checkpoint")]


def resume_copy(source: Path, dest: Path, step: int = 5) -> Path:
    """A new run folder ``dest`` holding ``source``'s step-``step`` checkpoint and its metrics up to that step."""
    (dest / "checkpoint").mkdir(parents=True)
    shutil.copytree(source / "checkpoint" / f"step-{step}", dest / "checkpoint" / f"step-{step}")
    lines = (source / "metrics.jsonl").read_text().splitlines(keepends=True)
    (dest / "metrics.jsonl").write_text("".join(lines[:step]))
    return dest
