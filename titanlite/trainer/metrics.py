"""Throughput, MFU, memory and the metrics log (console, metrics.jsonl, TensorBoard).

FLOPs per token are the model family's (:func:`titanlite.models.registry.model_counts`; PaLM's
``6 N + attention`` formula, :func:`titanlite.planner.palm_flops_per_token`, for the built-in
families). MFU = achieved FLOP/s / peak FLOP/s of the dtype the matmuls run in. Peaks are dense
(no 2:4 sparsity). An unknown GPU gets no guessed peak: MFU is then reported as None. On CPU the
peak is a measured matmul rate (:func:`measure_cpu_matmul_peak`, once per process, when first
needed), logged alongside. :class:`MetricsHook` is the metrics' place in the training loop.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import math
import os
import re
import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titanlite.dtypes import DTYPES
from titanlite.hooks import Hook, LoopState
from titanlite.wandb_logger import WandbLogger, import_wandb

logger = logging.getLogger(__name__)

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

    Square matmuls from 256 up, the size doubled while one takes under 20 ms (at most ``max_n``): large
    enough to reach the kernel's rate, small enough that a dtype without a native kernel costs a second,
    not minutes (bf16 on an AVX2-only CPU runs at ~1 GFLOP/s: one 2048 matmul took ~25 s there). Then the
    best of ``trials`` ~0.1 s timings, so a busy moment does not lower the peak and inflate MFU (a loaded
    CPU still does: CPU MFU is indicative). A private generator leaves torch's global RNG alone."""
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


class DiskFullError(OSError):
    """No space left (ENOSPC, or EDQUOT: over quota) while writing one of a run's files. One line naming the
    file; ``python -m titanlite.train`` prints it as ``error: ...`` and exits 2, like other user errors."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()  # the message alone: it already names the errno


def disk_full_error(error: OSError, path: str | os.PathLike, what: str) -> OSError:
    """``error`` as a :class:`DiskFullError` naming ``path`` when it means the disk (or quota) is full, else
    ``error`` itself."""
    if error.errno not in (errno.ENOSPC, errno.EDQUOT):
        return error
    reason = "the disk is full" if error.errno == errno.ENOSPC else "the disk quota is exceeded"
    return DiskFullError(
        error.errno, f"{reason} (errno {errno.errorcode[error.errno]}): could not write {path}; {what}"
    )


class MetricsLogger:
    """``[metrics]``: records to ``<dump_folder>/metrics.jsonl`` (one line each, on disk before :meth:`log`
    returns), TensorBoard and Weights & Biases (:mod:`titanlite.wandb_logger`), on rank 0 only. Opening the
    file never changes it: only :meth:`rewind`, called once a resume has loaded its checkpoint, drops the
    records after a step (the resumed run logs them again; W&B keeps what it got and gets them again). A
    write that fails midway (disk full) is cut back, so the file never ends in a torn line."""

    def __init__(
        self, section: Any, dump_folder: str | os.PathLike, rank: int = 0, run_config: dict[str, Any] | None = None
    ):
        self.enabled, self.writer, self.wandb, self.failed = rank == 0, None, None, False
        self.path = Path(dump_folder) / "metrics.jsonl"
        if getattr(section, "enable_wandb", False):
            import_wandb()  # on every rank: a missing extra stops all of them alike, before anything is written
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "ab", buffering=0)  # appends only; unbuffered: no half-written line held back
        if section.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(dump_folder) / section.save_tb_folder))
        if getattr(section, "enable_wandb", False):
            self.wandb = WandbLogger(section, dump_folder, run_config)  # rank 0 only

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._append(strict_json_line(record), record.get("step"))
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, record["step"])
                elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                    self.writer.add_text(key, as_markdown(value), record["step"])  # e.g. [sampling]'s prompts
        if self.wandb is not None:
            self.wandb.log(record)

    def _append(self, line: bytes, step: Any) -> None:
        """Write one whole line, or nothing: on an error midway the file is truncated back to its previous end
        (a disk-full error becomes a :class:`DiskFullError`)."""
        fd = self.file.fileno()
        end = os.fstat(fd).st_size
        view = memoryview(line)
        try:
            while view:  # a raw write may take only part of the line
                view = view[self.file.write(view) :]
        except OSError as e:
            self.failed = True
            with contextlib.suppress(OSError):  # e.g. not a regular file; the error below is what matters
                os.ftruncate(fd, end)
            raise disk_full_error(e, self.path, f"the record of step {step} was not written") from e

    def rewind(self, step: int) -> None:
        if self.enabled:
            rewind_metrics_log(self.path, step)
            self.file.close()  # the file may have been replaced (see rewind_metrics_log): append to the new one
            self.file = open(self.path, "ab", buffering=0)

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.writer is not None:
                self.writer.close()
            if self.wandb is not None:
                self.wandb.close()


def as_markdown(items: list[dict[str, Any]]) -> str:
    """TensorBoard text of a list of records: one paragraph each, a bold key before each value."""
    return "\n\n".join("  \n".join(f"**{k}**: {v}" for k, v in item.items()) for item in items)


def write_file_whole(path: Path, text: str | bytes) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it: ``path`` holds the old or the new
    text, never a part (disk full: a :class:`DiskFullError`, and the old file is left as it was)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        if isinstance(text, bytes):
            tmp.write_bytes(text)
        else:
            tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise disk_full_error(e, path, "it was left as it was") from e


def finite_json(record: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``record`` for strict JSON (RFC 8259: no bare ``NaN``/``Infinity``, which most readers other than
    Python's refuse): a non-finite number, at any depth, becomes ``None`` and is named in a ``"nonfinite"`` map
    (``{"loss": "nan", "grad_norm": "inf"}``; nested ones as ``key.sub`` / ``key[i]``)."""
    flags: dict[str, str] = {}

    def clean(value: Any, where: str) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            flags[where] = "nan" if value != value else "inf" if value > 0 else "-inf"
            return None
        if isinstance(value, dict):
            return {k: clean(v, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return value

    out = clean(record, "")
    if flags:
        out["nonfinite"] = {**(out.get("nonfinite") or {}), **flags}
    return out


def strict_json_line(record: dict[str, Any]) -> bytes:
    """``record`` as one line of strict JSON (:func:`finite_json`), newline included."""
    return (json.dumps(finite_json(record), allow_nan=False) + "\n").encode("utf-8")


def rewind_metrics_log(path: str | os.PathLike, step: int) -> int:
    """Keep every record of ``metrics.jsonl`` whose step is <= ``step``, in order, and drop the records after
    ``step`` (the resumed run logs them again). A line that is no record (unparsable, torn by a crash, without an
    integer step) is never dropped silently: it is appended to ``<path>.quarantine`` as it was, and a warning names
    its line numbers. When the kept records are the file's first lines, the file is cut with ``truncate`` in place
    (a logger holding it open in append mode keeps appending at the new end); otherwise it is rewritten through a
    temporary file renamed over it (a crash leaves the old or the new file, never a mix), and a holder must reopen
    it (:meth:`MetricsLogger.rewind` does). Returns how many lines were removed from the file."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, bad, dropped, prefix, prefix_end = [], [], 0, True, 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line) if line.endswith(b"\n") else None
            except ValueError:
                record = None
            rec_step = record.get("step") if isinstance(record, dict) else None
            if not isinstance(rec_step, int) or isinstance(rec_step, bool):
                bad.append((number, line))
                prefix = False
            elif rec_step <= step:
                kept.append(line)
                prefix_end += len(line) if prefix else 0
            else:
                dropped += 1
                prefix = False
    if not bad and not dropped:
        return 0
    if bad:
        quarantine = path.with_name(path.name + ".quarantine")
        with open(quarantine, "ab") as q:
            q.write(b"".join(line if line.endswith(b"\n") else line + b"\n" for _, line in bad))
            q.flush()
            os.fsync(q.fileno())
        numbers = ", ".join(str(n) for n, _ in bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
        logger.warning(
            "metrics log %s: %d line(s) are no JSON record with an integer step (line %s); skipped, moved as they "
            "were to %s; the valid records around them are kept",
            path,
            len(bad),
            numbers,
            quarantine,
        )
    if prefix_end == sum(len(line) for line in kept):  # the kept records are the first lines: cut in place
        os.truncate(path, prefix_end)
    else:
        write_file_whole(path, b"".join(kept))
    if dropped:
        logger.info("metrics log %s: removed %d record(s) after step %d (they are logged again)", path, dropped, step)
    return dropped + len(bad)


def num_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Number of parameters, tied (shared) tensors counted once (``parameters()`` de-duplicates
    them); optionally without the input embedding table (when tied, the shared table is excluded)."""
    total = sum(p.numel() for p in model.parameters())
    emb = getattr(model, "tok_embeddings", None) if exclude_embedding else None
    return total - (emb.weight.numel() if emb is not None else 0)


def _layer_of(name: str) -> str:
    """Group a parameter name per transformer block (``layers.3``) or top-level module (``output``)."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def _global_square_sums(params: list[torch.Tensor], *tensor_lists: list[torch.Tensor]) -> list[list[float]]:
    """For each list of local tensors (one per parameter of ``params``, shaped like its local shard), the squared
    L2 norm of each over all its shards: per (mesh, placements) group of ``params`` one multi-tensor norm per
    list, then one reduction and host transfer for all lists, summed over the sharded mesh dimensions only
    (a replicated one would count the same values twice)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    out: list[dict[int, float]] = [{} for _ in tensor_lists]
    groups: dict[Any, list[int]] = {}
    for i, p in enumerate(params):
        key = (id(p.device_mesh), tuple(p.placements)) if isinstance(p, DTensor) else None
        groups.setdefault(key, []).append(i)
    for key, idx in groups.items():
        norms = [torch.stack(torch._foreach_norm([ts[i] for i in idx], 2.0)) for ts in tensor_lists]
        sq = torch.cat(norms).float().square()
        if key is not None:
            first = params[idx[0]]
            placements = [Replicate() if p.is_replicate() else Partial("sum") for p in first.placements]
            sq = DTensor.from_local(sq, first.device_mesh, placements, run_check=False).full_tensor()
        values = sq.tolist()
        for k, found in enumerate(out):
            found.update(zip(idx, values[k * len(idx) : (k + 1) * len(idx)]))
    return [[found[i] for i in range(len(params))] for found in out]


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach()


class UpdateRatio:
    """``||update|| / ||parameters||`` of one optimizer step, overall and optionally per layer.

    :meth:`before_step` copies the (local shards of the FSDP/TP) parameters, :meth:`after_step` measures the
    difference: on logging steps only, as the copy costs a parameter-sized buffer. Multi-tensor ops throughout
    (one copy, one subtraction, two norms per sharding group, one host transfer per group): ``scripts/bench.py``
    reports the cost per log step (``update_ratio_cost``). Healthy AdamW training shows ratios around 1e-3; a
    jump by orders of magnitude marks an unstable step."""

    def __init__(self, model: nn.Module, per_layer: bool = False, pp_group: Any = None):
        self.named = list({id(p): (n, p) for n, p in model.named_parameters() if p.requires_grad}.values())
        self.per_layer, self.pp_group = per_layer, pp_group  # pipeline stages: each holds some layers
        self._saved: list[torch.Tensor] | None = None

    @torch.no_grad()
    def before_step(self) -> None:
        self._saved = torch._foreach_mul([_local(p) for _, p in self.named], 1.0)  # one multi-tensor copy

    def cancel(self) -> None:
        """Drop the copy (the update was skipped)."""
        self._saved = None

    @torch.no_grad()
    def after_step(self) -> dict[str, float]:
        if self._saved is None:
            return {}
        old, self._saved = self._saved, None
        update = torch._foreach_sub([_local(p) for _, p in self.named], old)
        upd, par = _global_square_sums([p for _, p in self.named], update, old)  # relative to the old parameters
        per: dict[str, tuple[float, float]] = {}
        for (name, _), u, w in zip(self.named, upd, par):
            su, sw = per.get(layer := _layer_of(name), (0.0, 0.0))
            per[layer] = (su + u, sw + w)
        if self.pp_group is not None:  # every stage's layers (each layer lives on one stage)
            stages: list[Any] = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(stages, per, group=self.pp_group)
            per = {k: v for stage in stages for k, v in stage.items()}
        out = {"update_ratio": _ratio(sum(u for u, _ in per.values()), sum(w for _, w in per.values()))}
        if self.per_layer:
            out |= {f"update_ratio/{layer}": _ratio(u, w) for layer, (u, w) in per.items()}
        return out


def _ratio(update_sq: float, param_sq: float) -> float:
    return math.sqrt(update_sq) / math.sqrt(param_sq) if param_sq > 0 else float("nan")


def format_duration(seconds: float | None) -> str:
    """``3h05m``, ``4m12s``, ``9.5s``; ``?`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{sec:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


class RunProgress:
    """Wall time, ETA to the configured steps and the end-of-run summary (rank 0 logs them).

    The ETA uses the mean wall time per step since the first step of this process finished (that
    step includes start-up and compilation), so validation and checkpoint time are part of it.
    Means in the summary (tokens/s, MFU) are over the steps after the first, when there are any.
    """

    def __init__(self, total_steps: int, start_step: int = 0):
        self.total_steps, self.start_step, self.t_start = total_steps, start_step, time.perf_counter()
        self.restart(start_step)
        self.windows: list[tuple[float, float, float | None, int]] = []  # (seconds, tokens/s, mfu, steps)
        self.last_loss = self.last_val_loss = None
        self.tokens_seen = 0

    def restart(self, step: int) -> None:
        """At the start, and after a rollback to ``step``: the ETA clock starts at the next step's end."""
        self.t_first: float | None = None  # end of the first step run by this process (since the restart)
        self.step_first: int | None = None
        self.last_step = step

    def step_done(self, step: int) -> None:
        self.last_step = step
        if self.t_first is None:
            self.t_first, self.step_first = time.perf_counter(), step

    def eta_seconds(self) -> float | None:
        if self.t_first is None or self.last_step <= self.step_first:
            return None
        per_step = (time.perf_counter() - self.t_first) / (self.last_step - self.step_first)
        return per_step * max(self.total_steps - self.last_step, 0)

    def record(self, r: dict[str, Any], window_s: float, window_steps: int) -> None:
        """A logged step record (loss, tokens_per_s, mfu, tokens_seen) covering ``window_steps`` steps."""
        self.windows.append((window_s, r.get("tokens_per_s", 0.0), r.get("mfu"), window_steps))
        self.last_loss = r.get("loss", self.last_loss)
        self.tokens_seen = r.get("tokens_seen", self.tokens_seen)

    def validation(self, val_loss: float) -> None:
        self.last_val_loss = val_loss

    def summary(self) -> dict[str, Any]:
        windows = self.windows[1:] if len(self.windows) > 1 else self.windows
        secs = sum(w[0] for w in windows)
        tps = sum(w[1] * w[0] for w in windows) / secs if secs > 0 else None
        mfus = [(w[2], w[0]) for w in windows if w[2] is not None]
        mfu = sum(m * s for m, s in mfus) / sum(s for _, s in mfus) if mfus and secs > 0 else None
        return {
            "steps": self.last_step,
            "steps_this_run": self.last_step - self.start_step,
            "tokens_seen": self.tokens_seen,
            "wall_s": time.perf_counter() - self.t_start,
            "mean_tokens_per_s": tps,
            "mean_mfu": mfu,
            "last_loss": self.last_loss,
            "last_val_loss": self.last_val_loss,
        }


def format_summary(s: dict[str, Any]) -> str:
    def num(v: float | None, fmt: str) -> str:
        return "n/a" if v is None else format(v, fmt)

    mfu = "unknown" if s["mean_mfu"] is None else f"{100 * s['mean_mfu']:.2f}%"
    return (
        f"run summary: {s['steps']} steps ({s['steps_this_run']} in this run), {s['tokens_seen']:,} tokens, "
        f"wall time {format_duration(s['wall_s'])}, mean {num(s['mean_tokens_per_s'], ',.0f')} tokens/s per "
        f"device, mean MFU {mfu}, last loss {num(s['last_loss'], '.4f')}, "
        f"last validation loss {num(s['last_val_loss'], '.4f')}"
    )


class MetricsHook(Hook):
    """``[metrics]`` in the loop: a step record at the first and last step and every ``log_freq`` steps (loss,
    grad norm, lr, tokens/s, MFU from ``flops_per_token`` and ``matmul_dtype``, memory, data wait, update
    ratio, ETA, and whatever ``result.extra`` holds, e.g. the guard's counters), rank 0's progress line, the
    summary (rank 0 writes it to ``summary_path``). It owns the metrics log: at the start it becomes
    ``state.sink`` and is rewound to ``state.step`` (a fresh start logs from scratch). ``on_train_start`` comes
    after the resume has loaded its checkpoint, so a resume that fails leaves the log untouched."""

    def __init__(
        self,
        section: Any,
        log: MetricsLogger,
        *,
        device: torch.device,
        world_size: int = 1,
        flops_per_token: int = 0,
        matmul_dtype: str = "float32",
        model: nn.Module | None = None,
        summary_path: Path | None = None,
        pp_group: Any = None,
    ):
        self.section, self.log, self.device, self.world_size = section, log, device, world_size
        self.flops_per_token, self.matmul_dtype, self.summary_path = flops_per_token, matmul_dtype, summary_path
        track = model is not None and section.log_update_ratio
        self.update_ratio = UpdateRatio(model, section.update_ratio_per_layer, pp_group) if track else None
        self.progress = RunProgress(0)
        self.window = (time.perf_counter(), 0, 0, 0.0)  # start, steps, tokens, data wait
        self.side_start = 0.0  # the loop's side_seconds when the window started

    def is_log_step(self, step: int, total: int) -> bool:
        return step == 1 or step % self.section.log_freq == 0 or step == total

    @functools.cached_property
    def peak_flops(self) -> float | None:
        """Peak FLOP/s of the device in the matmul dtype (None: unknown GPU), when first needed; settable."""
        peak = peak_flops(self.device, self.matmul_dtype)
        if peak is not None and self.device.type == "cpu":
            logger.info("MFU is against this CPU's measured matmul peak: %.1f GFLOP/s", peak / 1e9)
        return peak

    def plausible_mfu(self, achieved_flops: float) -> float | None:
        """``achieved_flops / peak``; None when the peak is unknown. On CPU the peak is a measurement, which a busy
        moment lowers: a utilization above 100% (111-163% were logged on a shared CPU) re-measures it once and keeps
        the higher; a peak still below what training achieves is implausible, said once in a warning, and MFU is
        reported as unknown from then on."""
        peak = self.peak_flops
        if peak is None or achieved_flops <= peak or self.device.type != "cpu":
            return None if peak is None else achieved_flops / peak
        fresh = reprobe_cpu_matmul_peak(self.matmul_dtype)
        logger.info(
            "CPU matmul peak measured again: %.1f GFLOP/s (training reached %.1f)", fresh / 1e9, achieved_flops / 1e9
        )
        if achieved_flops <= fresh:
            self.peak_flops = fresh
            return achieved_flops / fresh
        logger.warning(
            "MFU of %.0f%% is not plausible: this CPU's measured matmul peak (%.1f GFLOP/s, %.1f measured again) is "
            "below what training reaches (%.1f GFLOP/s; the CPU was busy while it was measured?): MFU is reported "
            "as unknown from now on",
            100 * achieved_flops / peak,
            peak / 1e9,
            fresh / 1e9,
            achieved_flops / 1e9,
        )
        self.peak_flops = None
        return None

    def _rewind(self, state: LoopState) -> None:
        """Drop the records after ``state.step`` (a resumed run logs them again); a new timing window."""
        self.log.rewind(state.step)
        state.records[:] = [r for r in state.records if r["step"] <= state.step]
        self.window, self.side_start = (time.perf_counter(), 0, 0, 0.0), state.side_seconds
        if self.update_ratio is not None:
            self.update_ratio.cancel()  # a copy taken for a step that was rolled back

    def on_train_start(self, state: LoopState) -> None:
        state.sink = self.log
        self.progress = RunProgress(state.total_steps, state.step)
        self._rewind(state)

    def before_update(self, state: LoopState, result: Any) -> None:
        if self.update_ratio is not None and self.is_log_step(result.step, state.total_steps):
            self.update_ratio.before_step()  # copies the parameters: logging steps only

    def on_step_end(self, state: LoopState, result: Any) -> None:
        start, steps, tokens, data_s = self.window
        steps, tokens, data_s = steps + 1, tokens + result.tokens, data_s + result.data_s
        self.window = (start, steps, tokens, data_s)
        self.progress.step_done(state.step)
        if self.update_ratio is not None and result.action != "update":
            self.update_ratio.cancel()
        if not self.is_log_step(state.step, state.total_steps):
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start - (state.side_seconds - self.side_start)  # training time only
        tps = tokens / self.world_size / elapsed
        mfu = self.plausible_mfu(tps * self.flops_per_token)
        loss, grad_norm = result.fetch()
        record = {
            "step": state.step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": result.lr,
            "tokens_per_s": tps,
            "tokens_per_s_global": tps * self.world_size,
            "mfu": mfu,
            "tokens_seen": state.tokens_seen,
            **{f"tokens_seen/{name}": n for name, n in state.source_tokens.items()},  # a mixture's sources
            "data_wait_frac": data_s / elapsed,
            "eta_s": self.progress.eta_seconds(),
            **memory_stats(self.device),
            **result.extra,
        }
        if self.update_ratio is not None:
            record.update(self.update_ratio.after_step())  # {} when no copy was taken
        self.progress.record(record, elapsed, steps)
        state.log(record)
        self.log_line(record, state.total_steps)
        self.window, self.side_start = (time.perf_counter(), 0, 0, 0.0), state.side_seconds

    def on_resume(self, state: LoopState, result: Any) -> None:
        """After a rollback to ``state.step``: its later records go, the ETA clock restarts."""
        self._rewind(state)
        self.progress.restart(state.step)

    def on_train_end(self, state: LoopState) -> None:
        if val := [r["val_loss"] for r in state.records if "val_loss" in r]:
            self.progress.validation(val[-1])
        summary = self.progress.summary()
        logger.info(format_summary(summary))
        try:
            if self.summary_path is not None and not self.log.failed:  # after a failed write: that error stands
                write_file_whole(self.summary_path, json.dumps(finite_json(summary), indent=1, allow_nan=False) + "\n")
        finally:
            self.log.close()

    @staticmethod
    def log_line(r: dict[str, Any], total: int) -> None:
        mfu = "unknown" if r["mfu"] is None else f"{100 * r['mfu']:.2f}%"
        mem = r.get("mem_peak_gib", r.get("mem_rss_gib", 0.0))
        upd = f" | upd/param {r['update_ratio']:.1e}" if "update_ratio" in r else ""
        if "moe/load_max_mean" in r:  # a mixture-of-experts model: the worst block's max/mean expert load
            upd += f" | moe load {r['moe/load_max_mean']:.2f} aux {r['moe/aux_loss']:.2e}"
        logger.info(
            f"step {r['step']:4d}/{total} ({100 * r['step'] / total:.0f}%) | loss {r['loss']:.4f} | grad_norm "
            f"{r['grad_norm']:.3f} | lr {r['lr']:.2e} | tok/s {r['tokens_per_s']:,.0f} (global "
            f"{r['tokens_per_s_global']:,.0f}) | mfu {mfu} | mem {mem:.2f} GiB | data {100 * r['data_wait_frac']:.0f}%"
            f"{upd} | eta {format_duration(r.get('eta_s'))}"
        )
