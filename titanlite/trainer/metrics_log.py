"""The metrics log: ``metrics.jsonl`` (strict JSON), TensorBoard, W&B; its rewind on resume; disk-full errors."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from titanlite.errors import UserError
from titanlite.trainer.wandb_logger import WandbLogger, import_wandb
from titanlite.utils.fsio import atomic_write
from titanlite.utils.metrics_records import parse_record

logger = logging.getLogger(__name__)


class DiskFullError(UserError, OSError):
    """No space left (ENOSPC, or EDQUOT: over quota) while writing one of a run's files. One line naming the
    file; ``python -m titanlite.train`` prints it as ``error: ...`` and exits 2, like other user errors."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()  # the message alone: it already names the errno


def disk_full_error(error: OSError, path: str | os.PathLike, what: str) -> OSError:
    """``error`` as a :class:`DiskFullError` naming ``path`` when it means the disk (or quota) is full, else
    ``error`` itself."""
    if error.errno not in (errno.ENOSPC, errno.EDQUOT):
        return error
    reason = "the disk is full" if error.errno == errno.ENOSPC else "the disk quota is exceeded"
    return DiskFullError(
        error.errno, f"{reason} (errno {errno.errorcode[error.errno]}): could not write {path}; {what}"
    )


class MetricsLogger:
    """``[metrics]``: records to ``<dump_folder>/metrics.jsonl`` (one line each, on disk before :meth:`log`
    returns), TensorBoard and Weights & Biases (:mod:`titanlite.trainer.wandb_logger`), on rank 0 only. Opening the
    file never changes it: only :meth:`rewind`, called once a resume has loaded its checkpoint, drops the
    records after a step (the resumed run logs them again; W&B keeps what it got and gets them again). A
    write that fails midway (disk full) is cut back, so the file never ends in a torn line."""

    def __init__(
        self, section: Any, dump_folder: str | os.PathLike, rank: int = 0, run_config: dict[str, Any] | None = None
    ):
        self.enabled, self.writer, self.wandb, self.failed = rank == 0, None, None, False
        self.path = Path(dump_folder) / "metrics.jsonl"
        if getattr(section, "enable_wandb", False):
            import_wandb()  # on every rank: a missing extra stops all of them alike, before anything is written
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "ab", buffering=0)  # appends only; unbuffered: no half-written line held back
        if section.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(dump_folder) / section.save_tb_folder))
        if getattr(section, "enable_wandb", False):
            self.wandb = WandbLogger(section, dump_folder, run_config)  # rank 0 only

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._append(strict_json_line(record), record.get("step"))
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, record["step"])
                elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                    self.writer.add_text(key, as_markdown(value), record["step"])  # e.g. [sampling]'s prompts
        if self.wandb is not None:
            self.wandb.log(record)

    def _append(self, line: bytes, step: Any) -> None:
        """Write one whole line, or nothing: on an error midway the file is truncated back to its previous end
        (a disk-full error becomes a :class:`DiskFullError`)."""
        fd = self.file.fileno()
        end = os.fstat(fd).st_size
        view = memoryview(line)
        try:
            while view:  # a raw write may take only part of the line
                view = view[self.file.write(view) :]
        except OSError as e:
            self.failed = True
            with contextlib.suppress(OSError):  # e.g. not a regular file; the error below is what matters
                os.ftruncate(fd, end)
            raise disk_full_error(e, self.path, f"the record of step {step} was not written") from e

    def rewind(self, step: int) -> None:
        if self.enabled:
            rewind_metrics_log(self.path, step)
            self.file.close()  # the file may have been replaced (see rewind_metrics_log): append to the new one
            self.file = open(self.path, "ab", buffering=0)

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.writer is not None:
                self.writer.close()
            if self.wandb is not None:
                self.wandb.close()


def as_markdown(items: list[dict[str, Any]]) -> str:
    """TensorBoard text of a list of records: one paragraph each, a bold key before each value."""
    return "\n\n".join("  \n".join(f"**{k}**: {v}" for k, v in item.items()) for item in items)


def write_file_whole(path: Path, text: str | bytes) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it: ``path`` holds the old or the new
    text, never a part (disk full: a :class:`DiskFullError`, and the old file is left as it was)."""
    try:
        atomic_write(path, text, fsync=False, hidden_tmp=True)
    except OSError as e:
        raise disk_full_error(e, path, "it was left as it was") from e


def finite_json(record: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``record`` for strict JSON (RFC 8259: no bare ``NaN``/``Infinity``, which most readers other than
    Python's refuse): a non-finite number, at any depth, becomes ``None`` and is named in a ``"nonfinite"`` map
    (``{"loss": "nan", "grad_norm": "inf"}``; nested ones as ``key.sub`` / ``key[i]``)."""
    flags: dict[str, str] = {}

    def clean(value: Any, where: str) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            flags[where] = "nan" if value != value else "inf" if value > 0 else "-inf"
            return None
        if isinstance(value, dict):
            return {k: clean(v, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return value

    out = clean(record, "")
    if flags:
        out["nonfinite"] = {**(out.get("nonfinite") or {}), **flags}
    return out


def strict_json_line(record: dict[str, Any]) -> bytes:
    """``record`` as one line of strict JSON (:func:`finite_json`), newline included."""
    return (json.dumps(finite_json(record), allow_nan=False) + "\n").encode("utf-8")


def rewind_metrics_log(path: str | os.PathLike, step: int) -> int:
    """Keep every record of ``metrics.jsonl`` whose step is <= ``step``, in order, and drop the records after
    ``step``; returns how many lines were removed. A line that is no record (unparsable, torn by a crash, without
    an integer step) goes to ``<path>.quarantine`` as it was, with a warning naming its line numbers. When the kept
    records are the file's first lines the file is truncated in place (an append-mode holder keeps appending);
    otherwise it is rewritten through a temporary file renamed over it, and a holder must reopen it
    (:meth:`MetricsLogger.rewind` does)."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, bad, dropped, prefix, prefix_end = [], [], 0, True, 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            record = parse_record(line) if line.endswith(b"\n") else None
            if record is None:
                bad.append((number, line))
                prefix = False
            elif record["step"] <= step:
                kept.append(line)
                prefix_end += len(line) if prefix else 0
            else:
                dropped += 1
                prefix = False
    if not bad and not dropped:
        return 0
    if bad:
        quarantine = path.with_name(path.name + ".quarantine")
        with open(quarantine, "ab") as q:
            q.write(b"".join(line if line.endswith(b"\n") else line + b"\n" for _, line in bad))
            q.flush()
            os.fsync(q.fileno())
        numbers = ", ".join(str(n) for n, _ in bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
        logger.warning(
            "metrics log %s: %d line(s) are no JSON record with an integer step (line %s); skipped, moved as they "
            "were to %s; the valid records around them are kept",
            path,
            len(bad),
            numbers,
            quarantine,
        )
    if prefix_end == sum(len(line) for line in kept):  # the kept records are the first lines: cut in place
        os.truncate(path, prefix_end)
    else:
        write_file_whole(path, b"".join(kept))
    if dropped:
        logger.info("metrics log %s: removed %d record(s) after step %d (they are logged again)", path, dropped, step)
    return dropped + len(bad)
