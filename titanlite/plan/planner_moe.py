"""The mixture-of-experts part of the run planner (pure functions; :mod:`titanlite.plan.planner` uses them): the
all-to-all volume and time of expert parallelism. The model: docs/memory_model.md, "Mixture-of-experts blocks".
"""

from __future__ import annotations

from titanlite.models.flops import MoEShape

GPUS_PER_NODE = 8
NVLINK_BYTES_PER_S = 450e9  # H100 SXM NVLink 4, one direction per GPU
INFINIBAND_BYTES_PER_S = 50e9  # one 400 Gb/s NDR link per GPU


def all_to_all_seconds(volume: float, ep: int) -> tuple[float, str]:
    """``(seconds, link)``: the time to send ``volume`` bytes from one GPU over the link its expert group's
    all-to-all is limited by: NVLink when the group fits in a node (``ep <= 8``), InfiniBand otherwise (a floor:
    no overlap with compute assumed, no latency, full link bandwidth)."""
    if ep <= GPUS_PER_NODE:
        return volume / NVLINK_BYTES_PER_S, "NVLink 450 GB/s"
    return volume / INFINIBAND_BYTES_PER_S, "InfiniBand 50 GB/s"


def all_to_all_bytes(
    moe: MoEShape, dim: int, tokens: float, ep: int, n_moe_blocks: float, c: int, recompute: bool = False
) -> float:
    """Bytes one GPU sends by all-to-all for ``tokens`` tokens through ``n_moe_blocks`` MoE blocks (its
    pipeline stage's) under expert parallelism ``ep`` (docs/memory_model.md); 0 without EP."""
    if ep <= 1:
        return 0.0
    exchanges = 6 if recompute else 4
    return exchanges * moe.top_k * tokens * dim * c * (ep - 1) / ep * n_moe_blocks
