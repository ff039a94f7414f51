"""Validation: mean token cross-entropy on held-out windows, and its place in the training loop.

Always plain cross-entropy, whatever the training loss adds (z-loss, ...), in high precision for
float8 linears, over the same windows every time (the validation loader restarts from its first
window), summed over the data-parallel ranks, so the figure does not depend on the layout.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from titanlite.hooks import Hook, LoopState
from titanlite.loss import cross_entropy_sum
from titanlite.parallel.distributed import all_reduce_sum
from titanlite.parallel.float8 import float8_disabled
from titanlite.parallel.tensor_parallel import loss_parallel_context, to_local_value
from titanlite.train_step import batch_to_device

logger = logging.getLogger("titanlite")


@torch.no_grad()
def validation_loss(
    model: nn.Module,
    batches: Iterable[dict],
    *,
    max_batches: int | None = None,
    parallel_dims: Any = None,
    device: torch.device | None = None,
    autocast_dtype: torch.dtype | None = None,
    pipeline: Any = None,
) -> dict[str, float]:
    """``{"val_loss", "val_perplexity"}`` over ``max_batches`` batches (None: all) of ``batches``; with
    ``pipeline`` (a :class:`~titanlite.parallel.pipeline.Pipeline`) through its schedule's evaluation mode."""
    device = device or next(model.parameters()).device
    dp_group = None if parallel_dims is None else parallel_dims.dp_group
    loss_parallel = getattr(parallel_dims, "loss_parallel_enabled", False)
    autocast = (
        torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    )
    model.eval()
    loss_sum = torch.zeros((), device=device)
    tokens = torch.zeros((), device=device)
    # islice stops without pulling one batch too many: every layout consumes the same windows
    for batch in batches if max_batches is None else itertools.islice(batches, max_batches):
        inputs, labels, extra = batch_to_device(batch, device)
        with loss_parallel_context(loss_parallel), float8_disabled(model):
            if pipeline is not None:  # the sum exists on the last stage only: shared below; the stages autocast
                loss_sum += pipeline.evaluate(inputs, labels, extra, cross_entropy_sum)
            else:
                with autocast:
                    logits = model(inputs, **extra)
                loss_sum += to_local_value(cross_entropy_sum(logits, labels))
        tokens += labels.numel()
    model.train()
    if pipeline is not None and parallel_dims.pp_group is not None:
        loss_sum = all_reduce_sum(loss_sum, parallel_dims.pp_group)
    if dp_group is not None:
        loss_sum, tokens = all_reduce_sum(loss_sum, dp_group), all_reduce_sum(tokens, dp_group)
    val_loss = (loss_sum / tokens).item()
    return {"val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 80.0))}


class ValidationHook(Hook):
    """``[validation]`` in the loop: ``evaluate()`` every ``freq`` steps and at the last step."""

    def __init__(self, section: Any, evaluate: Callable[[], dict[str, float]]):
        self.freq, self.evaluate = section.freq, evaluate

    def on_step_end(self, state: LoopState, result: Any) -> None:
        if state.step % self.freq == 0 or state.last_step:
            val = {"step": state.step, **self.evaluate()}
            state.log(val)
            logger.info(
                "step %d | validation loss %.4f | perplexity %.2f", state.step, val["val_loss"], val["val_perplexity"]
            )
