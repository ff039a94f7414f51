"""FSDP2 (``fully_shard``) policy: mixed precision, resharding, and *summed* gradients.

- Mixed precision (``[training] mixed_precision_param/reduce``, replacing autocast): sharded parameters, what the
  optimizer sees, stay fp32; the gathered copies are in ``param_dtype``, gradients reduce-scattered in
  ``reduce_dtype``.
- ``fsdp_reshard_after_forward``: ``default`` frees every group's gathered parameters after its forward except
  the last group's (backward needs it at once); ``always``/``never`` apply to all.
- Gradient reduction is a SUM, not FSDP2's mean: the loss is already a token *sum* divided by the step's global
  token count (``titanlite.trainer.loss``), so the ranks' gradients must be added. ``gradient_divide_factor = 1``
  with ``force_sum_reduction_for_comms`` gives plain ``ReduceOp.SUM`` with no division: exact on NCCL and on gloo,
  which has no ``PREMUL_SUM``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from titanlite.errors import ConfigError
from titanlite.parallel.float8_fsdp import wrap_float8_weights

RESHARD_CHOICES = ("default", "always", "never")


class FSDPPolicy:
    """How the model is sharded; :meth:`shard` each group bottom-up, then :meth:`finish` the root."""

    def __init__(
        self,
        mesh: DeviceMesh,
        param_dtype: torch.dtype = torch.float32,
        reduce_dtype: torch.dtype = torch.float32,
        reshard_after_forward: str = "default",
        float8_all_gather: bool = False,
    ):
        if reshard_after_forward not in RESHARD_CHOICES:
            raise ConfigError(
                f"parallelism.fsdp_reshard_after_forward={reshard_after_forward!r} must be one of "
                f"{', '.join(RESHARD_CHOICES)}"
            )
        self.mesh = mesh
        self.mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        self.reshard = reshard_after_forward
        self.float8_all_gather = float8_all_gather  # Float8Linear weights all-gathered in float8 (float8_fsdp)

    def _reshard(self, last: bool) -> bool:
        return {"default": not last, "always": True, "never": False}[self.reshard]

    def shard(
        self, modules: nn.Module | Sequence[nn.Module], last: bool = False, mesh: DeviceMesh | None = None, dim: int = 0
    ) -> None:
        """One FSDP group (one all-gather / reduce-scatter) for ``modules``' not-yet-sharded params, over this
        policy's mesh (or ``mesh``, e.g. the experts' under expert parallelism), each sharded on dimension ``dim``."""
        placement = None if dim == 0 else (lambda p: Shard(dim))
        if self.float8_all_gather:
            wrap_float8_weights(modules, self.mp_policy.param_dtype or torch.float32)
        fully_shard(
            modules,
            mesh=mesh or self.mesh,
            mp_policy=self.mp_policy,
            reshard_after_forward=self._reshard(last),
            shard_placement_fn=placement,
        )

    def finish(self, model: nn.Module) -> nn.Module:
        """Shard the root (remaining parameters, lazy-init point) and make every group SUM its gradients
        over the data-parallel ranks, with no division."""
        self.shard(model)
        sum_gradients(model)
        return model


def sum_gradients(model: nn.Module) -> int:
    """Make every FSDP group of ``model`` (and of its pipeline ``stages``) SUM its gradients over the data-parallel
    ranks with no division (FSDP2's default is their mean); returns how many groups did not already."""
    changed = 0
    for root in [model, *getattr(model, "stages", ())]:
        for m in root.modules():
            if isinstance(m, FSDPModule):
                groups = getattr(m._get_fsdp_state(), "_fsdp_param_groups", ())
                changed += sum(g.gradient_divide_factor != 1.0 or not g.force_sum_reduction_for_comms for g in groups)
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
    return changed


@contextlib.contextmanager
def quiet_view_warning():
    """Silence FSDP2's warning that a wrapped module returned a view, inside: the tensor-parallel embedding returns
    one (``DTensor.to_local``), which titanlite's models only use out of place, as the warning asks."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
        yield


def is_fsdp(model: nn.Module) -> bool:
    """Whether FSDP wraps ``model`` (or, for pipeline stages merged in one module, its stages)."""
    return any(isinstance(m, FSDPModule) for m in [model, *getattr(model, "stages", ())])
