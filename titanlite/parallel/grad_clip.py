"""Gradient-norm clipping that is exact for sharded (DTensor) gradients.

With FSDP each rank holds a slice of every gradient, with TP a slice of some and a replica of
others (the sequence-parallel norm weights). The total norm is computed per group of gradients
that share a mesh and placements (``DTensor`` norms then reduce over the sharded dimensions only,
so replicated gradients are not counted twice), each group's norm is made a plain tensor with
``full_tensor()``, and the groups' norms are combined. With pipeline parallelism each stage holds
other parameters, so the stages' norms are gathered and combined too (``pp_group``). The result
equals the norm of the full gradients in one process (up to summation order), on every rank.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    foreach: bool = True,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Total gradient norm (a plain tensor, before clipping, over every pipeline stage of ``pp_group``);
    scales gradients when ``max_norm > 0``."""
    groups: dict = defaultdict(list)  # (mesh, placements) of DTensor gradients, None for plain ones
    for p in parameters:
        if isinstance(p.grad, DTensor):
            groups[id(p.grad.device_mesh), tuple(p.grad.placements)].append(p)
        elif p.grad is not None:
            groups[None].append(p)
    norms = []
    for members in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in members], norm_type, foreach=foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms and pp_group is None:
        return torch.zeros(())
    device = norms[0].device if norms else torch.device("cpu")
    total = torch.nn.utils.get_total_norm([n.to(device) for n in norms], norm_type, foreach=False)
    if pp_group is not None:
        total = _over_stages(total, float(norm_type), pp_group)
    if max_norm > 0:
        for members in groups.values():
            torch.nn.utils.clip_grads_with_norm_(members, max_norm, total.to(members[0].device), foreach=foreach)
    return total


def _over_stages(norm: torch.Tensor, norm_type: float, group: dist.ProcessGroup) -> torch.Tensor:
    """The norm over every pipeline stage from each stage's own ``norm``: the stages' norms gathered and
    combined as one vector's (a NaN on any stage stays NaN, which a MAX all-reduce may drop on gloo)."""
    norms = [torch.empty_like(norm) for _ in range(dist.get_world_size(group))]
    dist.all_gather(norms, norm.contiguous(), group=group)
    return torch.nn.utils.get_total_norm(norms, norm_type, foreach=False)
