"""Small pieces of training state that a checkpoint carries besides model and optimizer.

- :class:`AttrState`: a ``state_dict``/``load_state_dict`` view of plain attributes of an object
  (the trainer's ``step`` and ``tokens_seen``), so the loop keeps using ordinary attributes.
- :func:`capture_rng` / :func:`restore_rng`: python ``random``, torch CPU and (when present) the
  current CUDA device's generator. Each rank's state is saved under its own key.
"""
from __future__ import annotations

import random
from typing import Any, Iterable

import torch


class AttrState:
    """Exposes ``names`` of ``obj`` as a state dict of python values."""

    def __init__(self, obj: Any, names: Iterable[str]):
        self.obj = obj
        self.names = tuple(names)

    def state_dict(self) -> dict[str, Any]:
        return {n: getattr(self.obj, n) for n in self.names}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [n for n in self.names if n not in state]
        if missing:
            raise KeyError(f"checkpoint train state lacks {', '.join(missing)}")
        for n in self.names:
            setattr(self.obj, n, state[n])


def capture_rng(device: torch.device | None = None) -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch_cpu": torch.get_rng_state()}
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device | None = None) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch_cpu"])
    if device is not None and device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
