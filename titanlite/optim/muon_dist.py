"""Newton-Schulz on sharded matrices: each matrix is assembled on one owner rank, orthogonalized there, and its
result is scattered back to the shards.

A Muon parameter that a rank holds whole (a plain tensor; a DTensor replicated everywhere; stacked experts split
only along the expert dim, as expert parallelism and expert FSDP leave them) is orthogonalized where it lives: see
:func:`holds_whole`. Every other one (FSDP, HSDP and TP shards, in any combination) goes through :class:`Exchange`:

- owners: per set of ranks sharing a mesh, :func:`~titanlite.optim.muon_owners.assign_owners` spreads the
  matrices over those ranks by their Newton-Schulz FLOPs, so each rank orthogonalizes about 1/N of them;
- layout: where each rank's shard lies in the full matrix is the flat index of its local elements
  (``distribute_tensor`` of an ``arange``, so every placement DTensor has, strided FSDP x TP shards included, is
  handled by DTensor itself); each owner learns its senders' indices once, at the first step, and keeps a
  contiguous one as a slice (the FSDP case: no index tensor);
- per step, two ``all_to_all_single`` over the world carry every matrix at once: the shards of the momentum-updated
  gradient to their owners (from the owner's replica only, under HSDP), then the orthogonalized pieces back to every
  rank holding a shard. Both travel in the Newton-Schulz dtype (bf16 halves the bytes). The first runs while the
  rank orthogonalizes the matrices it holds whole (:meth:`Exchange.start`, then :meth:`Exchange.finish`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from titanlite.optim.muon_math import newton_schulz_flops
from titanlite.optim.muon_owners import assign_owners

Index = "slice | torch.Tensor"


def holds_whole(p: torch.Tensor) -> bool:
    """Whether this rank holds every matrix of ``p`` whole: a plain tensor, a DTensor replicated on every mesh dim,
    or a batch of matrices (3-D) sharded only along its batch dim."""
    if not isinstance(p, DTensor):
        return True
    if all(pl.is_replicate() for pl in p.placements):
        return True
    return p.ndim == 3 and all(pl.is_replicate() or _shard_dim(pl) == 0 for pl in p.placements)


def _shard_dim(placement) -> int | None:
    """The tensor dim a placement splits (``Shard`` and the strided shard FSDP puts over TP or EP), else None."""
    return getattr(placement, "dim", None)


@dataclasses.dataclass
class Matrix:
    """One sharded Muon parameter in the exchange: its full ``shape``, the global ranks of its mesh, its ``owner``,
    the ranks that send their shard to the owner (one replica), this rank's flat indices in the full matrix (until
    the owner has learned them: then None, freeing an index as large as the shard) and their count."""

    shape: tuple[int, ...]
    ranks: list[int]
    owner: int
    senders: list[int]
    local_index: torch.Tensor | None
    local_numel: int = 0

    def __post_init__(self) -> None:
        self.local_numel = self.local_index.numel()


def _local_index(p: DTensor) -> torch.Tensor:
    """The flat indices in the full ``p`` of the elements this rank holds, in their local order."""
    full = torch.arange(p.numel(), device=p.to_local().device).view(p.shape)
    return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local().reshape(-1)


def _senders(p: DTensor, owner: int) -> list[int]:
    """The mesh ranks at the owner's coordinates along every replicated mesh dim: together they hold each element
    once."""
    mesh = p.device_mesh.mesh
    coord = (mesh == owner).nonzero()[0]
    keep = torch.ones_like(mesh, dtype=torch.bool)
    for dim, pl in enumerate(p.placements):
        if pl.is_replicate():
            keep &= (torch.arange(mesh.size(dim)) == coord[dim]).view([-1 if d == dim else 1 for d in range(mesh.ndim)])
        elif _shard_dim(pl) is None:
            raise ValueError(f"Muon cannot gather a parameter placed as {p.placements}")
    return sorted(mesh[keep].tolist())


def plan_matrices(params: list[DTensor], steps: int) -> list[Matrix]:
    """The exchange's matrices, owners balanced per set of mesh ranks by their Newton-Schulz FLOPs."""
    ranks = [p.device_mesh.mesh.flatten().tolist() for p in params]
    owners: list[int] = [0] * len(params)
    for group in dict.fromkeys(tuple(r) for r in ranks):
        members = [i for i, r in enumerate(ranks) if tuple(r) == group]
        picks = assign_owners([newton_schulz_flops(tuple(params[i].shape), steps) for i in members], len(group))
        for i, pick in zip(members, picks):
            owners[i] = group[pick]
    return [
        Matrix(tuple(p.shape), ranks[i], owners[i], _senders(p, owners[i]), _local_index(p))
        for i, p in enumerate(params)
    ]


def all_to_all(
    sends: list[list[torch.Tensor]], recv_sizes: list[list[int]], like: torch.Tensor, async_op: bool = False
) -> Callable[[], list[list[torch.Tensor]]]:
    """Every rank's ``sends[dst]`` (flat tensors) to ``dst`` in one ``all_to_all_single`` over the world, started
    now (``async_op``: without waiting); the returned function waits and gives ``received[src]``, split by
    ``recv_sizes[src]``. ``like`` gives the dtype and device of the buffers."""
    flat = [torch.cat(chunks) if chunks else like.new_empty(0) for chunks in sends]
    send = torch.cat(flat)
    recv = like.new_empty(sum(sum(s) for s in recv_sizes))
    totals = [sum(s) for s in recv_sizes]
    work = dist.all_to_all_single(recv, send, totals, [t.numel() for t in flat], async_op=async_op)

    def received() -> list[list[torch.Tensor]]:
        if work is not None:
            work.wait()
        return [list(part.split(sizes)) for part, sizes in zip(recv.split(totals), recv_sizes)]

    return received


def _compact(index: torch.Tensor) -> Index:
    """A contiguous run of indices as a slice (no tensor kept), else the indices."""
    if index.numel() and int(index[-1] - index[0]) + 1 == index.numel():
        if torch.equal(index, torch.arange(int(index[0]), int(index[-1]) + 1, device=index.device)):
            return slice(int(index[0]), int(index[-1]) + 1)
    return index


class Exchange:
    """The gather-to-owner and scatter-back of the sharded matrices (see the module docstring)."""

    def __init__(self, params: list[DTensor], steps: int, device: torch.device):
        """Collective over the world: every rank builds its exchange at the same step, with or without matrices."""
        self.rank, self.world, self.device = dist.get_rank(), dist.get_world_size(), device
        self.matrices = plan_matrices(params, steps)
        self.owned = [i for i, m in enumerate(self.matrices) if m.owner == self.rank]
        self.index: dict[tuple[int, int], Index] = {}  # (matrix, source rank) -> its shard's place, owners only
        count = torch.tensor([len(self.matrices)], device=device)
        dist.all_reduce(count)
        self.active = bool(count.item())  # no rank holds a sharded matrix: no exchange at all
        if self.active:
            self._learn_layout()
        for m in self.matrices:
            m.local_index = None

    def _from(self, src: int, role: str) -> list[int]:
        """The owned matrices that ``src`` sends (``role`` senders) or holds a shard of (``role`` ranks)."""
        return [i for i in self.owned if src in getattr(self.matrices[i], role)]

    def _learn_layout(self) -> None:
        """Each owner receives every holder's flat indices once: first their sizes, then the indices."""
        mats = self.matrices
        like = torch.zeros(0, dtype=torch.int64, device=self.device)
        to_owner = [
            [i for i, m in enumerate(mats) if m.owner == dst and self.rank in m.ranks] for dst in range(self.world)
        ]
        sizes = [[like.new_tensor([mats[i].local_numel]) for i in mine] for mine in to_owner]
        got = all_to_all(sizes, [[1] * len(self._from(src, "ranks")) for src in range(self.world)], like)()
        counts = [[int(t) for t in part] for part in got]
        indices = all_to_all([[mats[i].local_index for i in mine] for mine in to_owner], counts, like)()
        for src in range(self.world):
            for i, index in zip(self._from(src, "ranks"), indices[src]):
                self.index[(i, src)] = _compact(index)

    def start(self, updates: list[torch.Tensor], dtype: torch.dtype) -> Callable[[], list] | None:
        """Send this rank's local ``updates`` (flat, in the Newton-Schulz ``dtype``) to their owners without waiting;
        :meth:`finish` completes the step. Collective: every rank calls it once per step."""
        if not self.active:
            return None
        mats, like = self.matrices, torch.zeros(0, dtype=dtype, device=self.device)
        sends = [
            [u for u, m in zip(updates, mats) if m.owner == dst and self.rank in m.senders] for dst in range(self.world)
        ]
        sizes = [[self._size(i, src) for i in self._from(src, "senders")] for src in range(self.world)]
        return all_to_all(sends, sizes, like, async_op=True)

    def finish(self, started: Callable[[], list] | None, ns: Callable, dtype: torch.dtype) -> list[torch.Tensor]:
        """The local pieces (flat) of ``ns(full matrix)`` for each matrix: the owners assemble and orthogonalize
        theirs, and one more all-to-all brings the pieces back."""
        if started is None:
            return []
        mats, like, pieces = self.matrices, torch.zeros(0, dtype=dtype, device=self.device), started()
        results = {}
        for i in self.owned:
            full = like.new_empty(mats[i].shape).view(-1)
            for src in mats[i].senders:
                full[self.index[(i, src)]] = pieces[src][self._from(src, "senders").index(i)]
            results[i] = ns(full.view(mats[i].shape)).reshape(-1)
        back = [[results[i][self.index[(i, dst)]] for i in self._from(dst, "ranks")] for dst in range(self.world)]
        sizes = [[m.local_numel for m in mats if m.owner == src and self.rank in m.ranks] for src in range(self.world)]
        order = [iter(part) for part in all_to_all(back, sizes, like)()]
        return [next(order[m.owner]) for m in mats]

    def _size(self, i: int, src: int) -> int:
        index = self.index[(i, src)]
        return index.stop - index.start if isinstance(index, slice) else index.numel()
