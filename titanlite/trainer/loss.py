"""Loss: summed token cross-entropy (the built-in ``[training] loss`` ``cross_entropy``), which the caller divides
once by the number of tokens in the whole optimizer step (all micro-batches and data-parallel ranks), so that
accumulation and data parallelism give exactly one big batch's gradient (:mod:`titanlite.trainer.step`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of the cross-entropy, computed in float32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")


def cross_entropy_sum_and_grad(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cross_entropy_sum(logits, labels), its gradient with respect to logits)``, computed together without
    autograd: the fp32 log-softmax, then its exponential in place as the softmax, minus one at each target and
    zero at masked labels (-100), in the logits' dtype (as autograd's). Two passes over the logits where autograd
    makes four, at the same values; for the chunked output loss (:mod:`titanlite.trainer.output_loss`)."""
    log_probs = torch.log_softmax(logits.flatten(0, -2).float(), dim=-1)
    flat = labels.flatten()
    valid, targets = flat != -100, flat.clamp(min=0)[:, None]
    loss = torch.where(valid, log_probs.gather(1, targets).squeeze(1), 0.0).sum().neg()
    grad = log_probs.exp_()
    grad.scatter_add_(1, targets, torch.full(targets.shape, -1.0, dtype=grad.dtype, device=grad.device))
    grad.masked_fill_(~valid[:, None], 0.0)
    return loss, grad.to(logits.dtype).view(logits.shape)
