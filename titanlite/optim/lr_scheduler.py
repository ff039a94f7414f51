"""Learning-rate schedule: linear warmup, an optional constant stage, then decay (WSD). ``lr_factor(step, ...)``
is a pure function of the step (1-based: the factor of optimizer step ``step``), so it can be unit-tested and
plotted without an optimizer."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from titanlite.errors import ConfigError


def lr_factor(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int,
    decay_ratio: float = -1.0,
    decay_type: str = "linear",
    min_lr_factor: float = 0.0,
) -> float:
    """Multiplier of the peak lr for optimizer step ``step`` (1..total_steps).

    - warmup: steps 1..warmup_steps rise linearly, step s gets s / (warmup_steps + 1);
    - stable: constant 1.0 until the decay stage starts;
    - decay: the last ``decay_steps`` steps go from 1.0 to ``min_lr_factor`` (reached at the last
      step); ``decay_ratio = -1`` decays over every step after warmup (classic warmup + decay).
    """
    if step <= warmup_steps:
        return step / (warmup_steps + 1)
    after_warmup = total_steps - warmup_steps
    decay_steps = after_warmup if decay_ratio < 0 else min(after_warmup, round(total_steps * decay_ratio))
    decay_start = total_steps - decay_steps
    if step <= decay_start or decay_steps == 0:
        return 1.0
    progress = (step - decay_start) / decay_steps  # in (0, 1]
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        raise ConfigError(f"unknown decay_type {decay_type!r}; expected linear, cosine or sqrt")
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def build_lr_scheduler(optimizer: Optimizer, cfg, total_steps: int) -> LambdaLR:
    """A LambdaLR over ``lr_factor`` for the ``[lr_scheduler]`` section ``cfg``: LambdaLR evaluates its lambda
    at construction (index 0) and after every ``scheduler.step()``, so index ``i`` is optimizer step ``i + 1``."""

    def fn(i: int) -> float:  # lr_factor's keywords are the section's field names
        kw = {k: getattr(cfg, k) for k in ("warmup_steps", "decay_ratio", "decay_type", "min_lr_factor")}
        return lr_factor(min(i + 1, total_steps), total_steps=total_steps, **kw)

    return LambdaLR(optimizer, fn)
