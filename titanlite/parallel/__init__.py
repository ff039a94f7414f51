"""Scaling one config from a CPU process to many GPUs: each module is one concept.

- ``distributed``: process group from torchrun's environment, collective timeouts.
- ``parallel_dims``: the ``[parallelism]`` degrees, their checks, the named device mesh.
- ``build``: :func:`build_parallel_model`, a family's model parallelized and initialized on every rank.
- ``policies``: what a family's ``parallelize_fn`` applies: float8, activation checkpointing,
  compile, FSDP mixed precision; ``float8``, ``activation_checkpoint``, ``compile``, ``fsdp``:
  each policy, with ``apply``.
- ``tensor_parallel``: loss-parallel context and DTensor helpers (plans live with each model).
- ``weight_init``, ``state_dict``: initializing / loading full weights into a sharded model.
- ``grad_clip``: gradient-norm clipping exact over FSDP shards and TP ranks.

``models/<family>/parallelize.py`` combines them, in order, for one model family.
"""

from titanlite.parallel.build import build_parallel_model
from titanlite.parallel.distributed import WorldInfo, init_distributed, world_from_env
from titanlite.parallel.parallel_dims import ParallelDims
from titanlite.parallel.policies import Policies

__all__ = ["ParallelDims", "Policies", "WorldInfo", "build_parallel_model", "init_distributed", "world_from_env"]
