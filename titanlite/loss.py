"""Loss: summed token cross-entropy, divided by the global token count by the caller.

Summing per micro-batch and dividing once by the number of tokens in the whole optimizer step (all
micro-batches, all data-parallel ranks) makes gradient accumulation and data parallelism give
exactly the gradient of one big batch: no mean-of-means when micro-batches differ in size
(:mod:`titanlite.train_step`). Registered as the ``[training] loss`` named ``cross_entropy``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titanlite.components import register


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of the cross-entropy, computed in float32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")


register("loss", "cross_entropy", cross_entropy_sum)
