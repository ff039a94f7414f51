"""Parallel degrees of a run and the named device mesh they define.

``WORLD_SIZE = pp x dp_replicate x dp_shard x cp x tp``. The mesh is laid out ``(pp, dp_replicate,
dp_shard, cp, tp)`` with ``tp`` innermost, so the ranks of one tensor-parallel group are adjacent (on one
node, where their many small collectives use the fast intra-node links), and ``pp`` outermost, so
pipeline stages talk across nodes with point-to-point sends only (the least traffic of any axis):
rank ``r = (((pp_rank * dp_replicate + replicate) * dp_shard + shard) * cp + cp_rank) * tp + tp_rank``.

Named views of the mesh:

- ``"pp"``, ``"dp_replicate"``, ``"dp_shard"``, ``"cp"``, ``"tp"``: the five dimensions (size-1 dimensions
  included, so every name always exists once the mesh is built);
- ``"dp"``: ``dp_replicate x dp_shard`` flattened, the *data* view: each of its ranks reads its own slice of
  the data; the CP and TP ranks of one DP rank read the same batch (the training step cuts it along the
  sequence for the CP ranks, :mod:`titanlite.parallel.context_parallel`), and so do the ranks of one DP rank in
  different pipeline stages.
- the *loss* view (:attr:`ParallelDims.loss_group`): the ranks holding different loss sums, ``"dp"``, or
  ``"dp_cp"`` (``dp_replicate x dp_shard x cp``) with context parallelism, with ``pp`` too under a pipeline.
- ``"dp_shard_cp"`` (context parallelism): ``dp_shard x cp``, what FSDP shards over, so that parameters are
  not replicated over the CP ranks (which compute gradients of different tokens, summed by FSDP).
- ``"dp_shard_tp"`` (FSDP x TP only; ``"dp_shard_cp_tp"`` with CP): ``dp_shard (x cp) x tp`` flattened, which
  DTensor uses to reduce values sharded over both (the gradient norm) in one collective.
- :attr:`ParallelDims.fsdp_mesh`: ``dp_shard`` (``dp_shard_cp``), or the 2-D ``(dp_replicate, dp_shard)``
  (``(dp_replicate, dp_shard_cp)``) for HSDP.
- expert parallelism (``ep > 1``, MoE models): the ranks FSDP shards over are split into ``dp_shard_mod_ep x
  ep`` (``ep`` inner: adjacent ranks), a view of the same mesh (:attr:`ParallelDims.ep_mesh` holds a rank's
  expert group, :attr:`ParallelDims.expert_fsdp_mesh` the ranks that FSDP-shard the same experts). Everything
  but the experts keeps the usual meshes; EP takes no ranks of its own. Those ranks are ``dp_shard``, or
  ``dp_shard x cp`` with context parallelism (as in torchtitan, EP borrows the CP ranks first): ``ep`` divides
  ``dp_shard x cp``, an expert group of ``ep <= cp`` is CP ranks of one sequence (each routes its share of the
  tokens), and FSDP sums the expert gradients over the other groups. A MoE layer's tokens are independent, so
  any split of the batch's tokens over the expert groups gives the same sums.

Every degree problem raises :class:`~titanlite.errors.ConfigError` with a one-line message naming the config keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanlite.errors import ConfigError
from titanlite.utils import torch_compat

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
_KEYS = {
    "pp": "parallelism.pipeline_parallel_degree",
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "dp_shard": "parallelism.data_parallel_shard_degree",
    "tp": "parallelism.tensor_parallel_degree",
    "cp": "parallelism.context_parallel_degree",
    "ep": "parallelism.expert_parallel_degree",
}


@dataclass
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever is left of the world after dp_replicate and tp
    tp: int = 1
    world_size: int = 1
    pp: int = 1
    enable_loss_parallel: bool = True
    ep: int = 1  # expert-parallel degree: a factor of dp_shard (MoE models)
    cp: int = 1  # context-parallel degree: ranks that split each sequence (titanlite.parallel.context_parallel)
    mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)
    _expert_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _dp_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _pp_dp_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _loss_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _shard_cp_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _shard_tp_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            value = getattr(self, name)
            if value < 1 and not (name == "dp_shard" and value == -1):
                raise ConfigError(
                    f"{_KEYS[name]}={value} must be >= 1"
                    + (" (or -1 for the rest of the world)" if name == "dp_shard" else "")
                )
        if self.world_size < 1:
            raise ConfigError(f"WORLD_SIZE={self.world_size} must be >= 1")
        if self.dp_shard == -1:
            other = self.pp * self.dp_replicate * self.cp * self.tp
            if self.world_size % other:
                pp = f"{_KEYS['pp']} ({self.pp}) x " if self.pp > 1 else ""
                cp = f"{_KEYS['cp']} ({self.cp}) x " if self.cp > 1 else ""
                raise ConfigError(
                    f"{pp}{_KEYS['dp_replicate']} ({self.dp_replicate}) x {cp}{_KEYS['tp']} ({self.tp}) = {other} "
                    f"does not divide the number of processes (WORLD_SIZE={self.world_size})"
                )
            self.dp_shard = self.world_size // other
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            pp = f"pipeline_parallel_degree ({self.pp}) x " if self.pp > 1 else ""
            cp = f" x context_parallel_degree ({self.cp})" if self.cp > 1 else ""
            raise ConfigError(
                f"parallelism degrees must multiply to the number of processes: {pp}data_parallel_replicate_degree "
                f"({self.dp_replicate}) x data_parallel_shard_degree ({self.dp_shard}){cp} x tensor_parallel_degree "
                f"({self.tp}) = {product}, but WORLD_SIZE={self.world_size}"
            )
        if self.ep < 1 or (self.dp_shard * self.cp) % self.ep:
            cp = f" x {_KEYS['cp']} ({self.cp})" if self.cp > 1 else ""
            raise ConfigError(
                f"{_KEYS['ep']}={self.ep} must divide {_KEYS['dp_shard']} ({self.dp_shard}){cp}: the experts are "
                "sharded over a part of the ranks FSDP shards over"
            )

    @classmethod
    def from_config(cls, pcfg, world_size: int) -> ParallelDims:
        """From the ``[parallelism]`` section."""
        return cls(
            dp_replicate=pcfg.data_parallel_replicate_degree,
            dp_shard=pcfg.data_parallel_shard_degree,
            tp=pcfg.tensor_parallel_degree,
            world_size=world_size,
            pp=pcfg.pipeline_parallel_degree,
            enable_loss_parallel=pcfg.enable_loss_parallel,
            ep=getattr(pcfg, "expert_parallel_degree", 1),
            cp=getattr(pcfg, "context_parallel_degree", 1),
        )

    # ---- degrees
    @property
    def dp_degree(self) -> int:
        """Data-parallel ranks (distinct batches per micro-step)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_degree(self) -> int:
        """Ranks FSDP (HSDP) spans: the data-parallel ranks and, with context parallelism, their CP ranks."""
        return self.dp_degree * self.cp

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP (or HSDP) wraps the model: there is more than one data-parallel or context-parallel rank."""
        return self.fsdp_degree > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def loss_parallel_enabled(self) -> bool:
        return self.tp_enabled and self.enable_loss_parallel

    # ---- model checks
    def check_tp_divides(self, **sizes: int) -> None:
        """Raise when ``tp`` does not divide one of the named model sizes (e.g. ``n_kv_heads=4``)."""
        if not self.tp_enabled:
            return
        for name, size in sizes.items():
            if size % self.tp:
                raise ConfigError(f"{_KEYS['tp']}={self.tp} must divide {name} ({size})")

    # ---- mesh
    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """Build (once) the named mesh on ``device_type`` ("cpu" -> gloo, "cuda" -> NCCL).

        Needs the default process group when ``world_size > 1``; a single process gets no mesh.
        """
        if self.mesh is not None or self.world_size == 1:
            return self.mesh
        if not dist.is_initialized():
            raise RuntimeError("build_mesh needs the process group (init_distributed) first")
        shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        dp = mesh["dp_replicate", "dp_shard"]
        self._dp_mesh = torch_compat.flatten_mesh(dp, "dp")  # kept: slicing it back is deprecated
        if self.cp > 1:  # FSDP shards over dp_shard x cp; the loss sums over dp x cp
            self._shard_cp_mesh = torch_compat.flatten_mesh(mesh["dp_shard", "cp"], "dp_shard_cp")
            self._loss_mesh = torch_compat.flatten_mesh(mesh["dp_replicate", "dp_shard", "cp"], "dp_cp")
        if self.pp > 1:  # the training loss (on the last stage only) is summed over stages and DP ranks at once
            self._pp_dp_mesh = torch_compat.flatten_mesh(mesh["pp", "dp_replicate", "dp_shard", "cp"], "pp_dp")
        if self.dp_shard * self.cp > 1 and self.tp > 1:
            # FSDP x TP gradients are sharded over both; with this flattened view DTensor reduces
            # their norms (gradient clipping) in one all-reduce instead of one per dimension
            dims = ("dp_shard", "cp", "tp") if self.cp > 1 else ("dp_shard", "tp")
            self._shard_tp_mesh = torch_compat.flatten_mesh(mesh[dims], "_".join(dims))
        if self.ep > 1:
            self._build_expert_meshes(mesh)
        self.mesh = mesh
        return mesh

    def _build_expert_meshes(self, mesh: DeviceMesh) -> None:
        """The ranks FSDP shards over, ``dp_shard`` (``dp_shard x cp`` under context parallelism), seen as
        ``(dp_shard_mod_ep, ep)`` with ``ep`` inner: same ranks, same root mesh (module docstring)."""
        names = ("dp_shard_mod_ep", "ep")
        if self.cp == 1:
            sizes = (self.dp_shard // self.ep, self.ep)
            self._expert_mesh = torch_compat.unflatten_mesh(mesh, "dp_shard", sizes, names)
        else:  # "dp_cp" (dp_replicate x dp_shard x cp flattened) split again, dp_replicate outermost as before
            sizes = (self.dp_replicate, self.dp_shard * self.cp // self.ep, self.ep)
            self._expert_mesh = torch_compat.unflatten_mesh(self._loss_mesh, "dp_cp", sizes, ("dp_replicate", *names))

    def _sub(self, *names: str) -> DeviceMesh | None:
        return None if self.mesh is None else self.mesh[names if len(names) > 1 else names[0]]

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self._sub("tp")

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        return self._sub("cp")

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """Process group of the ranks that split this rank's sequences, or None without context parallelism."""
        return self.cp_mesh.get_group() if self.cp_enabled and self.mesh is not None else None

    @property
    def cp_rank(self) -> int:
        return self.cp_mesh.get_local_rank() if self.cp_enabled and self.mesh is not None else 0

    @property
    def pp_mesh(self) -> DeviceMesh | None:
        return self._sub("pp")

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """Process group of this rank's pipeline stages, or None without pipeline parallelism."""
        return self.pp_mesh.get_group() if self.pp_enabled and self.mesh is not None else None

    @property
    def pp_rank(self) -> int:
        return self.pp_mesh.get_local_rank() if self.pp_enabled and self.mesh is not None else 0

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """The flattened data-parallel view (data slicing and the loss reduction)."""
        return self._dp_mesh

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP shards over: ``dp_shard`` (``dp_shard_cp``), or ``(dp_replicate, dp_shard)`` for HSDP."""
        if not self.cp_enabled:
            return self._sub("dp_replicate", "dp_shard") if self.hsdp_enabled else self._sub("dp_shard")
        return self._sub("dp_replicate", "dp_shard_cp") if self.hsdp_enabled else self._shard_cp_mesh

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        """This rank's expert-parallel group (the ranks that split the experts), or None without EP."""
        return None if self._expert_mesh is None else self._expert_mesh["ep"]

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP shards the experts over under EP, the ranks holding the same experts: ``dp_shard_mod_ep``
        (with ``dp_replicate`` for HSDP)."""
        if self._expert_mesh is None:
            return None
        em = self._expert_mesh
        return em["dp_replicate", "dp_shard_mod_ep"] if self.hsdp_enabled else em["dp_shard_mod_ep"]

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """Process group of the data-parallel ranks, or None when there is only one."""
        return self.dp_mesh.get_group() if self.dp_degree > 1 and self.mesh is not None else None

    @property
    def batch_group(self) -> dist.ProcessGroup | None:
        """Process group of the ranks whose tokens together make one micro-step's batch in one pipeline stage: the
        data-parallel ranks and their CP ranks (``"dp_cp"``); None when alone."""
        return self._loss_mesh.get_group() if self._loss_mesh is not None else self.dp_group

    @property
    def loss_group(self) -> dist.ProcessGroup | None:
        """Process group over which a step's loss sum is reduced: the data-parallel ranks, their CP ranks
        (``"dp_cp"``), and with pipeline parallelism the stages too (``"pp_dp"``: only the last stage holds a
        nonzero sum); None when alone."""
        if self._pp_dp_mesh is not None:
            return self._pp_dp_mesh.get_group()
        if self._loss_mesh is not None:
            return self._loss_mesh.get_group()
        return self.dp_group

    def dp_rank(self, global_rank: int) -> int:
        """This rank's index among the data-parallel ranks (``tp``, then ``cp`` innermost, ``pp`` the outermost)."""
        return (
            (global_rank // (self.tp * self.cp)) % self.dp_degree
            if self.mesh is None
            else self.dp_mesh.get_local_rank()
        )

    def all_groups(self) -> list[dist.ProcessGroup]:
        """Every process group of the mesh (for timeouts)."""
        if self.mesh is None:
            return []
        meshes = (self._dp_mesh, self._pp_dp_mesh, self._loss_mesh, self._shard_cp_mesh, self._shard_tp_mesh)
        flat = [m.get_group() for m in meshes if m is not None]  # FSDP's under CP, the gradient norm's under TP
        if self._expert_mesh is not None:
            flat += [self._expert_mesh.get_group(name) for name in ("dp_shard_mod_ep", "ep")]
        return [self.mesh.get_group(name) for name in MESH_DIMS] + flat
