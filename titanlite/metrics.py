"""Throughput, MFU, memory and the metrics log (console, metrics.jsonl, TensorBoard).

FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B): a forward+backward pass costs 6 FLOPs per
parameter that takes part in a matmul per token, plus the attention scores and weighted sum, which
cost 12 * n_layers * n_heads * head_dim * seq_len per token (2 matmuls of 2 FLOPs each, x3 for
forward+backward). "Parameters" here are the non-embedding ones plus the output projection: the
embedding lookup is a gather, not a matmul, but the output projection is a matmul even when its
weight is tied to the embedding (then it is counted once, as the output projection). Using the full
sequence length for attention overstates causal attention by ~2x on that term, as PaLM and most
MFU reports do; we keep the convention so figures compare across libraries.

MFU = achieved FLOP/s / peak FLOP/s of the dtype the matmuls run in. Peaks are dense (no 2:4
sparsity). An unknown GPU gets no guessed peak: MFU is then reported as None. On CPU the peak is a
measured fp32 matmul rate (``measure_cpu_matmul_peak``), reported alongside.
"""
from __future__ import annotations

import json
import logging
import os
import resource
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Dense peak TFLOP/s by (device-name substring, dtype). Checked in order: more specific names first.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"bfloat16": 756.0, "float8": 1513.0, "float32": 51.0}),
    ("H100 NVL", {"bfloat16": 835.0, "float8": 1671.0, "float32": 60.0}),
    ("H100", {"bfloat16": 989.5, "float8": 1979.0, "float32": 67.0}),  # SXM
    ("H200", {"bfloat16": 989.5, "float8": 1979.0, "float32": 67.0}),
    ("H20", {"bfloat16": 148.0, "float8": 296.0, "float32": 44.0}),
    ("GH200", {"bfloat16": 989.5, "float8": 1979.0, "float32": 67.0}),
    ("B200", {"bfloat16": 2250.0, "float8": 4500.0, "float32": 80.0}),
    ("A100", {"bfloat16": 312.0, "float32": 19.5}),
    ("L40S", {"bfloat16": 362.05, "float8": 733.0, "float32": 91.6}),
    ("MI300X", {"bfloat16": 1307.4, "float8": 2614.9, "float32": 163.4}),
]


def flops_per_token(model_args: Any, num_params_total: int, seq_len: int) -> int:
    """Training FLOPs per token: 6 * matmul parameters + attention term (see module docstring).

    ``num_params_total`` counts tied weights once. The embedding table is excluded from the matmul
    parameters unless it is tied (then the same tensor is the output projection).
    """
    embed = model_args.vocab_size * model_args.dim
    matmul_params = num_params_total - embed
    if getattr(model_args, "tie_word_embeddings", False):
        matmul_params += embed  # the shared tensor is used as the output projection
    head_dim = model_args.dim // model_args.n_heads
    attention = 12 * model_args.n_layers * model_args.n_heads * head_dim * seq_len
    return 6 * matmul_params + attention


def peak_flops(device: torch.device, dtype: str = "bfloat16") -> Optional[float]:
    """Dense peak FLOP/s of ``device`` for matmuls in ``dtype`` (bfloat16, float8, float32).

    CUDA: from the table by device name, None when unknown. CPU: the measured matmul rate.
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return peak_flops_for_name(name, dtype)
    if device.type == "cpu":
        return measure_cpu_matmul_peak(dtype)
    return None


def peak_flops_for_name(name: str, dtype: str) -> Optional[float]:
    for key, peaks in PEAK_TFLOPS:
        if key in name:
            tf = peaks.get(dtype)
            return None if tf is None else tf * 1e12
    return None


_CPU_PEAK_CACHE: dict[tuple[int, str], float] = {}


def measure_cpu_matmul_peak(dtype: str = "float32", n: int = 2048, trials: int = 5) -> float:
    """Measured matmul FLOP/s of this CPU in ``dtype`` with the current thread count.

    The best of ``trials`` short timings (each ~0.1 s), so a busy moment does not lower the peak
    and inflate MFU (other processes loading the CPU still do: CPU MFU is indicative). Cached.
    """
    key = (torch.get_num_threads(), dtype)
    if key in _CPU_PEAK_CACHE:
        return _CPU_PEAK_CACHE[key]
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype, torch.float32)
    a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
    torch.mm(a, b)  # warm-up
    best = 0.0
    for _ in range(trials):
        iters, start = 0, time.perf_counter()
        while time.perf_counter() - start < 0.1 or iters < 2:
            torch.mm(a, b)
            iters += 1
        best = max(best, 2 * n**3 * iters / (time.perf_counter() - start))
    _CPU_PEAK_CACHE[key] = best
    return best


def memory_stats(device: torch.device) -> dict[str, float]:
    """Memory in GiB: CUDA allocated/reserved/peak and allocation retries, or process RSS on CPU."""
    gib = 1024**3
    if device.type == "cuda":
        s = torch.cuda.memory_stats(device)
        return {"mem_alloc_gib": s.get("allocated_bytes.all.current", 0) / gib,
                "mem_reserved_gib": s.get("reserved_bytes.all.current", 0) / gib,
                "mem_peak_gib": s.get("allocated_bytes.all.peak", 0) / gib,
                "alloc_retries": s.get("num_alloc_retries", 0)}
    return {"mem_rss_gib": _current_rss_bytes() / gib,
            "mem_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / gib}


def _current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class MetricsLogger:
    """Writes metric records to ``metrics.jsonl`` and TensorBoard (rank 0 only; no-op elsewhere)."""

    def __init__(self, dump_folder: str, rank: int = 0, enable_tensorboard: bool = False,
                 tb_folder: str = "tb"):
        self.enabled = rank == 0
        self.writer = None
        self.path = Path(dump_folder) / "metrics.jsonl"
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a", encoding="utf-8")
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(dump_folder) / tb_folder))

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            step = record["step"]
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and value is not None:
                    self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.writer is not None:
                self.writer.close()


def num_params(model: nn.Module) -> int:
    """Number of parameters, tied (shared) tensors counted once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
