"""One optimizer step: gradient accumulation, the token-sum loss, clipping, the update.

:class:`TrainStep` owns the model, optimizer, LR schedule, loss, accumulation and clipping; the stock
loop (:class:`titanlite.train.Trainer`) calls it, and so can any other loop::

    step = TrainStep(model, optimizer, scheduler, grad_accum_steps=2, max_norm=1.0)
    for i in range(steps):
        result = step(batches)               # batches: an iterator of {"input_ids", "labels"} dicts
        print(i + 1, result.loss_value)

**The loss contract.** ``loss_fn(logits, labels)`` returns the *sum* of the per-token losses of a
micro-batch (or ``loss_fn`` is a :class:`~titanlite.output_loss.ChunkedLoss` around one: the model then returns
hidden states and the loss applies the output layer a few tokens at a time, ``[training] loss_chunks``). Each
micro-batch's sum is divided once by the number of tokens in the whole optimizer
step (every micro-batch on every data-parallel rank) before ``backward``, and FSDP sums gradients
over the data-parallel ranks instead of averaging them (:mod:`titanlite.parallel.fsdp`). So gradient
accumulation and data parallelism give exactly the update of one big batch, and the logged
``loss`` is the global token mean. A loss that adds terms (z-loss, ...) keeps the contract by
returning their sum over tokens; validation always reports plain cross-entropy.

**Pipeline parallelism** (``pipeline``, a :class:`~titanlite.parallel.pipeline.Pipeline`): each micro-batch
is one run of the schedule over the local batch (which the schedule cuts into pipeline microbatches), so
gradient accumulation composes with it. The loss exists on the last stage only; its sum is shared over the
pipeline group so that every rank logs (and the guard judges) the true loss, and the gradient norm covers
every stage's parameters.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from titanlite import dtypes
from titanlite.loss import cross_entropy_sum
from titanlite.output_loss import ChunkedLoss, LogitsLoss, as_output_loss
from titanlite.parallel.distributed import all_reduce_sum
from titanlite.parallel.fsdp import is_fsdp
from titanlite.parallel.grad_clip import clip_grad_norm_
from titanlite.parallel.tensor_parallel import loss_parallel_context, to_local_value


def grad_accum_steps(global_batch_size: int, local_batch_size: int, dp_degree: int) -> int:
    """Micro-batches per optimizer step; ``global_batch_size == -1`` means no accumulation."""
    per_pass = local_batch_size * dp_degree
    if global_batch_size == -1:
        return 1
    if global_batch_size % per_pass:
        raise ValueError(
            f"training.global_batch_size={global_batch_size} must be a multiple of local_batch_size "
            f"({local_batch_size}) x data-parallel degree ({dp_degree}) = {per_pass}"
        )
    return global_batch_size // per_pass


def batch_to_device(batch: dict[str, torch.Tensor], device: torch.device) -> tuple[Any, Any, dict[str, Any]]:
    """``(input_ids, labels, extra forward arguments)`` on ``device``; the extra one is ``document_ids``
    when the loader packs documents for block-causal attention."""

    def to(key):
        return batch[key].to(device, non_blocking=True)

    return to("input_ids"), to("labels"), ({"document_ids": to("document_ids")} if "document_ids" in batch else {})


@dataclasses.dataclass
class StepResult:
    """What one step computed. ``loss`` and ``grad_norm`` are device tensors (the global token-mean
    loss, the pre-clip total gradient norm); ``values`` holds them on the host once fetched, in the
    step's single device-to-host transfer (a ``before_update`` hook may do it, e.g. the guard)."""

    step: int | None
    loss: torch.Tensor
    grad_norm: torch.Tensor
    tokens: int  # tokens in the step, over every data-parallel rank
    lr: float  # learning rate of the first parameter group, as applied (lr_scale included)
    data_s: float  # time spent waiting for batches
    action: str = "update"  # update | skip | rollback
    lr_scale: float = 1.0
    stop_requested: bool = False
    values: tuple[float, float] | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # more metrics for the step's record
    event: Any = None  # what the guard found wrong with the step, if anything

    def fetch(self) -> tuple[float, float]:
        if self.values is None:
            loss, grad_norm = torch.stack([self.loss.float(), self.grad_norm.float().to(self.loss.device)]).tolist()
            self.values = (loss, grad_norm)
        return self.values

    @property
    def loss_value(self) -> float:
        return self.fetch()[0]

    @property
    def grad_norm_value(self) -> float:
        return self.fetch()[1]


class TrainStep:
    """Gradient accumulation, loss, clipping and the optimizer update (see the module docstring).

    - ``parallel_dims`` (a :class:`~titanlite.parallel.parallel_dims.ParallelDims`, or None for one
      process): the loss is summed over its data-parallel ranks, and computed from
      vocabulary-sharded logits when loss parallelism is on;
    - ``autocast_dtype``: run forward under autocast (bf16 from fp32 weights) when the model is not
      FSDP-wrapped; FSDP's mixed-precision policy casts instead;
    - ``max_norm``: clip the total gradient norm (exact over FSDP shards and TP ranks); 0 disables;
    - ``count_unmasked``: divide by the labels that carry loss (``!= -100``, e.g. chat data's assistant
      tokens) over the whole step instead of every label (:meth:`loss_token_count`); the count is
      reported as ``result.extra["loss_tokens"]``, ``result.tokens`` stays the tokens processed.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any = None,
        *,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | LogitsLoss | ChunkedLoss = cross_entropy_sum,
        grad_accum_steps: int = 1,
        max_norm: float = 1.0,
        parallel_dims: Any = None,
        autocast_dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        pipeline: Any = None,
        count_unmasked: bool = False,
    ):
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.loss = as_output_loss(loss_fn)  # model outputs -> token-sum loss (its logits, or chunked)
        if pipeline is None:  # a pipeline checks its last stage
            self.loss.check(model)
        self.grad_accum_steps, self.max_norm, self.parallel_dims = grad_accum_steps, max_norm, parallel_dims
        self.device = device or next(model.parameters()).device
        self.pipeline = pipeline
        self.count_unmasked = count_unmasked
        self.pp_group = getattr(parallel_dims, "pp_group", None)
        use_autocast = autocast_dtype not in (None, torch.float32) and not is_fsdp(model)
        self.autocast_dtype = autocast_dtype if use_autocast else None

    @property
    def dp_degree(self) -> int:
        return 1 if self.parallel_dims is None else self.parallel_dims.dp_degree

    def autocast(self):
        return dtypes.autocast(self.device.type, self.autocast_dtype)

    def forward_backward(self, batch: dict[str, torch.Tensor], tokens: int) -> torch.Tensor:
        """One micro-batch: backward of its token-sum loss / ``tokens``; returns the detached sum."""
        inputs, labels, extra = batch_to_device(batch, self.device)
        loss_parallel = getattr(self.parallel_dims, "loss_parallel_enabled", False)
        if self.pipeline is not None:  # the schedule runs forward and backward of every stage (autocast included)
            with loss_parallel_context(loss_parallel):
                return self.pipeline.step(inputs, labels, extra, tokens)
        with loss_parallel_context(loss_parallel):  # vocab-sharded logits under TP
            with self.autocast():  # the output layer too when chunked; the loss function runs without autocast
                outputs = self.model(inputs, **extra, **self.loss.model_kwargs)
                loss = self.loss(self.model, outputs, labels)
            (loss / tokens).backward()
        return to_local_value(loss.detach())

    def dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the data-parallel ranks, and the pipeline stages (where only the last holds the loss)."""
        group = getattr(self.parallel_dims, "loss_group", getattr(self.parallel_dims, "dp_group", None))
        return t if group is None else all_reduce_sum(t, group)

    def __call__(
        self, batches: Iterator[dict], before_update: Callable[[StepResult], None] | None = None, step=None
    ) -> StepResult:
        """Accumulate ``grad_accum_steps`` micro-batches from ``batches``, clip, call ``before_update``
        (which may skip the update), then step the optimizer and the LR schedule."""
        t0 = time.perf_counter()
        micro = [next(batches) for _ in range(self.grad_accum_steps)]
        data_s = time.perf_counter() - t0
        tokens = sum(b["labels"].numel() for b in micro) * self.dp_degree
        divisor = self.loss_token_count(micro) if self.count_unmasked else tokens
        loss_sum = torch.zeros((), device=self.device)
        for batch in micro:
            loss_sum += self.forward_backward(batch, divisor)
        grad_norm = self.clip_grad_norm()
        lr = self.optimizer.param_groups[0]["lr"]
        result = StepResult(step, self.dp_sum(loss_sum) / divisor, grad_norm, tokens, lr, data_s)
        if self.count_unmasked:
            result.extra["loss_tokens"] = divisor
        if "source_counts" in micro[0]:  # a mixture: tokens of each source in the step, over every rank
            windows = sum(b["source_counts"].sum(0) for b in micro)
            result.extra["source_tokens"] = (windows * micro[0]["labels"].shape[-1]).tolist()
        if before_update is not None:
            before_update(result)
        result.lr = lr * result.lr_scale
        if result.action == "update":
            self.update(result.lr_scale)
        self.optimizer.zero_grad(set_to_none=True)
        return result

    def loss_token_count(self, micro: list[dict]) -> int:
        """Labels that carry loss (``!= -100``) over every micro-batch of the step and every data-parallel
        rank: one scalar all-reduce before the first backward, so each micro-batch's sum is divided by
        the global count and accumulation + DP equal one big batch whatever each batch's share. At least
        1, so a step whose labels are all masked contributes a zero loss instead of NaN."""
        local = sum(int((b["labels"] != -100).sum()) for b in micro)
        group = getattr(self.parallel_dims, "dp_group", None)
        if group is not None:
            local = int(all_reduce_sum(torch.tensor(local, dtype=torch.int64, device=self.device), group).item())
        return max(local, 1)

    def clip_grad_norm(self) -> torch.Tensor:
        """Pre-clip total gradient norm (exact over FSDP shards, TP ranks and pipeline stages); clips when
        ``max_norm > 0``."""
        return clip_grad_norm_(self.model.parameters(), self.max_norm, pp_group=self.pp_group)

    def update(self, lr_scale: float = 1.0) -> None:
        """``optimizer.step()`` (learning rates scaled by ``lr_scale`` for this step only), then the schedule."""
        groups = self.optimizer.param_groups
        lrs = [g["lr"] for g in groups]
        if lr_scale != 1.0:
            for g in groups:
                g["lr"] = g["lr"] * lr_scale
        self.optimizer.step()
        for g, lr in zip(groups, lrs):
            g["lr"] = lr
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
