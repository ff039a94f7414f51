"""Random-number-generator state as a checkpoint ``Stateful`` (OLMo-core's habit: RNG in the checkpoint).

:class:`RNGState` captures python ``random``, torch's CPU generator and, on CUDA, the device's
generator; :class:`~titanlite.checkpoint.manager.CheckpointManager` saves one per rank.
"""

from __future__ import annotations

import random
from typing import Any

import torch


class RNGState:
    def __init__(self, device: torch.device | None = None):
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"python": random.getstate(), "torch_cpu": torch.get_rng_state()}
        if self.device is not None and self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch_cpu"])
        if self.device is not None and self.device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device)
