"""A job config's training parts in one call: the model with its policies, the optimizer (with the float8 scale
pre-compute), the LR schedule over the run plan, the output loss, the pipeline and the train step.

:func:`build_training` is the one assembly: :class:`titanlite.trainer.Trainer` builds its parts with it, and so
does a loop of your own (docs/library.md: what it builds and what it leaves to the caller), so with the same seed
set first (``torch.manual_seed(cfg.training.seed)``) a loop over its ``train_step`` gives the trainer's losses bit
for bit. Each part comes from a method of :class:`TrainingBuilder`; the Trainer is one, and a subclass of it swaps
a part by overriding that method.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from titanlite import components
from titanlite.errors import ConfigError
from titanlite.models import get_model_spec
from titanlite.models.registry import model_args_for
from titanlite.parallel.build import build_parallel_model
from titanlite.parallel.compile import CompilePolicy
from titanlite.parallel.float8_fsdp import register_float8_scale_precompute
from titanlite.parallel.pipeline import PipelinePlan
from titanlite.parallel.policies import Policies
from titanlite.plan.run_plan import RunPlan, plan_steps
from titanlite.trainer.output_loss import output_loss, registered_loss
from titanlite.trainer.pipeline_runner import Pipeline
from titanlite.trainer.runtime import Runtime
from titanlite.trainer.step import TrainStep, grad_accum_steps
from titanlite.utils.dtypes import DTYPES


def config_policies(cfg: Any) -> Policies:
    """The parallelize policies of a job config's sections."""
    c = cfg
    return Policies.from_config(c.parallelism, c.training, c.activation_checkpoint, c.compile, c.quantize_linear_float8)


def config_loss(cfg: Any, parallel_dims: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The ``[training] loss`` (a token sum), compiled with ``[compile] components = ["loss"]``, with its closed-form
    gradient, compiled alike, where it has one (:func:`titanlite.trainer.output_loss.registered_loss`)."""
    policy = CompilePolicy.from_config(cfg.compile)
    return registered_loss(cfg.training.loss, lambda fn: policy.compile_loss(fn, parallel_dims.tp_enabled))


def config_grad_accum_steps(cfg: Any, parallel_dims: Any) -> int:
    """Micro-batches per optimizer step of ``[training]``'s global and local batch at the data-parallel degree."""
    t = cfg.training
    return grad_accum_steps(t.global_batch_size, t.local_batch_size, parallel_dims.dp_degree)


def config_run_plan(cfg: Any, parallel_dims: Any, resumed: tuple[int, int] | None = None) -> RunPlan:
    """``[training] steps | tokens`` and ``seq_len_schedule`` as stages (:mod:`titanlite.plan.run_plan`), from the
    ``(step, tokens seen)`` a run ``resumed`` at under a token budget; the warm-up is checked against the steps."""
    c, t = cfg, cfg.training
    batch = dict(seq_len=t.seq_len, local_batch_size=t.local_batch_size)
    accum, dp = config_grad_accum_steps(cfg, parallel_dims), parallel_dims.dp_degree
    plan = plan_steps(
        steps=t.steps, tokens=t.tokens, dp_degree=dp, schedule=t.seq_len_schedule, grad_accum_steps=accum,
        resumed=resumed, **batch,
    )  # fmt: skip
    if c.lr_scheduler.warmup_steps > plan.total_steps:
        raise ConfigError(
            f"lr_scheduler.warmup_steps ({c.lr_scheduler.warmup_steps}) must be <= the run's {plan.total_steps} "
            f"steps (training.tokens = {t.tokens:,})"
        )
    return plan  # the checks of the schedule that need no plan: JobConfig.validate


def config_pipeline_plan(cfg: Any, parallel_dims: Any, model_args: Any) -> PipelinePlan | None:
    """``[parallelism] pipeline_parallel_*``: the stages and the microbatches, or None without pipelining."""
    if not parallel_dims.pp_enabled:
        return None
    return PipelinePlan.from_config(cfg.parallelism, model_args.n_layers, cfg.training.local_batch_size)


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """What a caller knows beyond the config; each None is derived from the config as :func:`build_training` says.

    - ``model_args``: the model's arguments (e.g. a seed checkpoint's);
    - ``run_plan``: the steps and seq_len stages (the trainer's accounts for a resumed token budget);
    - ``pipeline_plan``: the pipeline split (derived only under ``[parallelism] pipeline_parallel_degree > 1``);
    - ``count_unmasked``: divide the loss by the labels that carry loss (chat data, whose labels may be -100);
    - ``stop_requested``: read once per step and agreed over the ranks (:class:`TrainStep`)."""

    model_args: Any = None
    run_plan: RunPlan | None = None
    pipeline_plan: PipelinePlan | None = None
    count_unmasked: bool = False
    stop_requested: Callable[[], bool] | None = None


class TrainingBuilder:
    """Each part of a job config's training, from ``cfg``'s sections; :func:`build_training` calls these in order.
    Override one in a subclass (of :class:`titanlite.trainer.Trainer`, or of this) to swap that part."""

    def __init__(self, cfg: Any):
        self.cfg = cfg

    def build_model(self, spec: Any, model_args: Any, runtime: Runtime, pipeline_plan: Any = None) -> nn.Module:
        """Meta build, the family's parallelize plan with the config's policies, materialize and initialize
        (:func:`~titanlite.parallel.build.build_parallel_model`, ``[parallelism] weight_init``)."""
        kw = dict(device=runtime.device, weight_init=self.cfg.parallelism.weight_init, pipeline=pipeline_plan)
        return build_parallel_model(spec, model_args, runtime.parallel_dims, config_policies(self.cfg), **kw)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The ``[optimizer]`` by name."""
        return components.get("optimizer", self.cfg.optimizer.name)(model, self.cfg.optimizer)

    def build_lr_scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
        """The ``[lr_scheduler]`` by name, over the run's ``total_steps``."""
        return components.get("lr_scheduler", self.cfg.lr_scheduler.name)(optimizer, self.cfg.lr_scheduler, total_steps)

    def build_loss(self, parallel_dims: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The ``[training] loss`` (a token sum), compiled with ``[compile] components = ["loss"]``."""
        return config_loss(self.cfg, parallel_dims)

    def build_train_step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any, runtime: Runtime, **options: Any
    ) -> TrainStep:
        """The :class:`TrainStep`; ``options``: its ``grad_accum_steps``, ``max_norm``, ``count_unmasked`` and
        ``stop_requested``."""
        return TrainStep(model, optimizer, lr_scheduler, runtime=runtime, **options)


@dataclasses.dataclass
class TrainingParts:
    """What :func:`build_training` returns (``runtime``: how the model runs, for validation and evaluation too)."""

    model_args: Any
    model: nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    train_step: TrainStep
    runtime: Runtime
    run_plan: RunPlan


def build_training(
    cfg: Any,
    parallel_dims: Any,
    device: torch.device,
    vocab_size: int | None = None,
    facts: RunFacts = RunFacts(),
    builder: TrainingBuilder | None = None,
) -> TrainingParts:
    """The training parts of a job config (see the module docstring). Derived unless ``facts`` gives them: the model
    args from ``[model]`` and the tokenizer's ``vocab_size``, the run plan (``[training] steps | tokens`` and
    ``seq_len_schedule``, over which the LR schedule runs) and the pipeline split. ``builder`` builds each part
    (default: :class:`TrainingBuilder` of ``cfg``). Collective when distributed: every rank calls it."""
    builder = builder or TrainingBuilder(cfg)
    t, spec = cfg.training, get_model_spec(cfg.model.name)
    args = facts.model_args if facts.model_args is not None else model_args_for(cfg.model, vocab_size)
    run_plan = facts.run_plan or config_run_plan(cfg, parallel_dims)
    pipeline_plan = facts.pipeline_plan or config_pipeline_plan(cfg, parallel_dims, args)
    runtime = Runtime(torch.device(device), parallel_dims, DTYPES[t.mixed_precision_param], sdpa_kernel=t.sdpa_kernel)
    model = builder.build_model(spec, args, runtime, pipeline_plan)
    optimizer = builder.build_optimizer(model)
    register_float8_scale_precompute(optimizer, model)  # float8 all-gather: all scales in one all-reduce
    scheduler = builder.build_lr_scheduler(optimizer, run_plan.total_steps)
    loss = output_loss(builder.build_loss(parallel_dims), t.loss_chunks, loss_parallel=runtime.loss_parallel)
    runtime = dataclasses.replace(runtime, loss=loss)
    if pipeline_plan is not None:  # the stages and the schedule that runs them
        pipeline = Pipeline(model, pipeline_plan, runtime)
        runtime = dataclasses.replace(runtime, pipeline=pipeline)
    step = builder.build_train_step(
        model,
        optimizer,
        scheduler,
        runtime,
        grad_accum_steps=config_grad_accum_steps(cfg, parallel_dims),
        max_norm=t.max_norm,
        count_unmasked=facts.count_unmasked,
        stop_requested=facts.stop_requested,
    )
    return TrainingParts(args, model, optimizer, scheduler, step, runtime, run_plan)
