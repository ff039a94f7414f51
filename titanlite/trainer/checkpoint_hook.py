"""The checkpoint manager's place in the training loop."""

from __future__ import annotations

from titanlite.checkpoint.manager import CheckpointManager
from titanlite.trainer.hooks import Hook


class CheckpointHook(Hook):
    """The manager in the training loop: wait for staging before each update, save at step ends
    (``last`` at the final step), wait for the last write when training ends."""

    def __init__(self, manager: CheckpointManager):
        self.manager = manager

    def before_update(self, state, result) -> None:
        self.manager.wait_for_staging()  # an async save must have copied the weights first

    def on_step_end(self, state, result) -> None:
        self.manager.save(state.step, last=state.last_step)

    def on_train_end(self, state) -> None:
        self.manager.close()
