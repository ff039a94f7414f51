"""Scaling one config from a CPU process to many GPUs: each module is one concept.

- ``distributed``: process group from torchrun's environment, collective timeouts.
- ``parallel_dims``: the ``[parallelism]`` degrees, their checks, the named device mesh.
- ``float8``: native ``Float8Linear`` (``torch._scaled_mm``, tensorwise scaling).
- ``tensor_parallel``: loss-parallel context and DTensor helpers (plans live with each model).
- ``activation_checkpoint``, ``compile``, ``fsdp``: the per-block policies, each with ``apply``.
- ``weight_init``, ``state_dict``: initializing / loading full weights into a sharded model.
- ``grad_clip``: gradient-norm clipping exact over FSDP shards and TP ranks.

``models/<family>/parallelize.py`` combines them, in order, for one model family.
"""
