"""``[eval]`` in the training loop: downstream scores every ``eval.freq`` steps, logged and recorded as
:func:`titanlite.eval.records.eval_record` says."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from titanlite.eval.records import eval_record, scores_line
from titanlite.trainer.hooks import Hook, LoopState

logger = logging.getLogger("titanlite")


class EvalHook(Hook):
    """``[eval]``: ``evaluate()`` (every rank takes part) every ``freq`` steps and at the last step."""

    def __init__(self, section: Any, evaluate: Callable[[], dict[str, dict[str, Any]]]):
        self.freq, self.evaluate = section.freq, evaluate

    def on_step_end(self, state: LoopState, result: Any) -> None:
        if state.step % self.freq == 0 or state.last_step:
            with state.side_work():
                results = self.evaluate()
            state.log(eval_record(state.step, results))
            logger.info("step %d | eval | %s", state.step, scores_line(results))
