"""Parallel degrees of a run."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.dp_shard == -1:
            self.dp_shard = self.world_size // (self.dp_replicate * self.tp)
        if self.dp_replicate * self.dp_shard * self.tp != self.world_size:
            raise ValueError(
                f"parallelism degrees dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x "
                f"tp={self.tp} must multiply to the world size {self.world_size}")

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard
