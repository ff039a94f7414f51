"""Run a torchtitan classic TOML train config on titanlite.

    python -m torchtitan_ext.compat.train --config torchtitan_llama3.toml [--section.key value ...]
    torchrun --nproc-per-node 8 -m torchtitan_ext.compat.train --config torchtitan_llama3.toml
    python -m torchtitan_ext.compat.train --config torchtitan_llama3.toml --translate-only   # print the titanlite TOML
    python -m torchtitan_ext.compat.train --config torchtitan_llama3.toml --job.dry_run true --job.dry_run_world_size 64

Overrides use torchtitan's key names (``--training.local_batch_size 4``, ``--checkpoint.no_initial_load_model_only``);
titanlite-only keys (``--guard.policy skip_step``, ``--job.dry_run true``) pass through.

:class:`CompatTrainer` is titanlite's :class:`~titanlite.trainer.Trainer` with the three pieces whose
math differs between the two libraries set to torchtitan's:

- optimizer: one parameter group, weight decay on *every* parameter (titanlite decays matrices
  only); ``Adam`` keeps torchtitan's coupled L2 weight decay;
- learning-rate schedule: torchtitan v0.2's ``linear_warmup_stable_decay`` (warmup ``(i+1)/warmup``,
  a virtual last step so the decay never reaches ``min_lr_factor``, over ``lr_scheduler.total_steps``
  when set), not titanlite's WSD formula;
- resume: torchtitan DCP checkpoints in ``<dump_folder>/<checkpoint.folder>/step-N`` (or
  ``checkpoint.initial_load_path``) are loaded by :mod:`torchtitan_ext.compat.checkpoint`;
  titanlite's own checkpoints go to ``<checkpoint.folder>/titanlite/`` and take precedence once
  they exist.

The loss (token-mean cross-entropy over the optimizer step), gradient clipping, mixed precision,
FSDP/HSDP/TP layouts, activation checkpointing, compile and tensorwise float8 already match.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from titanlite.config import ConfigError, JobConfig, exit_with_error
from titanlite.errors import UserError
from titanlite.train import main as train_main
from titanlite.train import setup_logging
from titanlite.trainer import Trainer
from titanlite.utils import torch_compat
from torchtitan_ext.compat.checkpoint import broadcast_from_rank0, choose_source, load_torchtitan_checkpoint
from torchtitan_ext.compat.config import CompatSettings, load_translated, parse_cli, translate

logger = logging.getLogger("torchtitan_ext.compat")


# --------------------------------------------------------------------------- torchtitan's schedule


def torchtitan_lr_factor(
    i: int, *, total_steps: int, warmup_steps: int, decay_ratio: float | None, decay_type: str, min_lr_factor: float
) -> float:
    """torchtitan v0.2's LambdaLR factor at scheduler index ``i`` (used for optimizer step ``i + 1``)."""
    warmup = min(warmup_steps, total_steps)
    if decay_ratio is None:
        decay = total_steps - warmup
    else:
        decay = round(total_steps * decay_ratio)
        if warmup + decay > total_steps:
            decay = total_steps - warmup
    stable = total_steps + 1 - warmup - decay  # torchtitan's "virtual last step": the decay ends above min
    if i < warmup:
        return (i + 1) / warmup
    if i < warmup + stable:
        return 1.0
    progress = (i + 1 - (warmup + stable)) / decay
    if decay_type == "linear":
        shape = 1 - progress
    elif decay_type == "sqrt":
        shape = 1 - math.sqrt(progress)
    elif decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ConfigError(f"unknown decay_type {decay_type!r}")
    return min_lr_factor + (1 - min_lr_factor) * shape


def build_torchtitan_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: JobConfig, total_steps: int | None = None
) -> LambdaLR:
    """torchtitan's schedule over ``total_steps`` (its v0.2.2 ``lr_scheduler.total_steps``: the LR curve of a
    longer run, e.g. to debug its first steps), by default over ``training.steps``."""
    s = cfg.lr_scheduler
    fn = functools.partial(
        torchtitan_lr_factor,
        total_steps=cfg.training.steps if total_steps is None else total_steps,
        warmup_steps=s.warmup_steps,
        decay_ratio=None if s.decay_ratio < 0 else s.decay_ratio,
        decay_type=s.decay_type,
        min_lr_factor=s.min_lr_factor,
    )
    return LambdaLR(optimizer, fn)


def set_scheduler_position(scheduler: LambdaLR, step: int) -> None:
    """Put a LambdaLR at index ``step`` (as after ``step`` calls of ``scheduler.step()``)."""
    scheduler.last_epoch = step
    lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    torch_compat.set_scheduler_counters(scheduler, step + 1, lrs)


def build_torchtitan_optimizer(model: torch.nn.Module, cfg: JobConfig) -> torch.optim.Optimizer:
    """torchtitan's optimizer: one group over every trainable parameter (weight decay on all of them)."""
    o = cfg.optimizer
    on_cuda = any(p.device.type == "cuda" for p in model.parameters())
    impl = o.implementation
    if impl == "auto" or (impl == "fused" and not on_cuda):
        impl = "fused" if on_cuda else "foreach"  # CPU runs (tests) use foreach: same update
    kwargs = {"fused": impl == "fused", "foreach": impl == "foreach"}
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[o.name]
    params = [p for p in model.parameters() if p.requires_grad]
    return cls(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, **kwargs)


# --------------------------------------------------------------------------- trainer


class CompatTrainer(Trainer):
    """titanlite's Trainer with torchtitan's optimizer grouping, LR formula and checkpoint resume."""

    def __init__(self, cfg: JobConfig, world=None, settings: CompatSettings | None = None):
        self.compat = settings or CompatSettings()
        super().__init__(cfg, world)
        c = self.compat
        self.source: dict[str, Any] | None = None  # the torchtitan checkpoint to start from, if any
        if self.checkpointer.plan.kind != "resume":  # titanlite's own checkpoints take precedence
            self.source = broadcast_from_rank0(
                lambda: choose_source(c.torchtitan_folder, c.load_step, c.initial_load_path, c.initial_load_model_only)
            )

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        return build_torchtitan_optimizer(model, self.cfg)

    def build_lr_scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int):
        return build_torchtitan_lr_scheduler(optimizer, self.cfg, self.compat.lr_total_steps)

    def resume(self) -> int | None:
        """titanlite's own checkpoint when there is one, else the torchtitan checkpoint chosen at start."""
        if self.source is None:
            return super().resume()
        src = self.source
        out = load_torchtitan_checkpoint(
            src["path"],
            self.model,
            self.optimizer,
            model_only=src["model_only"],
            exclude=self.compat.exclude_from_loading,
        )
        self.state.step, self.state.tokens_seen = out["step"], out["tokens_seen"]
        if out["step"] and "lr_scheduler" not in self.compat.exclude_from_loading:
            set_scheduler_position(self.lr_scheduler, out["step"])
        logger.warning(
            "torchtitan compat: RESUMED from torchtitan checkpoint %s (%s): step %d, %s tokens seen; loaded %s",
            src["path"],
            src["why"],
            out["step"],
            f"{out['tokens_seen']:,}",
            ", ".join(out["loaded"]),
        )
        if "dataloader" in out["skipped"]:
            logger.warning(
                "torchtitan compat: the data position is not restored (torchtitan's data-loader state "
                "describes its own datasets): titanlite's loader starts from the beginning of its order"
            )
        return out["step"] or None


# --------------------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> None:
    """Translate the torchtitan config, then run titanlite's own ``main`` with :class:`CompatTrainer`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        raise SystemExit(0)
    translate_only = "--translate-only" in argv
    argv = [a for a in argv if a != "--translate-only"]
    setup_logging(int(os.environ.get("RANK", "0")))
    if os.environ.get("RANK", "0") != "0":
        logging.getLogger("torchtitan_ext.compat").setLevel(logging.ERROR)  # rank 0 warns for everyone
    try:
        path, _ = parse_cli(argv)
        translation = translate(path, argv, translate_only=translate_only)
        cfg = load_translated(translation)
    except UserError as e:
        exit_with_error(e)
    if translate_only:
        sys.stdout.write(translation.toml())
        return
    train_main(
        argv, trainer_cls=functools.partial(CompatTrainer, settings=translation.settings), load_config=lambda _: cfg
    )


if __name__ == "__main__":
    main()
