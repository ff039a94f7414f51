"""The optimizer step's memory-bandwidth floor: the bytes an update must move, and the device's copy rate.

An element-wise optimizer such as AdamW does a few FLOPs per byte, so its step is bound by memory traffic.
Its floor is the time to move, once each, what it must read and write: every parameter (read and written),
its gradient (read) and each state tensor of the parameter's size (read and written: Adam's two moments).
In fp32 that is 4 + 4 + 4 + 2 x (4 + 4) = 28 bytes per parameter. :func:`update_bytes` counts it from the
optimizer's own tensors (the local shards under FSDP/TP, so per device), :func:`measure_copy_bandwidth`
measures the device's achievable rate with a large copy (bytes read + written per second), and
:func:`optimizer_floor` puts the two next to a measured step time. The clipping norm reads every gradient
once more (4 bytes per fp32 parameter); it is part of the measured optimizer time, not of the floor.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def update_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes one step of ``optimizer`` must read and write at the least, on this device (see the module
    docstring). A gradient that is not there (set to None after the step) counts in its parameter's dtype;
    state tensors count only once they exist (after the first step)."""
    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            local = _local(p)
            size = local.numel() * local.element_size()
            grad = p.grad
            total += 2 * size + (local.numel() * _local(grad).element_size() if grad is not None else size)
            for value in optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor) and _local(value).numel() == local.numel() and local.numel() > 1:
                    total += 2 * _local(value).numel() * _local(value).element_size()
    return total


def measure_copy_bandwidth(device: torch.device, nbytes: int | None = None, trials: int = 5) -> float:
    """Bytes per second one ``copy_`` of a large buffer moves on ``device`` (each byte read once and written
    once, so twice the buffer per copy); the best of ``trials`` timings of a few copies. Default buffer: 1 GiB
    on a GPU (far beyond its caches), 128 MiB on a CPU."""
    if nbytes is None:
        nbytes = 2**30 if device.type == "cuda" else 2**27
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    dst.copy_(src)  # warm-up: first touch of the pages, kernel load
    sync()
    copies, best = 4, 0.0
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(copies):
            dst.copy_(src)
        sync()
        best = max(best, 2 * nbytes * copies / (time.perf_counter() - start))
    del src, dst
    return best


def optimizer_floor(
    optimizer: torch.optim.Optimizer, optimizer_s: float | None, bandwidth: float, step_s: float | None = None
) -> dict[str, Any]:
    """The optimizer's share of a step and its distance from the floor, for a benchmark's JSON:
    ``update_bytes`` per step, the measured ``copy_bandwidth_gb_s``, ``floor_s`` = bytes / bandwidth, and
    with a measured ``optimizer_s`` (norm + clip + update per step) ``floor_ratio`` = optimizer_s / floor_s and,
    with the step time ``step_s``, ``share`` = optimizer_s / step_s."""
    nbytes = update_bytes(optimizer)
    floor_s = nbytes / bandwidth
    defaults = optimizer.defaults
    kernel = "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "for-loop"
    folded = getattr(optimizer, "_step_supports_amp_scaling", False)  # see titanlite.trainer.step
    out: dict[str, Any] = {
        "implementation": kernel,
        "clip": "in the fused kernel (grad_scale)" if folded else "one multi-tensor multiply",
        "update_bytes": nbytes,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "floor_s": floor_s,
    }
    if optimizer_s is not None:
        out.update(optimizer_s=optimizer_s, floor_ratio=optimizer_s / floor_s if floor_s > 0 else None)
        if step_s:
            out["share"] = optimizer_s / step_s
    return out
