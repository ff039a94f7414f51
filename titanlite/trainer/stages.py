"""``[training] seq_len_schedule`` in the loop (:mod:`titanlite.plan.run_plan` plans the stages)."""

from __future__ import annotations

import logging
from typing import Any

from titanlite.plan.run_plan import RunPlan
from titanlite.trainer.hooks import Hook, LoopState

logger = logging.getLogger(__name__)


class StageHook(Hook):
    """Before each step (at the start, after each step, after a rollback), puts the loader, the gradient
    accumulation and ``metrics.flops_per_token`` (``stage_flops``, one per stage; ``metrics`` may be None) on the
    step's stage, each through its owner's method. The last hook, so a step is saved and logged on its stage."""

    def __init__(self, plan: RunPlan, loader: Any, train_step: Any, metrics: Any = None, stage_flops=()):
        self.plan, self.loader, self.train_step = plan, loader, train_step
        self.metrics, self.stage_flops = metrics, stage_flops

    def enter(self, step: int) -> None:
        i = self.plan.stage_index(step)
        stage = self.plan.stages[i]
        self.train_step.set_grad_accum_steps(stage.grad_accum_steps)
        if self.metrics is not None:
            self.metrics.set_flops_per_token(self.stage_flops[i])
        if self.loader.stage != i:
            self.loader.set_stage(i)
            logger.info(
                f"stage {i + 1} of {len(self.plan.stages)} from step {step}: seq_len {stage.seq_len}, "
                f"{stage.local_batch_size} sequences per micro-batch x grad accumulation {stage.grad_accum_steps}, "
                f"{stage.tokens_per_step:,} tokens per step"
            )

    def _next(self, state: LoopState) -> None:
        if state.step < state.total_steps and not state.stop:  # the loop runs another step
            self.enter(state.step + 1)

    def on_train_start(self, state: LoopState) -> None:
        self._next(state)

    def on_step_end(self, state: LoopState, result: Any) -> None:
        self._next(state)

    def on_resume(self, state: LoopState, result: Any) -> None:
        self._next(state)
