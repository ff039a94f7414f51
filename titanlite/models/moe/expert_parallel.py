"""Expert parallelism: each rank of the ``ep`` mesh holds ``E / ep`` experts, tokens travel to them and back.

:func:`expert_parallel_swiglu`, for tokens sorted by global expert id, exchanges the counts per expert first
(``all_to_all_single`` of ``E`` integers), then the tokens (one host sync for the split sizes), regroups what
arrived by local expert for the grouped GEMM, and sends the outputs back with the inverse exchange. Both token
exchanges are differentiable (:class:`AllToAll`: the backward swaps the splits), so each expert's weight gradient
sums every peer's tokens. The region runs eagerly under ``torch.compile`` (the split sizes are host data).

:func:`shard_experts` makes the stacked expert weights ``Shard(0)`` DTensors over the ``ep`` mesh, so checkpoints
hold global shapes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard


class AllToAll(torch.autograd.Function):
    """Differentiable ``all_to_all_single`` with explicit split sizes (lists of ints)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def regroup_index(recv_counts: torch.Tensor) -> torch.Tensor:
    """For tokens that arrived as blocks ``(source rank s, local expert j)`` in ``s``-major order
    (``recv_counts [ep, E_local]``), the index that orders them ``j``-major (by local expert, then source)."""
    ep, n_local = recv_counts.shape
    starts = torch.cumsum(recv_counts.reshape(-1), 0) - recv_counts.reshape(-1)  # of each (s, j) block on arrival
    lens_t = recv_counts.t().reshape(-1)  # blocks in (j, s) order
    starts_t = starts.view(ep, n_local).t().reshape(-1)
    block = torch.repeat_interleave(torch.arange(lens_t.numel(), device=lens_t.device), lens_t)
    first_t = torch.cumsum(lens_t, 0) - lens_t
    return torch.arange(block.numel(), device=block.device) - first_t[block] + starts_t[block]


@torch.compiler.disable
def expert_parallel_swiglu(experts: nn.Module, x: torch.Tensor, counts: torch.Tensor, group) -> torch.Tensor:
    """``x [M, dim]`` sorted by global expert with ``counts [E]`` per expert -> the experts' outputs, in
    ``x``'s order, computed by the ranks of ``group`` that hold them (module docstring)."""
    ep = dist.get_world_size(group)
    n_local = counts.numel() // ep
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)  # [ep * E_local]: from each source, per local expert
    recv_counts = recv_counts.view(ep, n_local)
    in_splits = counts.view(ep, n_local).sum(1).tolist()
    out_splits = recv_counts.sum(1).tolist()
    arrived = AllToAll.apply(x, out_splits, in_splits, group)
    order = regroup_index(recv_counts)
    y = experts(arrived[order], recv_counts.sum(0))
    return AllToAll.apply(_unpermute(y, order), in_splits, out_splits, group)


def _unpermute(y: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``out`` with ``out[order] = y`` (differentiable): the inverse of indexing with ``order``."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return y[inverse]


def shard_experts(experts: nn.Module, ep_mesh) -> None:
    """Replace ``experts``' stacked weights (meta tensors) by DTensors ``Shard(0)`` over ``ep_mesh``."""
    for name, p in list(experts.named_parameters(recurse=False)):
        if p.shape[0] % ep_mesh.size():
            raise ValueError(f"{p.shape[0]} experts cannot be split over {ep_mesh.size()} expert-parallel ranks")
        local = p.detach().chunk(ep_mesh.size(), dim=0)[ep_mesh.get_local_rank()]
        dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
        experts.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))
