"""Loading a full (unsharded) state dict into a possibly sharded model.

``load_full_state_dict(model, full)`` takes a plain ``{name: tensor}`` state dict that only rank 0
needs to hold (other ranks pass ``{}`` or None) and copies it into ``model``'s parameters and
persistent buffers, whatever their sharding (FSDP2, TP or both as DTensors, or plain tensors): rank 0
broadcasts each tensor and every rank keeps its own shard. Used for:

- a *seed* state dict: identical starting weights for runs with different parallelisms (parity
  tests, and ``[parallelism] weight_init = "rank0"``);
- an initial checkpoint in Hugging Face or torch format (``initial_load_path``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor


@torch.no_grad()
def load_full_state_dict(
    model: nn.Module, full_state_dict: dict[str, torch.Tensor] | None, strict: bool = True
) -> None:
    """Copy a full state dict (needed on rank 0 only) into ``model`` (sharded or not), in place.

    Parameter objects keep their identity, so an optimizer built before the call stays valid. A rank's
    pipeline stages (a ``ModelParts``, with ``stages``) hold a slice of the keys: every key is broadcast
    and each rank keeps its own (not strict, since rank 0's dict holds the other stages' keys too).
    """
    strict = strict and not hasattr(model, "stages")
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if not distributed and not any(isinstance(p, DTensor) for p in model.parameters()):
        model.load_state_dict(full_state_dict or {}, strict=strict)
        return
    # a shallow copy: set_model_state_dict adds entries to the dict it is given
    full_state_dict = dict(full_state_dict or {}) if dist.get_rank() == 0 else {}
    set_model_state_dict(
        model, full_state_dict, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    )
