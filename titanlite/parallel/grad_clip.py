"""Gradient-norm clipping that is exact for sharded (DTensor) gradients: FSDP gives each rank a slice of every
gradient, TP a slice of some and a replica of others (the sequence-parallel norm weights). Two ways to the total
norm, both the single-process norm (up to summation order) on every rank:

- :func:`clip_grad_norm_` (any ``norm_type``, no knowledge of the mesh): per group of gradients sharing a mesh and
  placements, a ``DTensor`` norm (reduced over the sharded dimensions only), made plain and combined, and with
  ``pp_group`` combined over the pipeline stages too.
- :func:`grad_square_sum` + :class:`WorldLayout` (the 2-norm, what the training step uses): each rank sums the
  squares of the gradient pieces it *owns*, so that one SUM all-reduce over the world, which can carry the
  step's other scalars (the loss, the guard's flags), gives the total.

:func:`clip_coefficient` and :func:`scale_grads_` clip with torch's rule; the training step instead folds the
coefficient into a fused optimizer's ``grad_scale`` (:class:`titanlite.trainer.step.TrainStep`), which saves a read
and a write of every gradient.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from titanlite.utils import torch_compat

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grads_with_norm_'s


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


class WorldLayout:
    """Which ranks' copies of a value count in a SUM over the world ``mesh`` (every rank, named dimensions).

    A value *differs* along some world dimensions (a pipeline stage's parameters, a gradient's shards) and is
    replicated along the others (a TP-replicated norm weight, a plain tensor, HSDP's replicas); the copy that
    counts is the one at coordinate 0 of every dimension it is replicated along. ``mesh`` None: everything counts.
    """

    def __init__(self, mesh: DeviceMesh | None, always_distinct: Iterable[str] = ("pp",)):
        if mesh is not None and (mesh.mesh_dim_names is None or mesh.size() != dist.get_world_size()):
            raise ValueError("WorldLayout needs a mesh with named dimensions over every rank of the default group")
        self.mesh, self.always_distinct = mesh, frozenset(always_distinct)
        self.coords = {} if mesh is None else dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
        self._spans: dict[int, tuple[DeviceMesh, list[frozenset[str]]]] = {}  # id(mesh) -> world dims of each dim

    @property
    def distributed(self) -> bool:
        return self.mesh is not None and self.mesh.size() > 1

    def counts(self, distinct: Iterable[str]) -> bool:
        """Whether this rank's copy of a value that differs along the world dimensions ``distinct`` (and the
        pipeline stages) counts: coordinate 0 on every other dimension."""
        distinct = self.always_distinct | set(distinct)
        return all(c == 0 for name, c in self.coords.items() if name not in distinct)

    def owns(self, grad: torch.Tensor) -> bool:
        """Whether this rank's local piece of ``grad`` counts: a DTensor differs along the world dimensions its
        sharded mesh dimensions span, a plain tensor along none (it is a replica on every rank of its stage).
        ``grad`` holds no partial sums (:func:`grad_square_sum` reduces those first)."""
        if not isinstance(grad, DTensor):
            return self.counts(())
        spans = self._mesh_spans(grad.device_mesh)
        # any placement but Replicate spreads it (Shard, and FSDP x TP's _StridedShard, whose is_shard() is False)
        return self.counts(set().union(*(s for s, p in zip(spans, grad.placements) if not p.is_replicate())))

    def _mesh_spans(self, sub: DeviceMesh) -> list[frozenset[str]]:
        """For each dimension of ``sub`` (a mesh over some of the world's ranks, maybe flattened dims), the
        world dimensions along which its ranks vary (found from the ranks, so any slicing or flattening works)."""
        if id(sub) not in self._spans:
            world = self.mesh.mesh
            me = sub.get_coordinate()
            spans = []
            for i in range(sub.ndim):
                index = tuple(slice(None) if j == i else c for j, c in enumerate(me))
                coords = [(world == r).nonzero()[0].tolist() for r in sub.mesh[index].flatten().tolist()]
                names = self.mesh.mesh_dim_names
                spans.append(frozenset(names[d] for d in range(world.ndim) if len({c[d] for c in coords}) > 1))
            self._spans[id(sub)] = (sub, spans)  # the mesh is kept so that its id is not reused
        return self._spans[id(sub)][1]


def grad_square_sum(parameters: Iterable[torch.Tensor], world: WorldLayout) -> torch.Tensor | None:
    """Sum of squares (fp32) of the gradient pieces this rank owns (see :class:`WorldLayout`): summed over the
    world it is the squared total 2-norm. One multi-tensor norm over the owned local tensors. A gradient that
    is a partial sum (``Partial``, e.g. a TP-replicated norm weight's) is first reduced to its parameter's
    placements, in place of ``.grad``, which the optimizer would otherwise do itself. None without gradients."""
    owned: list[torch.Tensor] = []
    for p in parameters:
        grad = p.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            if any(pl.is_partial() for pl in grad.placements):
                target = p.placements if isinstance(p, DTensor) else [Replicate()] * grad.device_mesh.ndim
                grad = p.grad = grad.redistribute(placements=target)
            if world.owns(grad):
                owned.append(grad.to_local())
        elif world.owns(grad):
            owned.append(grad)
    if not owned:
        return None
    groups = torch_compat.group_by_device_and_dtype(owned)
    sums = [torch.stack(torch._foreach_norm(ts, 2.0)).float().square().sum() for ts in groups]
    return sums[0] if len(sums) == 1 else torch.stack([s.to(sums[0].device) for s in sums]).sum()


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's clipping factor: ``max_norm / (total_norm + 1e-6)``, at most 1."""
    return (max_norm / (total_norm + CLIP_EPS)).clamp(max=1.0)


def scale_grads_(parameters: Iterable[torch.Tensor], coefficient: torch.Tensor) -> None:
    """Multiply every (local) gradient by the device scalar ``coefficient``: one multi-tensor op per device/dtype."""
    grads = [g.to_local() if isinstance(g, DTensor) else g for p in parameters if (g := p.grad) is not None]
    for ts in torch_compat.group_by_device_and_dtype(grads):
        torch._foreach_mul_(ts, coefficient.to(ts[0].device))
