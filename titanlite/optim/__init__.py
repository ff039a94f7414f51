"""Optimizers and learning-rate schedules (built-in components under their ``[optimizer]`` / ``[lr_scheduler]`` names,
:data:`titanlite.components.BUILTINS`)."""

from titanlite.optim.lr_scheduler import build_lr_scheduler, lr_factor
from titanlite.optim.optimizer import build_optimizer, param_groups

__all__ = ["build_lr_scheduler", "build_optimizer", "lr_factor", "param_groups"]
