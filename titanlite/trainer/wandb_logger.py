"""Weights & Biases as a second sink of the metrics log (``[metrics] enable_wandb``, an optional extra imported
only when enabled; docs/monitoring.md). Every value is logged against the training step as W&B's x-axis
(``define_metric``), never through ``wandb.log(step=)``, which drops a record whose step is not above the last:
a resumed or rolled-back run logs records again for steps it already passed. Imports nothing of titanlite but
``fsio``.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from titanlite.errors import MissingPackageError
from titanlite.utils.fsio import atomic_write

RUN_ID_FILE = "wandb_run_id"


def import_wandb() -> Any:
    """The ``wandb`` module; a one-line MissingPackageError naming the extra when it is not installed."""
    try:
        import wandb
    except ImportError:
        raise MissingPackageError(
            "metrics.enable_wandb = true needs the wandb package, an optional extra: pip install 'titanlite[wandb]'"
        ) from None
    return wandb


class WandbLogger:
    """One W&B run per dump folder: started (or continued) here, fed by :meth:`log`, closed by :meth:`close`.

    ``section``: ``[metrics]`` (``wandb_project``, ``wandb_run_name``, ``wandb_mode``); ``config``: the
    resolved job config, stored as the run's config."""

    def __init__(self, section: Any, dump_folder: str | os.PathLike, config: dict[str, Any] | None = None):
        self.wandb = import_wandb()
        folder = Path(dump_folder)
        id_file = folder / RUN_ID_FILE
        run_id = id_file.read_text(encoding="utf-8").strip() if id_file.is_file() else ""
        self.resumed = bool(run_id)
        if not run_id:
            run_id = secrets.token_hex(8)
            atomic_write(id_file, run_id + "\n", fsync=False, hidden_tmp=True)
        self.run = self.wandb.init(
            project=section.wandb_project,
            name=section.wandb_run_name or None,
            id=run_id,
            resume="allow",
            mode=section.wandb_mode,
            dir=str(folder),
            config=config,
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, record: dict[str, Any]) -> None:
        """The record's numbers as scalars and its lists of records as tables, at its ``step``."""
        data: dict[str, Any] = {"step": record["step"]}
        for key, value in record.items():
            if key == "step" or value is None or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                data[key] = value
            elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                columns = list(dict.fromkeys(k for row in value for k in row))
                rows = [[row.get(c) for c in columns] for row in value]
                data[key] = self.wandb.Table(columns=["step", *columns], data=[[record["step"], *r] for r in rows])
        if len(data) > 1:
            self.run.log(data)

    def close(self) -> None:
        self.run.finish()
