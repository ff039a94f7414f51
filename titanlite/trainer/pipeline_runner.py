"""The pipeline runner: this rank's stages run by their schedule, in the training step and in evaluation (the
split and the stage modules: :mod:`titanlite.parallel.pipeline`).

The loss exists on the last stage only, as the token *sum* divided by the step's global token count (the
schedule's ``scale_grads`` is off: it must not divide by the microbatch count again), so accumulation, data and
pipeline parallelism all give the single-process update; the raw sums are kept for the step to share the true
loss with every stage. With a chunked loss the last stage returns hidden states and the loss applies its output
layer. Torch infers the stages' shapes with one forward at the first step and at each switch between training
and evaluation, which modules keeping running statistics (MoE loads) must not count: :class:`_Stage` turns
``track_stats`` off then.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    _Action,
    _add_send_recv,
    _ComputationType,
)

from titanlite.parallel.pipeline import SCHEDULES, ModelParts, PipelinePlan, is_multi_stage
from titanlite.parallel.pipeline_schedules import V_SCHEDULES
from titanlite.parallel.tensor_parallel import to_local_value
from titanlite.trainer.output_loss import as_output_loss

_FORWARD = _ComputationType.FORWARD


class Pipeline:
    """This rank's stages and their schedule: :meth:`step` (forward + backward of one local batch) and
    :meth:`evaluate` (forward only). Both return the token-sum loss of the microbatches whose last stage
    runs here, or 0 on a rank without the last stage; the caller sums it over the pipeline group. Evaluation
    runs the schedule's forward-only mode, except for the V schedules, whose evaluation mode fails in torch 2.13:
    they get a second schedule with a forward-only order (``_schedule``)."""

    def __init__(self, parts: ModelParts, plan: PipelinePlan, runtime: Any):
        """``runtime`` (a :class:`~titanlite.trainer.runtime.Runtime`, its pipeline unset): the device, the pipeline
        group (its parallel dims'), the output loss (``loss``: from the logits, or a chunked one) and the autocast of
        each stage (``autocast(module)``)."""
        self.parts, self.plan, self.runtime = parts, plan, runtime
        self.group, self.device = runtime.pp_group, runtime.device
        self.has_first, self.has_last = 0 in parts.stage_ids, plan.num_stages - 1 in parts.stage_ids
        self.last_stage = parts.stages[parts.stage_ids.index(plan.num_stages - 1)] if self.has_last else None
        self.output_loss = as_output_loss(runtime.loss)
        if self.last_stage is not None:  # it returns what the output loss takes: logits, or hidden states
            self.output_loss.check(self.last_stage)
            self.last_stage.forward = functools.partial(_forward_for, self.last_stage.forward, self)
        self.loss_fn = self.bind(self.output_loss)  # (last stage's output, labels) -> token-sum loss
        self.schedule = self._schedule()
        self._eval_schedule = None
        self._fn, self._divisor, self._sums = self.loss_fn, 1, []

    def bind(self, output_loss: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """``(last stage's output, labels) -> loss`` of ``output_loss`` (a chunked one applies the stage's output
        layer, under the stage's autocast)."""

        def loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            with self.runtime.autocast(self.last_stage):
                return output_loss(self.last_stage, outputs, labels)

        return loss

    def _schedule(self, forward_only: bool = False) -> Any:
        plan = self.plan
        stages = [_Stage(m, i, plan.num_stages, self.device, group=self.group) for i, m in self._stages()]
        arg = stages if is_multi_stage(plan.schedule) else stages[0]
        kw = dict(n_microbatches=plan.n_microbatches, loss_fn=self._loss, scale_grads=False)
        schedule = SCHEDULES[plan.schedule](arg, **kw)
        if forward_only and plan.schedule in V_SCHEDULES:
            # torch 2.13's V schedules still run their backward actions in eval mode (and fail): give them a
            # forward-only order, each rank's stages in turn over every microbatch, with the sends and receives
            # added by torch's own lowering (its validation, which insists on backward actions, is skipped)
            n, to_rank = plan.n_microbatches, schedule.stage_index_to_group_rank
            order = {
                r: [_Action(s, _FORWARD, mb) for s in plan.stage_ids(r) for mb in range(n)] for r in range(plan.degree)
            }
            schedule.pipeline_order_with_comms = _add_send_recv(order, lambda s: to_rank[s], plan.num_stages)
        return schedule

    def _stages(self) -> list[tuple[int, nn.Module]]:
        """(stage index, the module its PipelineStage runs): the stage itself, or, for autocast (stages without
        FSDP, whose mixed precision policy casts instead), a wrapper running only its forward under autocast."""
        return [
            (i, m if self.runtime.autocast_dtype(m) is None else _Autocast(m, self.runtime))
            for i, m in zip(self.parts.stage_ids, self.parts.stages)
        ]

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        total = self._fn(logits, labels)
        self._sums.append(to_local_value(total.detach()))
        return total / self._divisor

    def _run(self, run: Callable, inputs, labels, extra: dict, fn: Callable, divisor: int) -> torch.Tensor:
        self._fn, self._divisor, self._sums = fn, divisor, []
        args = (inputs,) if self.has_first else ()
        run(*args, target=labels if self.has_last else None, return_outputs=False, **extra)
        # the last n: a schedule's first run also calls the loss once to infer the backward's shapes
        sums = self._sums[-self.plan.n_microbatches :] if self.has_last else []
        self._sums = []
        return torch.stack(sums).sum(0) if sums else torch.zeros((), device=self.device)  # a loss may be a vector

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, extra: dict, tokens: int) -> torch.Tensor:
        """Forward and backward of ``inputs`` (this rank's local batch), each microbatch's loss divided by
        ``tokens`` (the optimizer step's global token count); returns the undivided sum (see the class)."""
        return self._run(self.schedule.step, inputs, labels, extra, self.loss_fn, tokens)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor, extra: dict, loss_fn: Callable) -> torch.Tensor:
        """Forward only, through the evaluation schedule; the summed ``loss_fn(logits, labels)`` as for :meth:`step`
        (chunked like the training loss)."""
        fn = self.bind(self.output_loss.with_fn(loss_fn))
        if self.plan.schedule not in V_SCHEDULES:  # torch re-infers the shapes at each switch to evaluation and back
            return self._run(self.schedule.eval, inputs, labels, extra, fn, 1)
        if self._eval_schedule is None:
            self._eval_schedule = self._schedule(forward_only=True)
        return self._run(self._eval_schedule.eval, inputs, labels, extra, fn, 1)


def _forward_for(forward: Callable, pipeline: Pipeline, *args: Any, **kwargs: Any) -> Any:
    """The last stage's forward with the arguments its pipeline's output loss asks for (``return_hidden``)."""
    return forward(*args, **kwargs, **pipeline.output_loss.model_kwargs)


class _Stage(PipelineStage):
    """A ``PipelineStage`` whose shape inference leaves the modules' running statistics alone (module docstring)."""

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        tracking = [m for m in self.submod.modules() if getattr(m, "track_stats", False)]
        for m in tracking:
            m.track_stats = False
        try:
            return super()._prepare_forward_infra(*args, **kwargs)
        finally:
            for m in tracking:
                m.track_stats = True


class _Autocast(nn.Module):
    """A stage whose forward runs under its runtime's autocast (the schedule also runs the backward, which must not)."""

    def __init__(self, stage: nn.Module, runtime: Any):
        super().__init__()
        self.stage, self.runtime = stage, runtime

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.runtime.autocast(self.stage):
            return self.stage(*args, **kwargs)
