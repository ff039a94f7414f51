"""One optimizer step: gradient accumulation, the token-sum loss, clipping, the update.

:class:`TrainStep` owns the model, optimizer, LR schedule, loss, accumulation and clipping; the stock
loop (:class:`titanlite.trainer.Trainer`) calls it, and so can any other loop::

    step = TrainStep(model, optimizer, scheduler, grad_accum_steps=2, max_norm=1.0)
    for i in range(steps):
        result = step(batches)               # batches: an iterator of {"input_ids", "labels"} dicts
        print(i + 1, result.loss_value)

The loss contract (a token sum, divided once by the step's global token count, so accumulation and data
parallelism give exactly one big batch's update) is docs/library.md's; the step's one all-reduce and the clipping
inside the fused optimizer's kernel are docs/configuration.md's ("The optimizer step"). What the code below
relies on beyond them:

- a loss that adds terms (z-loss, ...) keeps the contract by returning their sum over tokens; mixture-of-experts
  layers' aux / z losses too (the step sets their token count), and after the update the layers' loads, summed
  over the ranks, move the aux-loss-free biases and give the step's ``moe/*`` metrics (``result.extra``);
- under pipeline parallelism (``pipeline``) each micro-batch is one run of the schedule over the local batch, so
  accumulation composes with it; the loss exists on the last stage only and its sum is shared over the pipeline
  group, so every rank logs (and the guard judges) the true loss;
- the gradients a ``before_update`` hook sees are not yet clipped: the clipping factor stays on the device
  until :meth:`TrainStep.update`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titanlite.errors import ConfigError
from titanlite.models.moe import MoEStep
from titanlite.parallel.distributed import all_reduce_sum
from titanlite.parallel.fsdp import sum_gradients
from titanlite.parallel.grad_clip import WorldLayout, clip_coefficient, clip_grad_norm_, grad_square_sum, scale_grads_
from titanlite.trainer.output_loss import ChunkedLoss, LogitsLoss
from titanlite.trainer.runtime import Runtime, eval_loss, forward_loss

logger = logging.getLogger(__name__)

LOSS_DIMS = ("dp_replicate", "dp_shard", "cp")  # world dims along which ranks hold different loss sums (and the stages)


def grad_accum_steps(global_batch_size: int, local_batch_size: int, dp_degree: int) -> int:
    """Micro-batches per optimizer step; ``global_batch_size == -1`` means no accumulation."""
    per_pass = local_batch_size * dp_degree
    if global_batch_size == -1:
        return 1
    if global_batch_size % per_pass:
        raise ConfigError(
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
    stop_flag: torch.Tensor | None = None  # the stop request, agreed over every rank by the step's reduction
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

    - ``runtime`` (a :class:`~titanlite.trainer.runtime.Runtime`; default: one process on the model's device,
      the built-in cross-entropy): the device, the parallel dims (the loss is summed over the data-parallel ranks,
      and computed from vocabulary-sharded logits when loss parallelism is on), the compute dtype (the forward runs
      under autocast when the model is not FSDP-wrapped; FSDP's mixed-precision policy casts instead), the output
      loss and the pipeline;
    - ``max_norm``: clip the total gradient norm (exact over FSDP shards and TP ranks); 0 disables;
    - ``count_unmasked``: divide by the labels that carry loss (``!= -100``, e.g. chat data's assistant
      tokens) over the whole step instead of every label (:meth:`loss_token_count`); the count is
      reported as ``result.extra["loss_tokens"]``, ``result.tokens`` stays the tokens processed. A step
      with no such label on any rank is skipped with a warning (``result.action = "skip"``, loss NaN): no
      forward, no update (weight decay included), no LR-schedule step, no ``before_update`` hooks;
    - ``stop_requested``: read once per step and agreed over every rank in the step's reduction
      (``result.stop_flag``), e.g. the preemption handler's flag.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any = None,
        runtime: Runtime | None = None,
        *,
        grad_accum_steps: int = 1,
        max_norm: float = 1.0,
        count_unmasked: bool = False,
        stop_requested: Callable[[], bool] | None = None,
    ):
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.runtime = runtime or Runtime.of(model)
        if self.pipeline is None:  # a pipeline checks its last stage
            self.loss.check(model)
        self.grad_accum_steps, self.max_norm = grad_accum_steps, max_norm
        self.count_unmasked = count_unmasked
        self.moe = MoEStep.find(model, getattr(self.parallel_dims, "loss_group", None))  # None: a dense model
        self.stop_requested = stop_requested
        self.world = self._world_layout()
        self.fold_clip = getattr(optimizer, "_step_supports_amp_scaling", False)  # a fused kernel takes grad_scale
        self._sum_fsdp_gradients()

    def _sum_fsdp_gradients(self) -> None:
        """Each rank's gradient is its share of the global token mean, so data-parallel FSDP groups must SUM the
        shares: a model sharded by ``fully_shard`` itself averages them (half the norm on 2 ranks), set to SUM here."""
        ranks = getattr(self.parallel_dims, "fsdp_degree", self.dp_degree)  # the context-parallel ranks too
        if ranks > 1 and (changed := sum_gradients(self.model)):
            logger.info(
                f"TrainStep: {changed} FSDP groups averaged their gradients over {ranks} data- and context-parallel "
                "ranks; set to sum them (each rank's gradient is its share of the global token mean)"
            )

    @property
    def loss(self) -> LogitsLoss | ChunkedLoss:
        """Model outputs -> token-sum loss (from its logits, or chunked through the output layer)."""
        return self.runtime.loss

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def parallel_dims(self) -> Any:
        return self.runtime.parallel_dims

    @property
    def pipeline(self) -> Any:
        return self.runtime.pipeline

    @property
    def pp_group(self) -> Any:
        return self.runtime.pp_group

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The forward's autocast dtype (None: none, e.g. fp32 or an FSDP model)."""
        return self.runtime.autocast_dtype(self.model)

    def _world_layout(self) -> WorldLayout | None:
        """How to count replicas in the step's reduction; None when processes run without a known mesh (a
        foreign loop's own process group): the norm and the loss are then reduced the mesh-agnostic way."""
        mesh = getattr(self.parallel_dims, "mesh", None)
        if mesh is None and dist.is_initialized() and dist.get_world_size() > 1:
            return None
        if mesh is not None and not {"dp_replicate", "dp_shard"} <= set(mesh.mesh_dim_names or ()):
            return None  # not ParallelDims' named mesh: which ranks hold the same loss is unknown
        return WorldLayout(mesh)

    @property
    def dp_degree(self) -> int:
        return self.runtime.dp_degree

    def autocast(self):
        return self.runtime.autocast(self.model)

    def forward_backward(self, batch: dict[str, torch.Tensor], tokens: int) -> torch.Tensor:
        """One micro-batch: backward of its token-sum loss / ``tokens``; returns the detached sum."""
        return forward_loss(self.model, self.runtime, batch_to_device(batch, self.device), self.loss, divisor=tokens)

    @torch.no_grad()
    def eval_step(self, batch: dict[str, torch.Tensor], loss_fn: Callable | None = None) -> torch.Tensor:
        """One batch's token-sum ``loss_fn(logits, labels)`` (default: the training loss's function), forward only
        and chunked as the training loss (:func:`~titanlite.trainer.runtime.eval_loss`)."""
        return eval_loss(self.model, self.runtime, batch_to_device(batch, self.device), loss_fn)

    def set_grad_accum_steps(self, steps: int) -> None:
        """Accumulate ``steps`` micro-batches per step from the next call on (a ``seq_len_schedule`` stage)."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"grad_accum_steps must be an integer >= 1, got {steps!r}")
        self.grad_accum_steps = steps

    def dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the data-parallel ranks, and the pipeline stages (where only the last holds the loss)."""
        group = getattr(self.parallel_dims, "loss_group", getattr(self.parallel_dims, "dp_group", None))
        return t if group is None else all_reduce_sum(t, group)

    def __call__(
        self, batches: Iterator[dict], before_update: Callable[[StepResult], None] | None = None, step=None
    ) -> StepResult:
        """Accumulate ``grad_accum_steps`` micro-batches from ``batches``, reduce the step's loss, gradient
        norm and stop request (:meth:`reduce_step`), call ``before_update`` (which may skip the update), then
        clip and step the optimizer (:meth:`update`) and the LR schedule."""
        t0 = time.perf_counter()
        micro = [next(batches) for _ in range(self.grad_accum_steps)]
        data_s = time.perf_counter() - t0
        tokens = sum(b["labels"].numel() for b in micro) * self.dp_degree
        divisor = self.loss_token_count(micro) if self.count_unmasked else tokens
        if divisor == 0:  # every label masked on every rank: nothing to learn from, and nothing may move
            return self.skip_empty_step(step, tokens, data_s)
        if self.moe is not None:
            self.moe.begin_step(tokens)
        loss_sum = torch.zeros((), device=self.device)
        for batch in micro:
            loss_sum += self.forward_backward(batch, divisor)
        loss_sum, grad_norm, stop_flag = self.reduce_step(loss_sum)
        lr = self.optimizer.param_groups[0]["lr"]
        result = StepResult(step, loss_sum / divisor, grad_norm, tokens, lr, data_s, stop_flag=stop_flag)
        if self.count_unmasked:
            result.extra["loss_tokens"] = divisor
        if "source_counts" in micro[0]:  # a mixture: tokens of each source in the step, over every rank
            windows = sum(b["source_counts"].sum(0) for b in micro)
            result.extra["source_tokens"] = (windows * micro[0]["labels"].shape[-1]).tolist()
        if before_update is not None:
            before_update(result)
        result.lr = lr * result.lr_scale
        if result.action == "update":
            self.update(result.lr_scale, grad_norm)
        if self.moe is not None:  # after the update: the biases move with it (not on a skipped step)
            result.extra.update(self.moe.end_step(updated=result.action == "update"))
        self.optimizer.zero_grad(set_to_none=True)
        return result

    def loss_token_count(self, micro: list[dict]) -> int:
        """Labels that carry loss (``!= -100``) over every micro-batch of the step and every data-parallel
        rank: one scalar all-reduce before the first backward, so each micro-batch's sum is divided by
        the global count and accumulation + DP equal one big batch whatever each batch's share. Every
        rank gets the same count, so a count of 0 skips the step on all of them."""
        local = sum(int((b["labels"] != -100).sum()) for b in micro)
        group = getattr(self.parallel_dims, "dp_group", None)
        if group is not None:
            local = int(all_reduce_sum(torch.tensor(local, dtype=torch.int64, device=self.device), group).item())
        return local

    def skip_empty_step(self, step: int | None, tokens: int, data_s: float) -> StepResult:
        """The result of a step whose labels are all masked (see the class docstring)."""
        where = f"step {step}" if step is not None else "a step"
        logger.warning(
            f"{where}: no label carries loss in the whole step (every token masked, e.g. chat data with no "
            "assistant token in these windows): skipped, no update"
        )
        self.optimizer.zero_grad(set_to_none=True)
        nan, zero = torch.full((), float("nan"), device=self.device), torch.zeros((), device=self.device)
        lr = self.optimizer.param_groups[0]["lr"]
        result = StepResult(step, nan, zero, tokens, lr, data_s, action="skip", extra={"loss_tokens": 0})
        result.values = (float("nan"), 0.0)
        return result

    def reduce_step(self, loss_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(loss sum, total gradient norm, stop flag)`` of the step, each the same on every rank: one SUM
        all-reduce over the world of each rank's loss sum (counted once per data-parallel rank and stage: the
        TP peers hold the same), its owned share of the squared gradient norm, and its stop request. Without
        a known mesh (``world`` None) the loss and the norm are reduced separately and the flag is None."""
        if self.world is None:
            norm = clip_grad_norm_(self.model.parameters(), 0.0, pp_group=self.pp_group)
            return self.dp_sum(loss_sum), norm.to(loss_sum.device), None
        square = grad_square_sum(self.model.parameters(), self.world)
        loss_part = loss_sum.float() if self.world.counts(LOSS_DIMS) else torch.zeros((), device=loss_sum.device)
        stop = self.stop_requested is not None and self.stop_requested()
        parts = [loss_part, torch.zeros((), device=loss_sum.device) if square is None else square.to(loss_sum.device)]
        values = torch.stack([*parts, torch.full((), float(stop), device=loss_sum.device)])
        if self.world.distributed:
            dist.all_reduce(values)
        return values[0], values[1].sqrt(), values[2]

    def update(self, lr_scale: float = 1.0, grad_norm: torch.Tensor | None = None) -> None:
        """``optimizer.step()`` (learning rates scaled by ``lr_scale`` for this step only), then the schedule.
        With ``grad_norm`` (the total norm from :meth:`reduce_step`) and ``max_norm > 0`` the gradients are
        clipped: inside a fused optimizer's kernel (``grad_scale = 1 / factor``), else by one multi-tensor
        multiply first."""
        groups = self.optimizer.param_groups
        lrs = [g["lr"] for g in groups]
        if lr_scale != 1.0:
            for g in groups:
                g["lr"] = g["lr"] * lr_scale
        clip = None if grad_norm is None or self.max_norm <= 0 else clip_coefficient(grad_norm, self.max_norm)
        if clip is not None and self.fold_clip:
            self.optimizer.grad_scale = clip.reciprocal()  # read by torch's fused Adam/AdamW/SGD step
        elif clip is not None:
            scale_grads_(self.model.parameters(), clip)
        try:
            self.optimizer.step()
        finally:
            self.optimizer.__dict__.pop("grad_scale", None)
        for g, lr in zip(groups, lrs):
            g["lr"] = lr
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
