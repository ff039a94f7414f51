"""The records of a run's ``metrics.jsonl`` as every reader of the file sees them: the trainer rewinding it on
resume, the evaluation watcher finding the steps it scored, ``titanlite plot`` (a leaf: imports nothing from
titanlite, so the plot command starts without torch).

A record is a line holding a JSON object with an integer ``step``. Any other line (torn by a crash, not JSON,
not UTF-8, JSON that is no object such as ``[1, 2]``, ``"s"`` or ``null``, an object without an integer step)
holds none: readers skip it (the trainer also sets it aside, see ``rewind_metrics_log``).
"""

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
