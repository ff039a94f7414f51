"""The peaks MFU is measured against: dense peak FLOP/s and memory per GPU by name (no guess for an unknown GPU:
MFU None), the matmul dtype that picks the peak, a measured CPU matmul rate, memory statistics."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import resource
import time
from typing import Any

import torch

from titanlite.utils.dtypes import DTYPES

# Dense peak TFLOP/s per GPU by matmul dtype, from the vendors' datasheets (NVIDIA's 2:4 sparsity
# figures are halved here). "float32" is the plain FP32 rate, "tfloat32" the TF32 tensor-core rate.
# Each entry: (case-insensitive regex matched against torch.cuda.get_device_name() as a whole word,
# so "H20" does not match "H200" nor "H200" "GH200"), peaks. Checked in order: the more specific
# variants (PCIe, NVL) come before the SXM default.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    (r"H100.*PCIe", {"bfloat16": 756.5, "float8": 1513.0, "tfloat32": 378.0, "float32": 51.0}),
    (r"H[12]00.*NVL", {"bfloat16": 835.5, "float8": 1670.5, "tfloat32": 417.5, "float32": 60.0}),
    (r"GH200|H[12]00", {"bfloat16": 989.5, "float8": 1979.0, "tfloat32": 494.5, "float32": 67.0}),  # SXM
    (r"H20", {"bfloat16": 148.0, "float8": 296.0, "tfloat32": 74.0, "float32": 44.0}),
    (r"B200", {"bfloat16": 2250.0, "float8": 4500.0, "tfloat32": 1100.0, "float32": 75.0}),  # HGX, 1000 W
    (r"A100", {"bfloat16": 312.0, "tfloat32": 156.0, "float32": 19.5}),  # no float8 on Ampere
    (r"L40S", {"bfloat16": 362.05, "float8": 733.0, "tfloat32": 183.0, "float32": 91.6}),
    (r"MI300X", {"bfloat16": 1307.4, "float8": 2614.9, "tfloat32": 653.7, "float32": 163.4}),
]

# GPU memory per device (GB = 1e9 bytes, as datasheets state it), for the run planner.
GPU_MEMORY_GB: list[tuple[str, float]] = [
    (r"H100.*NVL", 94.0),
    (r"GH200", 96.0),
    (r"H100", 80.0),
    (r"H200", 141.0),
    (r"H20", 96.0),
    (r"B200", 180.0),
    (r"A100.*40GB", 40.0),
    (r"A100", 80.0),
    (r"L40S", 48.0),
    (r"MI300X", 192.0),
]


def _match(table: list[tuple[str, Any]], name: str) -> Any:
    found = (v for p, v in table if re.search(rf"(?<![A-Za-z0-9])(?:{p})(?![A-Za-z0-9])", name, re.IGNORECASE))
    return next(found, None)


def peak_flops(device: torch.device, dtype: str = "bfloat16") -> float | None:
    """Dense peak FLOP/s of ``device`` for matmuls in ``dtype``: the table's on CUDA, measured on CPU."""
    if device.type == "cuda":
        return peak_flops_for_name(torch.cuda.get_device_name(device), dtype)
    if device.type == "cpu":
        return measure_cpu_matmul_peak(dtype, threads=torch.get_num_threads())
    return None


def peak_flops_for_name(name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of the GPU called ``name`` in ``dtype``; None for an unknown GPU or a dtype
    it has no tensor-core rate for (e.g. float8 on an A100): MFU is then reported as unknown."""
    tf = (_match(PEAK_TFLOPS, name) or {}).get(dtype)
    return None if tf is None else tf * 1e12


def gpu_memory_bytes(name: str) -> float | None:
    """Memory of the GPU called ``name`` in bytes (datasheet figure), None when unknown."""
    gb = _match(GPU_MEMORY_GB, name)
    return None if gb is None else gb * 1e9


def device_memory_bytes(device: torch.device) -> float | None:
    """Memory of ``device`` in bytes: the CUDA device's total, or the machine's physical memory on CPU; None when
    unknown."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "cpu":
        with contextlib.suppress(ValueError, OSError, AttributeError):
            return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return None


def matmul_dtype(compute_dtype: str, float8: bool = False, device: torch.device | None = None) -> str:
    """The dtype the model's matmuls run in (it selects the peak of MFU): with float8 linears on CUDA most
    FLOPs are float8 matmuls; float32 ones on CUDA use TF32 tensor cores when torch allows it
    (``set_float32_matmul_precision("high")``); else ``compute_dtype`` (``mixed_precision_param``)."""
    on_cuda = device is not None and device.type == "cuda"
    if float8 and on_cuda:
        return "float8"
    if compute_dtype == "float32" and on_cuda and torch.backends.cuda.matmul.allow_tf32:
        return "tfloat32"
    return compute_dtype


@functools.cache
def measure_cpu_matmul_peak(dtype: str = "float32", max_n: int = 2048, trials: int = 5, threads: int = 0) -> float:
    """Matmul FLOP/s of this CPU in ``dtype``, cached per process and ``threads`` (intra-op threads, 0: current).

    Square matmuls from 256 up, the size doubled while one takes under 20 ms (at most ``max_n``): large enough to
    reach the kernel's rate, small enough that a dtype without a native kernel costs a second, not minutes
    (docs/benchmarks.md, "CPU matmul peak"). Then the best of ``trials`` ~0.1 s timings, so a busy moment does not
    lower the peak and inflate MFU (a loaded CPU still does). A private generator leaves torch's RNG alone."""
    dt = DTYPES.get(dtype, torch.float32)
    g = torch.Generator().manual_seed(0)
    n = 256
    while True:
        a, b = torch.randn(n, n, generator=g).to(dt), torch.randn(n, n, generator=g).to(dt)
        torch.mm(a, b)  # warm-up
        start = time.perf_counter()
        torch.mm(a, b)
        if n * 2 > max_n or time.perf_counter() - start >= 0.02:
            break
        n *= 2
    best = 0.0
    for _ in range(trials):
        iters, start = 0, time.perf_counter()
        while time.perf_counter() - start < 0.1 or iters < 2:
            torch.mm(a, b)
            iters += 1
        best = max(best, 2 * n**3 * iters / (time.perf_counter() - start))
    return best


def reprobe_cpu_matmul_peak(dtype: str) -> float:
    """:func:`measure_cpu_matmul_peak` measured anew (not the process's cached figure), kept when higher."""
    threads = torch.get_num_threads()
    fresh = measure_cpu_matmul_peak.__wrapped__(dtype, threads=threads)
    return max(fresh, measure_cpu_matmul_peak(dtype, threads=threads))


def memory_stats(device: torch.device) -> dict[str, float]:
    """Memory in GiB: CUDA allocated/reserved/peak and allocation retries, or process RSS on CPU."""
    gib = 1024**3
    if device.type == "cuda":
        s = torch.cuda.memory_stats(device)
        return {
            "mem_alloc_gib": s.get("allocated_bytes.all.current", 0) / gib,
            "mem_reserved_gib": s.get("reserved_bytes.all.current", 0) / gib,
            "mem_peak_gib": s.get("allocated_bytes.all.peak", 0) / gib,
            "alloc_retries": s.get("num_alloc_retries", 0),
        }
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # no /proc: the peak is the best estimate
        rss = peak_rss
    return {"mem_rss_gib": rss / gib, "mem_peak_rss_gib": peak_rss / gib}
