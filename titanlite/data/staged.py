"""The training batches of a run with sequence-length stages (``[training] seq_len_schedule``).

:class:`StagedLoader` holds the current stage's loader (``build(stage_index)``); :meth:`set_stage` switches to a
fresh one that starts at that stage's beginning (windows of another length are other windows). Its state, saved per
data-parallel rank, is the stage index plus that loader's state, so a resume on either side of a switch is exact.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from titanlite.data.windows import CHANGE_OF_KIND
from titanlite.errors import DataError

logger = logging.getLogger(__name__)


class StagedLoader:
    per_rank_state = True  # checkpointed per data-parallel rank, like a StatefulDataLoader

    def __init__(self, build: Callable[[int], Any], stage: int = 0, num_stages: int | None = None):
        self.build, self.stage, self.num_stages = build, stage, num_stages
        self.loader = build(stage)
        self._it: Iterator | None = None

    def set_stage(self, stage: int) -> None:
        """Train on ``stage`` from now on (a no-op when it is the current one)."""
        if stage == self.stage:
            return
        self.stage, self.loader = stage, self.build(stage)
        self._it = iter(self.loader)

    def __iter__(self) -> Iterator[dict]:
        self._it = iter(self.loader)

        def batches() -> Iterator[dict]:
            # reads whichever stage's iterator is current (set_stage swaps it); batches are dicts, never None
            while (batch := next(self._it, None)) is not None:
                yield batch

        return batches()

    def state_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not (isinstance(state, dict) and {"stage", "loader"} <= set(state)):
            raise DataError(
                "cannot resume the training data: the checkpoint was saved without training.seq_len_schedule and "
                f"this run has one; {CHANGE_OF_KIND}"
            )
        stage = int(state["stage"])
        if self.num_stages is not None and not 0 <= stage < self.num_stages:
            raise DataError(
                f"cannot resume the training data: the checkpoint is in stage {stage + 1} of its "
                f"training.seq_len_schedule, this run's has {self.num_stages} stage(s); {CHANGE_OF_KIND}"
            )
        if stage != self.stage:
            self.stage, self.loader = stage, self.build(stage)
        self.loader.load_state_dict(state["loader"])
