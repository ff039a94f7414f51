"""Applying parallelism and training wrappers to a Llama 3 model (single process for now)."""
from __future__ import annotations

from torch import nn


def parallelize_llama(model: nn.Module, parallel_dims, job_config) -> nn.Module:
    if parallel_dims.world_size > 1:
        raise NotImplementedError("multi-process training needs the parallelism module")
    return model
