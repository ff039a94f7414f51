"""``[comm]`` in the loop: the collectives' shorter timeout, set once start-up and the first compilations are
over (they may legitimately keep ranks apart for long)."""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist

from titanlite.parallel.distributed import set_collective_timeout
from titanlite.trainer.hooks import Hook


class CollectiveTimeoutHook(Hook):
    """``[comm]`` in the loop: once the first step (start-up and compilation included) is done, every
    collective of ``groups`` gets the shorter ``timeout_seconds``."""

    def __init__(self, timeout_seconds: float, groups: Iterable[dist.ProcessGroup | None] = ()):
        self.timeout_seconds, self.groups, self.pending = timeout_seconds, list(groups), True

    def on_step_end(self, state, result) -> None:
        if self.pending:
            set_collective_timeout(self.timeout_seconds, self.groups)
            self.pending = False
