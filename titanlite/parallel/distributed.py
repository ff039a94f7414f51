"""Process-group set-up from torchrun's environment (gloo on CPU, NCCL on CUDA)."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class WorldInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world_from_env() -> WorldInfo:
    """Rank, world size and device from torchrun's variables (one process when they are unset)."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    return WorldInfo(rank, local_rank, world_size, device)


def init_distributed(world: WorldInfo, timeout_seconds: float = 300.0) -> None:
    """Join the process group when there is more than one process (no-op otherwise)."""
    if world.world_size == 1 or dist.is_initialized():
        return
    if world.device.type == "cuda":
        torch.cuda.set_device(world.device)
    backend = "nccl" if world.device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_seconds),
                            device_id=world.device if backend == "nccl" else None)


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum of ``t`` over ``group`` (the tensor itself when not distributed)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t
