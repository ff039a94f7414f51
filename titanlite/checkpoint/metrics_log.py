"""Rewinding ``metrics.jsonl`` when a run resumes from an earlier step.

A run killed at step 13 after its step-10 checkpoint has logged steps 11-13 that the resumed run
will log again. :func:`rewind_metrics_log` cuts the file after the last record of a step <= the
resumed step (and any torn last line), in place with ``truncate``, so a logger that already holds
the file open in append mode keeps appending at the new end.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def rewind_metrics_log(path: str | os.PathLike, step: int) -> int:
    """Drop the records after ``step``; returns how many lines were dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    keep = 0
    dropped = 0
    with open(path, "rb") as f:
        offset = 0
        for line in f:
            end = offset + len(line)
            record = None
            if line.endswith(b"\n"):
                try:
                    record = json.loads(line)
                except ValueError:
                    record = None
            rec_step = record.get("step") if isinstance(record, dict) else None
            if isinstance(rec_step, int) and rec_step <= step and dropped == 0:
                keep = end
            else:
                dropped += 1
            offset = end
    if dropped:
        os.truncate(path, keep)
        logger.info("metrics log %s: removed %d record(s) after step %d (they are logged again)", path, dropped, step)
    return dropped
