"""``build_parallel_model``: a model family's model, parallelized and initialized, on every rank.

The steps, each needed for a reason:

1. With ``weight_init = rank0`` (the default off CUDA, see :mod:`titanlite.parallel.weight_init`),
   rank 0 first initializes a full CPU copy, exactly as a single process would with the same seed.
2. The model is built on the meta device (no memory), and the family's ``parallelize_fn`` applies
   float8, TP, AC, compile and FSDP to it. A family without one runs on one process only: data- or
   tensor-parallel degrees above 1 are refused (it would train with no gradient synchronization).
3. ``to_empty`` allocates each rank's shards. It also *unties* shared parameters (each module gets
   its own new tensor), so parameters that were one tensor on the meta model (a tied embedding and
   output) are made one again before ``init_weights``; a family whose ``init_weights`` unties them
   is refused rather than trained untied.
4. ``init_weights()`` initializes in place (it must also work on DTensor shards); with ``rank0`` the
   reference from step 1 is then broadcast into the shards.

With pipeline parallelism (a :class:`~titanlite.parallel.pipeline.PipelinePlan`), step 2 first cuts
the meta model into this rank's stages with the family's ``pipeline_fn``, parallelizes each stage,
and returns them as one :class:`~titanlite.parallel.pipeline.ModelParts` under the full model's names.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titanlite.errors import ConfigError
from titanlite.parallel.parallel_dims import ParallelDims
from titanlite.parallel.pipeline import ModelParts, PipelinePlan
from titanlite.parallel.policies import Policies
from titanlite.parallel.state_dict import load_full_state_dict
from titanlite.parallel.weight_init import reference_state_dict, resolve_weight_init, retie, tied_parameters

logger = logging.getLogger(__name__)


def check_parallelizable(spec: Any, dims: ParallelDims) -> None:
    """A family without a parallelize function trains on one process only; without a pipelining one, unpipelined."""
    if spec.parallelize_fn is None and (dims.fsdp_degree > 1 or dims.tp > 1 or dims.pp > 1):
        raise ConfigError(
            f"model family {spec.name!r} has no parallelize function, so it trains on one process only "
            f"(asked: data-parallel degree {dims.dp_degree}, tensor-parallel degree {dims.tp}, "
            f"pipeline-parallel degree {dims.pp}, context-parallel degree {dims.cp})"
        )
    if dims.cp > 1 and "context_parallel" not in inspect.signature(spec.model_cls.forward).parameters:
        raise ConfigError(
            f"model family {spec.name!r} does not take the context_parallel forward argument, so "
            f"parallelism.context_parallel_degree must be 1 (asked: {dims.cp})"
        )
    if dims.pp > 1 and getattr(spec, "pipeline_fn", None) is None:
        raise ConfigError(
            f"model family {spec.name!r} has no pipelining function (ModelSpec.pipeline_fn), so "
            f"parallelism.pipeline_parallel_degree must be 1 (asked: {dims.pp})"
        )


def parallelize_on_meta(
    spec: Any,
    model_args: Any,
    dims: ParallelDims,
    policies: Policies,
    pipeline: PipelinePlan | None = None,
    pp_rank: int | None = None,
    model: nn.Module | None = None,
) -> tuple[nn.Module, list]:
    """Step 2 of the module docstring: ``(the model on the meta device with the family's plan applied, the
    groups of tied parameters it had before)``; no memory is allocated. The dry run inspects this model.
    With ``pipeline``, the model is the stages of ``pp_rank`` (default: this rank's) as one :class:`ModelParts`,
    copied from ``model`` when given (the unparallelized meta model, which the stages leave as it was: the dry run
    builds it once for every pp rank)."""
    check_parallelizable(spec, dims)
    if model is None or pipeline is None or dims.pp == 1:
        with torch.device("meta"):
            model = spec.model_cls(model_args)
    tied = tied_parameters(model)
    if pipeline is not None and dims.pp > 1:
        stage_ids = pipeline.stage_ids(dims.pp_rank if pp_rank is None else pp_rank)
        stages = spec.pipeline_fn(model, pipeline, stage_ids)
        return ModelParts(stage_ids, [spec.parallelize_fn(m, dims, policies) for m in stages]), []
    if spec.parallelize_fn is not None:
        return spec.parallelize_fn(model, dims, policies), tied
    policies.apply_single_device(model)
    return model, tied


def build_parallel_model(
    spec: Any,
    model_args: Any,
    parallel_dims: ParallelDims | None = None,
    policies: Policies | None = None,
    *,
    device: str | torch.device = "cpu",
    weight_init: str = "auto",
    pipeline: PipelinePlan | None = None,
) -> nn.Module:
    """``spec`` (a :class:`~titanlite.models.ModelSpec`)'s model of ``model_args``, parallelized over
    ``parallel_dims`` (None: one process) with ``policies`` and cut into stages by ``pipeline`` (needed when
    ``parallel_dims.pp > 1``), materialized on ``device`` and initialized (see the module docstring).
    Collective when distributed: every rank calls it."""
    dims = parallel_dims or ParallelDims()
    policies = policies or Policies()
    device = torch.device(device)
    check_parallelizable(spec, dims)  # before the reference initialization below
    mode = resolve_weight_init(weight_init, dims.world_size > 1, device.type)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    reference = reference_state_dict(spec.model_cls, model_args) if mode == "rank0" and rank == 0 else None
    if dims.pp > 1 and pipeline is None:
        raise ValueError("build_parallel_model: pipeline_parallel_degree > 1 needs a PipelinePlan (pipeline=)")
    model, tied = parallelize_on_meta(spec, model_args, dims, policies, pipeline)
    model.to_empty(device=device)
    if retie(model, tied):
        logger.debug("re-tied %s after to_empty", "; ".join(" = ".join(g) for g in tied))
    with torch.no_grad(), warnings.catch_warnings():
        if mode == "rank0":  # overwritten from the reference below: no CPU-RNG warning for these values
            warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        model.init_weights()
    untied = [group for group in tied if len({id(model.get_parameter(n)) for n in group}) > 1]
    if untied:
        raise ValueError(
            f"{spec.name}: init_weights() untied the shared parameters {', '.join(untied[0])}; "
            "initialize them in place instead of assigning new tensors"
        )
    if mode == "rank0":
        load_full_state_dict(model, reference)
    model.train()
    return model
