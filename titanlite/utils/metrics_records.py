"""The records of a run's ``metrics.jsonl`` as every reader sees them (the trainer rewinding it, the evaluation
watcher, ``titanlite plot``; a leaf, so plotting starts without torch): a line holding a JSON object with an integer
``step``. Any other line (torn by a crash, not JSON or UTF-8, no object, no integer step) holds none."""

from __future__ import annotations

import json
import os
from typing import Any


def parse_record(line: bytes | str) -> dict[str, Any] | None:
    """The record ``line`` holds, or None when it holds none (see the module docstring)."""
    try:
        record = json.loads(line)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        return None
    if not isinstance(record, dict):
        return None
    step = record.get("step")
    return record if isinstance(step, int) and not isinstance(step, bool) else None


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of the file ``path``, in file order; lines holding none are skipped."""
    with open(path, "rb") as f:
        return [record for line in f if (record := parse_record(line)) is not None]
