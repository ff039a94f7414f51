"""Named building blocks a config can choose: trainer classes, losses, optimizers, LR schedules.

``[job] trainer``, ``[training] loss``, ``[optimizer] name`` and ``[lr_scheduler] name`` are names looked up here
when the trainer is built, so an extension swaps a piece by registering it (docs/library.md, "Swapping one piece
of the stock job"). Signatures: ``trainer``: a :class:`titanlite.trainer.Trainer` subclass; ``loss``:
``fn(logits, labels) -> token-sum loss``; ``optimizer``: ``fn(model, optimizer_section)``; ``lr_scheduler``:
``fn(optimizer, lr_scheduler_section, total_steps)``. The built-ins are named (:data:`BUILTINS`,
``module:attribute``) and imported on first lookup: this module sits below the modules that define them.
"""

from __future__ import annotations

import importlib
from typing import Any

from titanlite.config import did_you_mean
from titanlite.errors import ConfigError

KINDS = ("trainer", "loss", "optimizer", "lr_scheduler")
_KEYS = dict(trainer="job.trainer", loss="training.loss", optimizer="optimizer.name", lr_scheduler="lr_scheduler.name")
# kind -> name -> "module:attribute" of each built-in component
BUILTINS: dict[str, dict[str, str]] = {
    "trainer": {"default": "titanlite.trainer.trainer:Trainer"},
    "loss": {"cross_entropy": "titanlite.trainer.loss:cross_entropy_sum"},
    "optimizer": {
        "AdamW": "titanlite.optim.optimizer:build_optimizer",
        "Adam": "titanlite.optim.optimizer:build_optimizer",
        "muon": "titanlite.optim.muon:build_muon",
    },
    "lr_scheduler": {"warmup_stable_decay": "titanlite.optim.lr_scheduler:build_lr_scheduler"},
}
_REGISTRY: dict[str, dict[str, Any]] = {kind: {} for kind in KINDS}  # what extensions register


def resolve(target: str) -> Any:
    """The object a ``"module:attribute"`` string names (the module imported if it is not yet)."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def register(kind: str, name: str, obj: Any) -> Any:
    """Register ``obj`` as the ``kind`` called ``name``; a different object under a taken name is an error."""
    if kind not in _REGISTRY:
        raise ValueError(f"unknown component kind {kind!r}; kinds: {', '.join(KINDS)}")
    builtin = BUILTINS[kind].get(name)
    if _REGISTRY[kind].get(name, obj) is not obj or builtin is not None and resolve(builtin) is not obj:
        raise ValueError(f"a {kind} named {name!r} is already registered")
    _REGISTRY[kind][name] = obj
    return obj


def names(kind: str) -> list[str]:
    """The names ``kind`` can be looked up by: the built-ins, then the registered ones."""
    return list(dict.fromkeys([*BUILTINS[kind], *_REGISTRY[kind]]))


def get(kind: str, name: str) -> Any:
    """The ``kind`` registered as ``name``; a one-line ValueError naming the config key otherwise."""
    if name in _REGISTRY[kind]:
        return _REGISTRY[kind][name]
    if name in BUILTINS[kind]:
        return resolve(BUILTINS[kind][name])
    known = names(kind)
    hint = did_you_mean(name, known)
    raise ConfigError(f"{_KEYS[kind]}={name!r} is not a registered {kind} (registered: {', '.join(known)}){hint}")
