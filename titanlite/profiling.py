"""``[profiling]``: torch.profiler traces and CUDA memory snapshots of chosen steps.

Traces: with ``enable_profiling``, the profiler idles, warms up for ``profiler_warmup`` steps and
records ``profiler_active`` steps ending at every multiple of ``profile_freq``; each window is
written to ``<dump_folder>/<save_traces_folder>/iteration_<step>/rank<r>.pt.trace.json``. View it
with TensorBoard's profiler plugin (``pip install torch-tb-profiler; tensorboard --logdir
<dump_folder>/<save_traces_folder>``, one run per iteration folder) or drop the file on
https://ui.perfetto.dev (Chrome trace format).

Memory snapshots (``enable_memory_snapshot``, CUDA only): the caching allocator's history is
recorded from the start, and ``iteration_<step>/rank<r>_memory_snapshot.pickle`` is dumped at every
multiple of ``profile_freq`` (drag it onto https://pytorch.org/memory_viz). On CPU there is no such
allocator history: a note is logged and nothing is recorded.

When both are off, :func:`build_profiler` returns None and the training loop does nothing extra.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from titanlite.hooks import Hook

logger = logging.getLogger("titanlite.profiling")

MEMORY_HISTORY_ENTRIES = 100_000


class Profiler:
    """Drives torch.profiler and memory snapshots; call :meth:`step` after each optimizer step."""

    def __init__(self, cfg, dump_folder: str, rank: int, device: torch.device, start_step: int = 0):
        self.cfg = cfg
        self.rank = rank
        self.device = device
        self.start_step = start_step
        self.trace_dir = Path(dump_folder) / cfg.save_traces_folder
        self.snapshot_dir = Path(dump_folder) / cfg.save_memory_snapshot_folder
        self.traces: list[Path] = []
        self.snapshots: list[Path] = []
        self._prof = None
        self._snapshots_on = False
        self._closing = False
        if cfg.enable_profiling:
            wait = cfg.profile_freq - cfg.profiler_warmup - cfg.profiler_active
            if wait < 0:
                raise ValueError(
                    f"[profiling] profiler_warmup ({cfg.profiler_warmup}) + profiler_active "
                    f"({cfg.profiler_active}) must be <= profile_freq ({cfg.profile_freq})"
                )
            base = torch.profiler.schedule(wait=wait, warmup=cfg.profiler_warmup, active=cfg.profiler_active)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
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
            logger.info(
                "profiling: traces of steps %d..N every %d steps to %s",
                cfg.profile_freq,
                cfg.profile_freq,
                self.trace_dir,
            )
        if cfg.enable_memory_snapshot:
            if device.type == "cuda":
                torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
                self._snapshots_on = True
                logger.info(
                    "profiling: CUDA memory snapshots every %d steps to %s", cfg.profile_freq, self.snapshot_dir
                )
            else:
                logger.info(
                    "profiling: enable_memory_snapshot needs CUDA (the caching allocator's history); on %s "
                    "no snapshot is recorded. Memory is still reported as process RSS in the metrics.",
                    device.type,
                )

    def _save_trace(self, prof) -> None:
        if self._closing:  # a window opened for a step that never ran (the loop ended)
            return
        step = self.start_step + prof.step_num
        folder = self.trace_dir / f"iteration_{step}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}.pt.trace.json"
        prof.export_chrome_trace(str(path))
        self.traces.append(path)
        logger.info("profiling: trace of step %d written to %s", step, path)

    def step(self, step: int) -> None:
        """Optimizer step ``step`` has finished."""
        if self._prof is not None:
            self._prof.step()
        if self._snapshots_on and step % self.cfg.profile_freq == 0:
            folder = self.snapshot_dir / f"iteration_{step}"
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"rank{self.rank}_memory_snapshot.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            self.snapshots.append(path)
            logger.info("profiling: memory snapshot of step %d written to %s", step, path)

    def close(self) -> None:
        if self._prof is not None:
            self._closing = True
            self._prof.stop()
            self._prof = None
        if self._snapshots_on:
            torch.cuda.memory._record_memory_history(enabled=None)
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
