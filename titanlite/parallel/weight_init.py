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
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from titanlite.errors import ConfigError

logger = logging.getLogger(__name__)

MODES = ("auto", "sharded", "rank0")


def resolve_weight_init(mode: str, sharded: bool, device_type: str) -> str:
    """``"local"`` (plain init, unsharded model), ``"sharded"`` or ``"rank0"``."""
    if mode not in MODES:
        raise ConfigError(f"parallelism.weight_init={mode!r} must be one of {', '.join(MODES)}")
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


def tied_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one tensor (e.g. ``["tok_embeddings.weight", "output.weight"]``)."""
    names: dict[int, list[str]] = defaultdict(list)
    for name, p in model.named_parameters(remove_duplicate=False):
        names[id(p)].append(name)
    return [group for group in names.values() if len(group) > 1]


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, leaf = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), leaf


def retie(model: nn.Module, groups: list[list[str]]) -> int:
    """Make each group share its first name's parameter again; returns how many were re-tied."""
    n = 0
    for first, *rest in groups:
        shared = model.get_parameter(first)
        for name in rest:
            if model.get_parameter(name) is not shared:
                module, leaf = _owner(model, name)
                setattr(module, leaf, shared)
                n += 1
    return n


def reference_state_dict(model_cls: Callable[[Any], nn.Module], model_args: Any) -> dict[str, torch.Tensor]:
    """State dict of a full CPU model initialized as a single process would (meta -> CPU -> re-tie -> init).

    Re-tied like the model itself (``to_empty`` unties shared parameters): otherwise a family whose
    ``init_weights`` writes only one name of a tied pair (the embedding) would leave the other (the output)
    as uninitialized memory, which loading the state dict then writes over the initialized tensor."""
    with torch.device("meta"):
        model = model_cls(model_args)
    tied = tied_parameters(model)
    model.to_empty(device="cpu")
    retie(model, tied)
    with torch.no_grad():
        model.init_weights()
    return model.state_dict()
