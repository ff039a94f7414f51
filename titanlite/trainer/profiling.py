"""``[profiling]``: torch.profiler traces and CUDA memory snapshots of chosen steps (where they go and how to view
them: docs/monitoring.md, "Profiling"); with both off :func:`build_profiler` returns None: nothing extra runs.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from titanlite.errors import ConfigError
from titanlite.trainer.hooks import Hook
from titanlite.utils import torch_compat

logger = logging.getLogger("titanlite.trainer.profiling")

MEMORY_HISTORY_ENTRIES = 100_000


class Profiler:
    """Drives torch.profiler and memory snapshots; call :meth:`step` after each optimizer step."""

    def __init__(self, cfg, dump_folder: str, rank: int, device: torch.device, start_step: int = 0):
        self.cfg, self.rank, self.device, self.start_step = cfg, rank, device, start_step
        self.trace_dir = Path(dump_folder) / cfg.save_traces_folder
        self.snapshot_dir = Path(dump_folder) / cfg.save_memory_snapshot_folder
        self.traces: list[Path] = []  # the files written
        self.snapshots: list[Path] = []
        self._prof, self._snapshots_on, self._closing = None, False, False
        if cfg.enable_profiling:
            wait = cfg.profile_freq - cfg.profiler_warmup - cfg.profiler_active
            if wait < 0:
                raise ConfigError(
                    f"[profiling] profiler_warmup ({cfg.profiler_warmup}) + profiler_active "
                    f"({cfg.profiler_active}) must be <= profile_freq ({cfg.profile_freq})"
                )
            base = torch.profiler.schedule(wait=wait, warmup=cfg.profiler_warmup, active=cfg.profiler_active)
            kind = torch.profiler.ProfilerActivity
            activities = [kind.CPU, kind.CUDA] if device.type == "cuda" else [kind.CPU]
            # profiler step i is our optimizer step start_step + i + 1 (the schedule stays aligned on resume)
            self._prof = torch.profiler.profile(
                activities=activities,
                schedule=lambda i: base(i + start_step),
                on_trace_ready=self._save_trace,
                record_shapes=True,
                profile_memory=True,
                with_stack=False,
            )
            self._prof.start()
            freq = cfg.profile_freq
            logger.info("profiling: traces of steps %d..N every %d steps to %s", freq, freq, self.trace_dir)
        if cfg.enable_memory_snapshot and device.type == "cuda":
            torch_compat.record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
            self._snapshots_on = True
            logger.info("profiling: CUDA memory snapshots every %d steps to %s", cfg.profile_freq, self.snapshot_dir)
        elif cfg.enable_memory_snapshot:
            logger.info(
                "profiling: enable_memory_snapshot needs CUDA (the caching allocator's history); on %s "
                "no snapshot is recorded. Memory is still reported as process RSS in the metrics.",
                device.type,
            )

    def _write(self, what: str, step: int, folder: Path, name: str, write, written: list[Path]) -> None:
        """``write(path)`` of ``folder/iteration_<step>/<name>``, recorded in ``written`` and logged."""
        path = folder / f"iteration_{step}" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        write(str(path))
        written.append(path)
        logger.info("profiling: %s of step %d written to %s", what, step, path)

    def _save_trace(self, prof) -> None:
        if not self._closing:  # else a window opened for a step that never ran (the loop ended)
            step, name = self.start_step + prof.step_num, f"rank{self.rank}.pt.trace.json"
            self._write("trace", step, self.trace_dir, name, prof.export_chrome_trace, self.traces)

    def step(self, step: int) -> None:
        """Optimizer step ``step`` has finished."""
        if self._prof is not None:
            self._prof.step()
        if self._snapshots_on and step % self.cfg.profile_freq == 0:
            name, dump = f"rank{self.rank}_memory_snapshot.pickle", torch.cuda.memory._dump_snapshot
            self._write("memory snapshot", step, self.snapshot_dir, name, dump, self.snapshots)

    def close(self) -> None:
        if self._prof is not None:
            self._closing = True
            self._prof.stop()
            self._prof = None
        if self._snapshots_on:
            torch_compat.record_memory_history(enabled=None)
            self._snapshots_on = False


def build_profiler(cfg, dump_folder: str, rank: int, device: torch.device, start_step: int = 0) -> Profiler | None:
    """A :class:`Profiler`, or None when ``[profiling]`` asks for nothing (zero cost)."""
    if not (cfg.enable_profiling or cfg.enable_memory_snapshot):
        return None
    return Profiler(cfg, dump_folder, rank, device, start_step)


class ProfilerHook(Hook):
    """``[profiling]`` in the loop: starts at the (possibly resumed) first step, steps after each
    optimizer step, stops at the end; nothing at all when profiling and snapshots are off."""

    def __init__(self, section, dump_folder: str, rank: int, device: torch.device):
        self.section, self.dump_folder, self.rank, self.device = section, dump_folder, rank, device
        self.profiler: Profiler | None = None

    def on_train_start(self, state) -> None:
        self.profiler = build_profiler(self.section, self.dump_folder, self.rank, self.device, state.step)

    def on_step_end(self, state, result) -> None:
        if self.profiler is not None:
            self.profiler.step(state.step)

    def on_train_end(self, state) -> None:
        if self.profiler is not None:
            self.profiler.close()
