"""A job config's model, policies, loss, optimizer, LR schedule and train step in one call, for a loop of your own
(docs/library.md: what it builds and what it leaves to the caller).

:func:`build_training` goes through the functions the trainer itself calls (its ``build_model``, ``build_loss`` and
``build_train_step`` call :func:`build_config_model`, :func:`config_loss` and :func:`config_train_step`), so with the
same seed set first (``torch.manual_seed(cfg.training.seed)``) a loop over its ``train_step`` gives the trainer's
losses bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from titanlite import components
from titanlite.dtypes import DTYPES
from titanlite.models import get_model_spec
from titanlite.models.registry import model_args_for
from titanlite.output_loss import output_loss, registered_loss
from titanlite.parallel.build import build_parallel_model
from titanlite.parallel.compile import CompilePolicy
from titanlite.parallel.pipeline import Pipeline
from titanlite.parallel.policies import Policies
from titanlite.trainer.step import TrainStep, grad_accum_steps


def config_policies(cfg: Any) -> Policies:
    """The parallelize policies of a job config's sections."""
    c = cfg
    return Policies.from_config(c.parallelism, c.training, c.activation_checkpoint, c.compile, c.quantize_linear_float8)


def build_config_model(
    cfg: Any, spec: Any, model_args: Any, parallel_dims: Any, device: torch.device, pipeline: Any = None
) -> nn.Module:
    """``spec``'s model of ``model_args`` with the config's policies and ``[parallelism] weight_init``."""
    kw = dict(device=device, weight_init=cfg.parallelism.weight_init, pipeline=pipeline)
    return build_parallel_model(spec, model_args, parallel_dims, config_policies(cfg), **kw)


def config_loss(cfg: Any, parallel_dims: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The ``[training] loss`` (a token sum), compiled with ``[compile] components = ["loss"]``, with its closed-form
    gradient, compiled alike, where it has one (:func:`titanlite.output_loss.registered_loss`)."""
    policy = CompilePolicy.from_config(cfg.compile)
    return registered_loss(cfg.training.loss, lambda fn: policy.compile_loss(fn, parallel_dims.tp_enabled))


def config_train_step(
    cfg: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    parallel_dims: Any,
    *,
    grad_accum_steps: int,
    loss_fn: Callable,
    count_unmasked: bool = False,
    pipeline_plan: Any = None,
    device: torch.device | None = None,
    stop_requested: Callable[[], bool] | None = None,
) -> TrainStep:
    """The :class:`TrainStep` of the config's ``[training]`` (clipping, compute dtype); with ``pipeline_plan`` the
    stages' schedule runs it (``device``: the pipeline's); ``stop_requested``: see :class:`TrainStep`."""
    t = cfg.training
    kw = dict(grad_accum_steps=grad_accum_steps, max_norm=t.max_norm, parallel_dims=parallel_dims)
    kw["stop_requested"] = stop_requested
    dtype = DTYPES[t.mixed_precision_param]
    if pipeline_plan is not None:
        group = parallel_dims.pp_group
        kw["pipeline"] = Pipeline(model, pipeline_plan, group, device, loss_fn, autocast_dtype=dtype)
    return TrainStep(
        model, optimizer, lr_scheduler, loss_fn=loss_fn, autocast_dtype=dtype, count_unmasked=count_unmasked, **kw
    )


@dataclasses.dataclass
class TrainingParts:
    """What :func:`build_training` returns."""

    model_args: Any
    model: nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    train_step: TrainStep


def build_training(cfg: Any, parallel_dims: Any, device: torch.device, vocab_size: int) -> TrainingParts:
    """The model (``[model]`` with the tokenizer's ``vocab_size``), optimizer, LR schedule (over
    ``training.steps``) and train step of a job config, as the trainer builds them (see the module docstring).
    Collective when distributed: every rank calls it."""
    spec = get_model_spec(cfg.model.name)
    args = model_args_for(cfg.model, vocab_size)
    model = build_config_model(cfg, spec, args, parallel_dims, torch.device(device))
    optimizer = components.get("optimizer", cfg.optimizer.name)(model, cfg.optimizer)
    scheduler = components.get("lr_scheduler", cfg.lr_scheduler.name)(optimizer, cfg.lr_scheduler, cfg.training.steps)
    t = cfg.training
    accum = grad_accum_steps(t.global_batch_size, t.local_batch_size, parallel_dims.dp_degree)
    loss = output_loss(
        config_loss(cfg, parallel_dims), cfg.training.loss_chunks, loss_parallel=parallel_dims.loss_parallel_enabled
    )
    step = config_train_step(cfg, model, optimizer, scheduler, parallel_dims, grad_accum_steps=accum, loss_fn=loss)
    return TrainingParts(args, model, optimizer, scheduler, step)
