"""Optimizers and learning-rate schedules (registered under their ``[optimizer]`` / ``[lr_scheduler]`` names)."""

from titanlite.components import register
from titanlite.optim.lr_scheduler import build_lr_scheduler, lr_factor
from titanlite.optim.optimizer import build_optimizer, param_groups

register("optimizer", "AdamW", build_optimizer)
register("optimizer", "Adam", build_optimizer)
register("lr_scheduler", "warmup_stable_decay", build_lr_scheduler)

__all__ = ["build_lr_scheduler", "build_optimizer", "lr_factor", "param_groups"]
