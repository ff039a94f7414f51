"""The runtime facts every forward of the model needs: where it runs, how it is split, in which dtype, how its
outputs become a loss, and the pipeline that runs it when it is cut into stages.

One :class:`Runtime` is built with the training parts (:func:`titanlite.trainer.assemble.build_training`) and
handed to whatever runs the model: the train step, validation, in-loop evaluation and sampling. A new fact
is added here once instead of to each of their parameter lists: context parallelism is one
(:attr:`Runtime.context_parallel`).

:func:`forward_loss` is the one place that runs the model to a loss: it applies loss parallelism, autocast (not
on an FSDP model, whose mixed-precision policy casts instead), the chunked or logits loss and the pipeline
schedule, for the train step (with a backward) and for evaluation (without). Under context parallelism it
cuts each batch along the sequence into this rank's load-balanced share first
(:mod:`titanlite.parallel.context_parallel`): the loader's batches stay whole. :func:`forward_logits` is its
loss-free sibling for benchmark scoring, under the same autocast (never under context parallelism).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titanlite.models.attention import sdpa_priority
from titanlite.parallel.context_parallel import ContextParallel
from titanlite.parallel.fsdp import is_fsdp
from titanlite.parallel.tensor_parallel import loss_parallel_context, to_local_value
from titanlite.trainer.loss import cross_entropy_sum
from titanlite.trainer.output_loss import ChunkedLoss, LogitsLoss
from titanlite.utils import dtypes

WHOLE = ("document_ids",)  # forward arguments a CP rank gets for the whole sequences (block-causal attention)


@dataclasses.dataclass(frozen=True)
class Runtime:
    """How the model runs (see the module docstring).

    - ``device``: where batches go;
    - ``parallel_dims``: a :class:`~titanlite.parallel.parallel_dims.ParallelDims`, or None for one process;
    - ``compute_dtype``: the autocast dtype (``[training] mixed_precision_param``); None or fp32: no autocast;
    - ``loss``: model outputs -> token-sum loss (:class:`~titanlite.trainer.output_loss.LogitsLoss` or
      :class:`~titanlite.trainer.output_loss.ChunkedLoss`);
    - ``pipeline``: the :class:`~titanlite.trainer.pipeline_runner.Pipeline` running this rank's stages, or None;
    - ``sdpa_kernel``: the SDPA kernel tried first (``[training] sdpa_kernel``; :func:`~titanlite.models.attention.
      sdpa_priority`), for every forward and its backward.
    """

    device: torch.device
    parallel_dims: Any = None
    compute_dtype: torch.dtype | None = None
    loss: LogitsLoss | ChunkedLoss = dataclasses.field(default_factory=lambda: LogitsLoss(cross_entropy_sum))
    pipeline: Any = None
    sdpa_kernel: str = "auto"

    @classmethod
    def of(cls, model: nn.Module, **facts: Any) -> Runtime:
        """A runtime on ``model``'s device (a foreign loop's single process), with ``facts`` set."""
        return cls(device=facts.pop("device", None) or model_device(model), **facts)

    @property
    def loss_parallel(self) -> bool:
        """Whether the loss takes vocabulary-sharded logits (tensor parallelism with loss parallel on)."""
        return getattr(self.parallel_dims, "loss_parallel_enabled", False)

    @property
    def dp_group(self) -> Any:
        return getattr(self.parallel_dims, "dp_group", None)

    @property
    def dp_degree(self) -> int:
        return getattr(self.parallel_dims, "dp_degree", 1)

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (its tensor-parallel peers share it)."""
        if self.parallel_dims is None or not dist.is_initialized():
            return 0
        return self.parallel_dims.dp_rank(dist.get_rank())

    @property
    def pp_group(self) -> Any:
        return getattr(self.parallel_dims, "pp_group", None)

    @property
    def context_parallel(self) -> ContextParallel | None:
        """This rank's context-parallel group, or None without context parallelism (or without a mesh)."""
        group = getattr(self.parallel_dims, "cp_group", None)
        if group is None:
            return None
        return ContextParallel(group, self.parallel_dims.cp, self.parallel_dims.cp_rank)

    def shard(self, batch: tuple[Any, Any, dict]) -> tuple[Any, Any, dict]:
        """``batch`` (inputs, labels, extra arguments) as this rank's share of the sequences under context
        parallelism (every ``[B, S]`` tensor cut but the document ids, which attention needs whole, and the model
        told): the batch itself without."""
        cp = self.context_parallel
        if cp is None:
            return batch
        inputs, labels, extra = batch
        extra = {k: cp.shard(v) if isinstance(v, torch.Tensor) and k not in WHOLE else v for k, v in extra.items()}
        return cp.shard(inputs), cp.shard(labels), {**extra, "context_parallel": cp.for_length(inputs.shape[1])}

    def autocast_dtype(self, model: nn.Module) -> torch.dtype | None:
        """The dtype to autocast ``model``'s forward to: None in fp32 and for an FSDP model (its policy casts)."""
        if self.compute_dtype in (None, torch.float32) or is_fsdp(model):
            return None
        return self.compute_dtype

    def autocast(self, model: nn.Module):
        """Autocast for ``model``'s forward (a null context without one, see :meth:`autocast_dtype`)."""
        return dtypes.autocast(self.device.type, self.autocast_dtype(model))


def model_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (of its local shard), CPU for a model without parameters."""
    param = next(model.parameters(), None)
    if param is None:
        return torch.device("cpu")
    return param.to_local().device if hasattr(param, "to_local") else param.device


def forward_loss(
    model: nn.Module, runtime: Runtime, batch: tuple[Any, Any, dict], loss: LogitsLoss | ChunkedLoss, divisor=None
) -> torch.Tensor:
    """The token-sum ``loss`` of one batch ``(inputs, labels, extra forward arguments)``, as a plain local tensor.

    With ``divisor`` (the step's global token count) the backward of ``loss / divisor`` runs too, under loss
    parallelism but outside autocast. Under a pipeline the schedule runs every stage (its own autocast and
    ``runtime.loss``'s chunking) and only the last stage's ranks get a non-zero sum: the caller sums over the
    pipeline group. Under context parallelism the batch is cut first (:meth:`Runtime.shard`) and the sum is
    this rank's share of the sequences': the caller sums over the context-parallel group too."""
    inputs, labels, extra = runtime.shard(batch)
    # vocabulary-sharded logits under TP; SDPA's kernel is chosen as the forward runs (or is traced)
    with loss_parallel_context(runtime.loss_parallel), sdpa_priority(runtime.sdpa_kernel):
        if runtime.pipeline is not None:
            if divisor is not None:
                return runtime.pipeline.step(inputs, labels, extra, divisor)
            return runtime.pipeline.evaluate(inputs, labels, extra, loss.loss_fn)
        with runtime.autocast(model):  # the output layer too when chunked; the loss function runs without autocast
            outputs = model(inputs, **extra, **loss.model_kwargs)
            value = loss(model, outputs, labels)
        if divisor is not None:
            (value / divisor).backward()
            value = value.detach()
    return to_local_value(value)


def forward_logits(model: nn.Module, runtime: Runtime, inputs: torch.Tensor, forward=None, **kwargs) -> torch.Tensor:
    """``model``'s whole logits ``[B, S, V]`` for ``inputs`` (``kwargs``: extra forward arguments, e.g. a KV cache),
    under the runtime's autocast, gathered when tensor parallelism leaves them sharded over the vocabulary.
    ``forward(inputs, **kwargs)`` replaces ``model(...)``: a compiled call of it."""
    with runtime.autocast(model), sdpa_priority(runtime.sdpa_kernel):
        logits = (forward or model)(inputs, **kwargs)
    return to_local_value(logits)


def eval_loss(
    model: nn.Module, runtime: Runtime, batch: tuple[Any, Any, dict], loss_fn: Callable | None = None
) -> torch.Tensor:
    """:func:`forward_loss` without gradients: ``loss_fn(logits, labels)`` (a token sum, or a vector of sums;
    default: the runtime's loss function), chunked as the runtime's loss is."""
    loss = runtime.loss if loss_fn is None else runtime.loss.with_fn(loss_fn)
    with torch.no_grad():
        return forward_loss(model, runtime, batch, loss)
