"""Context parallelism: the ranks of a ``cp`` group split each sequence, and attention gathers keys and values.

Load balance. A sequence of ``S`` tokens is cut into ``2 x cp`` chunks of ``c = S / (2 cp)``; rank ``i`` holds
chunks ``i`` and ``2 cp - 1 - i``. Under a causal mask a query's work grows with its position, so pairing an
early chunk with a late one gives every rank the same attention work (and the same memory).

The data loader knows nothing of this: every CP rank of one data-parallel rank reads the same batch and the
training step cuts it (:meth:`ContextParallel.shard`), so a checkpoint resumes exactly under any CP degree.
The model computes its rotary angles at the true global positions (:meth:`ContextParallel.positions`) and its
attention all-gathers the keys and values of the whole sequence (:func:`gather_sequence`, whose backward
reduce-scatters their gradients); the kernel is :mod:`titanlite.models.context_attention`'s. Document ids are
not cut: attention needs every position's, and a rank's own are a slice of them.

The index functions are pure (no process group) and unit-tested: :func:`chunk_positions`, :func:`rank_major_order`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.distributed as dist


def chunk_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions (int64 ``[seq_len / cp]``) rank ``rank`` of ``cp`` holds: chunks ``rank`` and
    ``2 cp - 1 - rank`` of ``2 cp`` equal chunks, in that order."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 x context-parallel degree ({cp})")
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is not in [0, {cp})")
    c = seq_len // (2 * cp)
    return torch.cat(
        [torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]
    )


def rank_major_order(seq_len: int, cp: int) -> torch.Tensor:
    """For each global position, its index in the ranks' shards concatenated in rank order (what an all-gather
    returns): ``gathered.index_select(dim, rank_major_order(S, cp))`` is the sequence in its true order."""
    concatenated = torch.cat([chunk_positions(seq_len, cp, r) for r in range(cp)])
    return torch.argsort(concatenated)


def shard_sequence(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s load-balanced share of ``t`` along ``dim`` (the sequence dimension)."""
    return t.index_select(dim, chunk_positions(t.shape[dim], cp, rank).to(t.device))


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """This rank's place in its context-parallel group: what the step and the model need to split sequences.

    It travels from the :class:`~titanlite.trainer.runtime.Runtime` to the model as the forward argument
    ``context_parallel``; a forward without it (generation, evaluation scoring) sees whole sequences."""

    group: Any
    degree: int
    rank: int
    seq_len: int = 0  # the whole sequences' length in this forward (set by the step as it shards the batch)

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's share of ``t`` (a full-sequence batch tensor) along ``dim``."""
        return shard_sequence(t, self.degree, self.rank, dim)

    def for_length(self, seq_len: int) -> ContextParallel:
        """This group, for a forward over sequences of ``seq_len`` tokens."""
        return dataclasses.replace(self, seq_len=seq_len)

    @property
    def local_len(self) -> int:
        return self.seq_len // self.degree

    def positions(self, device: torch.device | None = None) -> torch.Tensor:
        """Global positions of this rank's tokens (the model's inputs may be sharded further under TP: these are
        the positions of the whole local share, which attention sees)."""
        return chunk_positions(self.seq_len, self.degree, self.rank).to(device)

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence of ``x`` along ``dim``, in true order, from every rank's share (differentiable)."""
        return gather_sequence(x, self, dim)


@functools.lru_cache(maxsize=16)
def _orders(seq_len: int, cp: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranks' shards' global positions concatenated in rank order, and :func:`rank_major_order`, on ``device``:
    computed once per sequence length, not on every gather of every layer."""
    concatenated = torch.cat([chunk_positions(seq_len, cp, r) for r in range(cp)])
    return concatenated.to(device), rank_major_order(seq_len, cp).to(device)


class _GatherSequence(torch.autograd.Function):
    """All-gather of the shards along the sequence; backward: the gradient's shards summed over the ranks
    (a reduce-scatter: each rank's keys get the gradients of every rank's queries)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: ContextParallel, dim: int) -> torch.Tensor:
        ctx.cp, ctx.dim = cp, dim
        parts = [torch.empty_like(x) for _ in range(cp.degree)]
        dist.all_gather(parts, x.contiguous(), group=cp.group)
        order = _orders(x.shape[dim] * cp.degree, cp.degree, x.device)[1]
        return torch.cat(parts, dim).index_select(dim, order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cp, dim = ctx.cp, ctx.dim
        rank_major = grad.index_select(dim, _orders(grad.shape[dim], cp.degree, grad.device)[0])
        return _reduce_scatter(rank_major, cp, dim), None, None


def _reduce_scatter(x: torch.Tensor, cp: ContextParallel, dim: int) -> torch.Tensor:
    """The sum over the ranks of ``x`` (rank-major shards along ``dim``), this rank's shard of it. Gloo has no
    reduce-scatter: there it is an all-reduce and a slice (the same sum)."""
    if dist.get_backend(cp.group) == "gloo":
        total = x.contiguous()
        dist.all_reduce(total, group=cp.group)
        return total.chunk(cp.degree, dim)[cp.rank].contiguous()
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // cp.degree, *moved.shape[1:]))
    dist.reduce_scatter_tensor(out, moved, group=cp.group)
    return out.movedim(0, dim).contiguous()


def gather_sequence(x: torch.Tensor, cp: ContextParallel, dim: int = 1) -> torch.Tensor:
    """``x``'s whole sequence along ``dim`` from every CP rank's share, with the reduce-scattering backward."""
    return _GatherSequence.apply(x, cp, dim)
