"""How a (possibly sharded) model gets its initial weights (``[parallelism] weight_init``).

- ``sharded``: ``init_weights()`` runs on every rank on its shards only. With CUDA meshes DTensor's
  RNG tracker gives each shard its own part of the random stream, so the full tensors are properly
  random, though not equal to a one-process init with the same seed.
- ``rank0``: rank 0 builds and initializes a full copy on the CPU, exactly as a single CPU process
  does with the same seed, and every rank then loads its shards from it (a broadcast). Same
  weights as a one-process CPU run (a one-GPU run draws from the CUDA generator, so its numbers
  differ), at the cost of one full copy in rank 0's host memory (devices only ever hold their
  shards). The only correct choice on CPU meshes: there DTensor has no RNG tracker and
  every shard would get the *same* random values (TP heads identical, FSDP rows repeated).
- ``auto``: ``sharded`` on CUDA, ``rank0`` elsewhere. Unsharded models always use ``init_weights``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

MODES = ("auto", "sharded", "rank0")


def resolve_weight_init(mode: str, sharded: bool, device_type: str) -> str:
    """``"local"`` (plain init, unsharded model), ``"sharded"`` or ``"rank0"``."""
    if mode not in MODES:
        raise ValueError(f"parallelism.weight_init={mode!r} must be one of {', '.join(MODES)}")
    if not sharded:
        return "local"
    if mode == "auto":
        return "sharded" if device_type == "cuda" else "rank0"
    if mode == "sharded" and device_type != "cuda":
        logger.warning(
            "parallelism.weight_init = sharded on %s: DTensor has no random-number tracker there, "
            "so shards of one tensor get identical values; use rank0 (the default)",
            device_type,
        )
    return mode


def reference_state_dict(model_cls: Callable[[Any], nn.Module], model_args: Any) -> dict[str, torch.Tensor]:
    """State dict of a full CPU model initialized as a single process would (meta -> CPU -> init)."""
    with torch.device("meta"):
        model = model_cls(model_args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    return model.state_dict()
