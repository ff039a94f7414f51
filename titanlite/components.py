"""Named building blocks a config can choose: trainer classes, losses, optimizers, LR schedules.

``[job] trainer``, ``[training] loss``, ``[optimizer] name`` and ``[lr_scheduler] name`` hold names
looked up here when the trainer is built, so an extension module (``[job] extensions``) swaps a
piece by registering it, with no copy of ``titanlite.train.main``::

    from titanlite.components import register

    register("loss", "z_loss", my_z_loss)   # then [training] loss = "z_loss"

Signatures: ``trainer``: a :class:`titanlite.trainer.Trainer` subclass; ``loss``: ``fn(logits, labels)
-> token-sum loss``; ``optimizer``: ``fn(model, optimizer_section) -> Optimizer``;
``lr_scheduler``: ``fn(optimizer, lr_scheduler_section, total_steps) -> scheduler``.
The built-ins register when their module is imported (``titanlite.loss``, ``titanlite.optim``,
``titanlite.trainer``).
"""

from __future__ import annotations

from typing import Any

from titanlite.config import did_you_mean
from titanlite.errors import ConfigError

KINDS = ("trainer", "loss", "optimizer", "lr_scheduler")
_KEYS = dict(trainer="job.trainer", loss="training.loss", optimizer="optimizer.name", lr_scheduler="lr_scheduler.name")
_REGISTRY: dict[str, dict[str, Any]] = {kind: {} for kind in KINDS}


def register(kind: str, name: str, obj: Any) -> Any:
    """Register ``obj`` as the ``kind`` called ``name``; a different object under a taken name is an error."""
    if kind not in _REGISTRY:
        raise ValueError(f"unknown component kind {kind!r}; kinds: {', '.join(KINDS)}")
    if _REGISTRY[kind].get(name, obj) is not obj:
        raise ValueError(f"a {kind} named {name!r} is already registered")
    _REGISTRY[kind][name] = obj
    return obj


def get(kind: str, name: str) -> Any:
    """The ``kind`` registered as ``name``; a one-line ValueError naming the config key otherwise."""
    table = _REGISTRY[kind]
    if name not in table:
        hint = did_you_mean(name, list(table))
        raise ConfigError(f"{_KEYS[kind]}={name!r} is not a registered {kind} (registered: {', '.join(table)}){hint}")
    return table[name]
