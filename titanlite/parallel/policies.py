"""What a family's ``parallelize_fn(model, parallel_dims, policies)`` applies besides the mesh.

One small policy per concern, each with ``apply``: float8 linears, activation checkpointing,
per-block compile, and FSDP2's mixed precision and resharding. :meth:`Policies.from_config` reads
them from their own config sections; a foreign trainer builds them directly, e.g.
``Policies(activation_checkpoint=ActivationCheckpoint("full"), param_dtype=torch.bfloat16)``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from titanlite.parallel.activation_checkpoint import ActivationCheckpoint
from titanlite.parallel.compile import CompilePolicy
from titanlite.parallel.float8 import Float8Policy
from titanlite.parallel.fsdp import FSDPPolicy
from titanlite.utils.dtypes import DTYPES


@dataclasses.dataclass
class Policies:
    float8: Float8Policy = dataclasses.field(default_factory=Float8Policy)
    activation_checkpoint: ActivationCheckpoint = dataclasses.field(default_factory=ActivationCheckpoint)
    compile: CompilePolicy = dataclasses.field(default_factory=CompilePolicy)
    param_dtype: torch.dtype = torch.float32  # FSDP's compute copies (autocast without FSDP)
    reduce_dtype: torch.dtype = torch.float32  # FSDP's gradient reduction
    reshard_after_forward: str = "default"

    @classmethod
    def from_config(cls, parallelism, training, activation_checkpoint, compile, float8) -> Policies:
        """From ``[parallelism]``, ``[training]``, ``[activation_checkpoint]``, ``[compile]`` and
        ``[quantize.linear.float8]``."""
        return cls(
            float8=Float8Policy.from_config(float8),
            activation_checkpoint=ActivationCheckpoint.from_config(activation_checkpoint),
            compile=CompilePolicy.from_config(
                compile, getattr(parallelism, "context_parallel_degree", 1) > 1, training.sdpa_kernel
            ),
            param_dtype=DTYPES[training.mixed_precision_param],
            reduce_dtype=DTYPES[training.mixed_precision_reduce],
            reshard_after_forward=parallelism.fsdp_reshard_after_forward,
        )

    def fsdp(self, parallel_dims) -> FSDPPolicy | None:
        """The FSDP policy over ``parallel_dims``' data-parallel mesh, or None with one data-parallel rank.

        Under pipeline parallelism ``default`` keeps the gathered parameters after forward: a stage runs the
        forwards of several microbatches before their backwards, and would gather each block again for each
        (torchtitan makes the same choice)."""
        if not parallel_dims.fsdp_enabled:
            return None
        reshard = self.reshard_after_forward
        if reshard == "default" and getattr(parallel_dims, "pp_enabled", False):
            reshard = "never"
        float8_all_gather = self.float8.enable and self.float8.enable_fsdp_float8_all_gather
        return FSDPPolicy(parallel_dims.fsdp_mesh, self.param_dtype, self.reduce_dtype, reshard, float8_all_gather)

    def apply_single_device(self, model: nn.Module) -> None:
        """Float8, AC and compile for a family without a parallelize function (one process only)."""
        self.float8.apply(model)
        if self.activation_checkpoint.mode != "none" or self.compile.model:
            if not isinstance(getattr(model, "layers", None), nn.ModuleDict):
                raise ValueError("activation checkpointing and compile need the model's blocks in model.layers")
            self.activation_checkpoint.apply(model)
            self.compile.apply(model)
