"""The metrics' hook in the loop (:class:`MetricsHook`): throughput, MFU (the family's FLOPs per token over
:mod:`titanlite.trainer.peaks`), memory, update ratio, ETA and summary, logged through ``metrics_log``."""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titanlite.trainer.hooks import Hook, LoopState
from titanlite.trainer.metrics_log import MetricsLogger, finite_json, write_file_whole
from titanlite.trainer.peaks import memory_stats, peak_flops, reprobe_cpu_matmul_peak

logger = logging.getLogger(__name__)


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
    difference: on logging steps only, as the copy costs a parameter-sized buffer (multi-tensor ops throughout).
    Healthy AdamW training shows ratios around 1e-3; a jump by orders of magnitude marks an unstable step."""

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
    """Wall time, ETA to the configured steps and the end-of-run summary (rank 0 logs them). The ETA and the
    summary's means (tokens/s, MFU) leave out this process's first step (start-up and compilation); the ETA
    includes validation and checkpoint time."""

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
    """``[metrics]`` in the loop: a step record (docs/monitoring.md, "What a run reports"; plus ``result.extra``)
    at the first and last step and every ``log_freq`` steps, rank 0's progress line and summary (to
    ``summary_path``). It owns the metrics log: at the start, after the resume has loaded its checkpoint (a failed
    resume leaves the log untouched), the log becomes ``state.sink``, rewound to ``state.step``."""

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

    def set_flops_per_token(self, flops: int) -> None:
        """The training FLOPs per token MFU counts from the next record on (they grow with a stage's seq_len)."""
        self.flops_per_token = flops

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
        moment lowers: a utilization above 100% re-measures it once and keeps the higher; a peak still below what
        training achieves is implausible, said once in a warning, and MFU is unknown from then on."""
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
