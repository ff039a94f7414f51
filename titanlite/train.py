"""The training job: ``python -m titanlite.train --config FILE`` or ``torchrun ... -m titanlite.train``."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import torch

from titanlite import components
from titanlite.config import exit_with_error, parse_args_or_exit
from titanlite.errors import UserError
from titanlite.models import model_schema
from titanlite.parallel.distributed import main_then_exit, world_from_env
from titanlite.trainer.metrics_log import DiskFullError
from titanlite.trainer.trainer import ResumeError, Trainer  # noqa: F401  (titanlite.train.Trainer: the default)

logger = logging.getLogger("titanlite")


def setup_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)


def main(argv: list[str] | None = None, trainer_cls: type | None = None, load_config: Callable | None = None) -> None:
    """The command line: ``load_config(argv)``, then the dry run, or ``trainer_cls`` (default: the one ``[job]
    trainer`` names) built and trained. A :class:`~titanlite.errors.UserError` is one line and its exit status (the
    codes: :mod:`titanlite.errors`); anything else is a bug and keeps its traceback."""
    argv = sys.argv[1:] if argv is None else argv
    cfg = load_config(argv) if load_config is not None else parse_args_or_exit(argv, model_schema=model_schema)
    if cfg.job.dry_run:  # check the layout at its stated scale with a fake process group, then exit
        from titanlite.plan.dry_run import dry_run

        try:
            dry_run(cfg)
        except UserError as e:
            exit_with_error(e)
        return
    world = world_from_env()
    setup_logging(world.rank)
    if cfg.job.world_size > 0 and world.world_size != cfg.job.world_size:
        logger.warning(
            f"this config is tuned for {cfg.job.world_size} processes (job.world_size) but runs on {world.world_size}"
        )
    try:
        cls = trainer_cls or components.get("trainer", cfg.job.trainer)
        trainer = cls(cfg, world)  # takes the dump folder's lock first
    except UserError as e:
        exit_with_error(e, every_rank=True)
    try:
        with trainer.preemption:  # SIGTERM/SIGINT: finish the step, checkpoint, exit (titanlite.trainer.preemption)
            trainer.train()
        code = trainer.preemption.exit_status()  # 128 + signal number when stopped with nothing to resume from
    except UserError as e:
        if e.exit_code == 1:  # stopped as the config asks: [guard] policy = raise, or too many skips; a mixture
            logger.error("training stopped: %s", e)  # source ran out with mixture_on_exhausted = "stop"
            code = 1
        else:  # a resume that does not fit, a full disk, a damaged shard: nothing lost. A full metrics log (rank 0)
            # may have an asynchronous save failing behind it: say which checkpoints are intact
            intact = isinstance(e, DiskFullError) and trainer.checkpointer.enabled
            exit_with_error(f"{e}; {trainer.checkpointer.intact()}" if intact else e, e.exit_code, every_rank=True)
    if torch.distributed.is_initialized():  # no rank may tear its connections down while another still uses
        torch.distributed.barrier()  # them (the process exit itself: main_then_exit, below)
        torch.distributed.destroy_process_group()
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    main_then_exit(main)  # under torchrun: no interpreter finalization after the run (see there)
