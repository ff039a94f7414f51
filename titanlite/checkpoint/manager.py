"""CheckpointManager: periodic (optionally asynchronous) DCP saves and exact resume.

What a full checkpoint holds (one DCP state dict, flattened by DCP):

=================  ===========================================================================
``model``          ``get_model_state_dict``: sharded DTensors under FSDP/TP, plain tensors else
``optimizer``      ``get_optimizer_state_dict``: AdamW moments and step, keyed by parameter name
``lr_scheduler``   the scheduler's state (pickled)
``train_state``    ``step`` and ``tokens_seen``
``dataloader``     ``dp_rank_<r>``: each data-parallel rank's loader state (pickled)
``rng``            ``rank_<r>``: each rank's python / torch / CUDA generator states (pickled)
=================  ===========================================================================

plus ``checkpoint.json`` (step, model family and resolved args, tokenizer ids) and the resolved
``config.toml`` next to the DCP files (see :mod:`titanlite.checkpoint.layout`). A model-only save
(the last one with ``last_save_model_only``) holds ``model`` only, cast to ``export_dtype``.

DCP re-partitions model and optimizer tensors to whatever layout loads them (1 process, FSDP, TP,
FSDP x TP). The data-loader state of rank ``r`` is taken from ``dp_rank_<r>`` or, when the
data-parallel degree changed, from ``dp_rank_0``; the loader then re-partitions its global cursor
exactly or refuses with an error (:class:`titanlite.data.windows.TokenWindows`).

Saving (``async_mode``):

- ``disabled``: stage nothing; ``dcp.save`` runs in the loop.
- ``async`` and ``async_with_pinned_mem``: a staging thread copies the state to CPU while the next
  step's forward and backward run (they do not modify what is saved); the loop only waits, if at
  all, in :meth:`CheckpointManager.wait_for_staging` just before the optimizer step, which is the
  first thing that changes the weights and AdamW state. A writer thread then saves the copy.
  ``async`` copies into fresh CPU memory, freed after the write; ``async_with_pinned_mem`` into
  buffers allocated once and reused (page-locked on CUDA: faster, truly asynchronous device-to-host
  copies), at the cost of holding a CPU copy of the state for the whole run.

At most one save is in flight: a save first waits for the previous write. Background writes use
their own gloo process group, so their collectives never interleave with the training ones.
Every save goes to ``step-N.partial-<token>`` and is renamed to ``step-N`` by rank 0 once complete;
``keep_latest_k`` then deletes older complete checkpoints, never the newest resumable one.

Loading: the choice of checkpoint is made in the constructor (so user errors such as a missing
``load_step`` surface before training starts, as one-line ``ValueError``\\ s); :meth:`load` does it.
A newest checkpoint that turns out damaged (missing/truncated file or metadata, unreadable data) is
reported in one line and the previous complete one is used instead.
"""
from __future__ import annotations

import copy
import dataclasses
import datetime
import logging
import pickle
import secrets
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titanlite.checkpoint import layout
from titanlite.checkpoint.metrics_log import rewind_metrics_log
from titanlite.checkpoint.staging import Stager
from titanlite.checkpoint.state import capture_rng, restore_rng

logger = logging.getLogger("titanlite.checkpoint")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Errors that mean "these files cannot be read", as opposed to a mismatch with this run.
_READ_ERRORS = (CheckpointException, OSError, EOFError, RuntimeError, pickle.UnpicklingError, ValueError)
CHECKPOINT_PG_TIMEOUT_S = 3600
# DCP warns on every single-process save/load; one process is a supported layout here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)


@dataclasses.dataclass
class LoadPlan:
    """What :meth:`CheckpointManager.load` will do; decided on rank 0 and shared."""

    kind: str = "none"  # none | resume | initial
    paths: list[str] = dataclasses.field(default_factory=list)  # candidates, preferred first
    model_only: bool = False
    notes: list[str] = dataclasses.field(default_factory=list)  # logged (warnings) at load


@dataclasses.dataclass
class SaveStats:
    step: int
    mode: str
    model_only: bool
    blocked_s: float = 0.0  # time the training loop waited for this save (wait_prev_s included)
    wait_prev_s: float = 0.0  # part of it spent waiting for the previous save's write to finish
    write_s: Optional[float] = None  # background (or inline) write time, once finished


class CheckpointManager:
    def __init__(self, job_config: Any, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 lr_scheduler: Any, dataloader: Any, train_state: Any, device: torch.device,
                 dp_rank: int = 0, model_info: Optional[dict[str, Any]] = None,
                 metrics_path: Optional[str] = None):
        from titanlite.config import config_to_toml

        self.cfg = job_config.checkpoint
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.dataloader, self.train_state, self.device = dataloader, train_state, device
        self.dp_rank = dp_rank
        self.model_info = dict(model_info or {})
        self.metrics_path = metrics_path
        self.config_toml = config_to_toml(job_config)
        self.folder = Path(job_config.job.dump_folder) / self.cfg.folder
        self.enabled = bool(self.cfg.enable)
        self.mode = self.cfg.async_mode
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.stats: list[SaveStats] = []

        self._pg = None
        if self.enabled and self.distributed:  # collective: every rank builds the manager
            self._pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=CHECKPOINT_PG_TIMEOUT_S))
        self._stager: Optional[Stager] = None
        self._writer: Optional[ThreadPoolExecutor] = None
        if self.enabled and self.mode != "disabled":
            pinned = self.mode == "async_with_pinned_mem"
            self._stager = Stager(reuse_buffers=pinned, background=True, pin_memory=pinned)
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-write")
            if pinned and not torch.cuda.is_available():
                logger.info("checkpoint: no CUDA, so staging buffers are reused but not page-locked")
        self._pending: Optional[Future] = None
        self._pending_step: Optional[int] = None
        self._staging: Optional[Future] = None
        self._closed = False
        # global shapes, computed on every rank (rank 0 alone plans, and must not run collectives)
        self._shapes: dict[str, tuple[int, ...]] = {}
        if self.enabled or self.cfg.initial_load_path:
            self._shapes = {k: tuple(v.shape) for k, v in get_model_state_dict(self.model).items()}
        self.token, self.plan = self._on_rank0(self._prepare)

    # ------------------------------------------------------------------ planning (constructor)
    def _prepare(self) -> tuple[str, LoadPlan]:
        """Rank 0: clean leftovers, choose what to load, validate it. ValueError on user errors."""
        token = secrets.token_hex(4)
        plan = LoadPlan()
        if self.enabled:
            for p in layout.list_partial_folders(self.folder):
                logger.warning("checkpoint: removing incomplete save %s (interrupted before it finished)", p)
                layout.remove(p)
            plan = self._plan_resume()
        if plan.kind == "none" and self.cfg.initial_load_path:
            plan = self._plan_initial()
        elif plan.kind == "resume" and self.cfg.initial_load_path:
            plan.notes.append(f"checkpoint.initial_load_path={self.cfg.initial_load_path} is ignored: "
                              f"resuming from {plan.paths[0]}")
        return token, plan

    def _plan_resume(self, newest: bool = False) -> LoadPlan:
        folders = layout.list_step_folders(self.folder)
        if self.cfg.load_step != -1 and not newest:
            want = self.cfg.load_step
            match = [f for f in folders if f.step == want]
            if not match:
                have = ", ".join(str(f.step) for f in folders) or "none"
                raise ValueError(f"checkpoint.load_step={want}: no checkpoint {layout.step_dir_name(want)} in "
                                 f"{self.folder} (complete checkpoints: {have})")
            path = match[0].path
            problem = layout.problem_with(path)
            if problem:
                raise ValueError(f"checkpoint.load_step={want}: {path} is damaged: {problem}")
            if layout.read_info(path).get("model_only"):
                raise ValueError(f"checkpoint.load_step={want}: {path} holds model weights only (an export), not "
                                 "a training state; load it with checkpoint.initial_load_path in a fresh folder")
            self._check_model(path, "checkpoint.load_step")
            return LoadPlan("resume", [str(path)])
        notes: list[str] = []
        paths: list[str] = []
        damaged: list[str] = []
        for f in reversed(folders):
            problem = layout.problem_with(f.path)
            if problem is None and layout.read_info(f.path).get("model_only"):
                if not paths:
                    notes.append(f"checkpoint {f.path.name} holds model weights only (export); not resumable, skipped")
                continue
            if problem is not None:
                if not paths:  # only the ones newer than what we will load matter
                    msg = f"checkpoint {f.path} is damaged ({problem}); falling back to the previous one"
                    logger.warning(msg)
                    damaged.append(f"{f.path.name}: {problem}")
                continue
            paths.append(str(f.path))
        if not paths:
            if damaged:
                raise ValueError(f"no usable checkpoint in {self.folder} ({'; '.join(damaged)}); move the folder "
                                 "away to start from scratch")
            return LoadPlan(notes=notes)
        self._check_model(paths[0], "resume")
        return LoadPlan("resume", paths, notes=notes)

    def _plan_initial(self) -> LoadPlan:
        path = Path(self.cfg.initial_load_path)
        what = f"checkpoint.initial_load_path={path}"
        if not path.is_dir():
            raise FileNotFoundError(f"{what}: no such folder")
        problem = layout.problem_with(path, require_info=False)
        if problem:
            raise ValueError(f"{what}: {problem}")
        model_only = bool(self.cfg.initial_load_model_only)
        if not model_only:
            keys = layout.read_metadata(path).state_dict_metadata
            if not any(k.startswith("optimizer.") for k in keys):
                raise ValueError(f"{what} holds no optimizer state; set checkpoint.initial_load_model_only = true")
        self._check_model(path, what)
        return LoadPlan("initial", [str(path)], model_only=model_only)

    def _check_model(self, path: str | Path, what: str) -> None:
        """The checkpoint's model tensors must exist with this model's (global) shapes."""
        stored = layout.read_metadata(path).state_dict_metadata
        for name, shape in self._shapes.items():
            md = stored.get(f"model.{name}")
            if md is None or not hasattr(md, "size"):
                raise ValueError(f"{what}: {path} has no tensor model.{name}; it was saved from a different model")
            if tuple(md.size) != shape:
                raise ValueError(f"{what}: {path} has model.{name} of shape {list(md.size)} but this model's is "
                                 f"{list(shape)} (the model config differs from the checkpoint's)")

    # ------------------------------------------------------------------ loading (train start)
    def load(self, rewind_metrics: bool = True) -> Optional[int]:
        """Carry out the plan: returns the step resumed from (None when nothing was resumed).

        On a resume, ``metrics.jsonl`` loses its records after the resumed step (they are logged
        again) unless ``rewind_metrics`` is false.
        """
        plan = self.plan
        for note in plan.notes:
            self._warn(note)
        if plan.kind == "none":
            if self.enabled:
                logger.info("checkpoint: nothing to resume in %s; starting from step 0", self.folder)
            return None
        if plan.kind == "initial":
            self._load_path(plan.paths[0], model_only=plan.model_only)
            what = "model weights only" if plan.model_only else "the full training state"
            self._warn("checkpoint: no checkpoint to resume in %s; loaded %s from initial_load_path %s",
                       self.folder, what, plan.paths[0])
            return None if plan.model_only else self.train_state.state_dict()["step"]
        failures = []
        for i, path in enumerate(plan.paths):
            if i > 0:
                problem = self._on_rank0(lambda p=path: layout.problem_with(p))
                if problem:
                    self._warn("checkpoint %s is damaged (%s); falling back to the previous one", path, problem)
                    failures.append(f"{Path(path).name}: {problem}")
                    continue
                try:
                    self._on_rank0(lambda p=path: self._check_model(p, "resume"))
                except ValueError as e:
                    self._warn("checkpoint %s does not fit this model (%s); falling back", path, e)
                    failures.append(f"{Path(path).name}: mismatch")
                    continue
            try:
                state = self._read(path, model_only=False)
            except _READ_ERRORS as e:
                msg = " ".join(str(e).split())[:300]
                self._warn("checkpoint %s could not be read (%s: %s); falling back to the previous one",
                           path, type(e).__name__, msg)
                failures.append(f"{Path(path).name}: {type(e).__name__}: {msg[:120]}")
                continue
            self._apply(state, path)
            ts = self.train_state.state_dict()
            self._warn("checkpoint: RESUMED from %s: step %d, %s tokens seen; model, optimizer, LR schedule, "
                       "data position and RNG restored", path, ts["step"], f"{ts.get('tokens_seen', 0):,}")
            if rewind_metrics and self.metrics_path and self.rank == 0:
                rewind_metrics_log(self.metrics_path, ts["step"])
            return ts["step"]
        raise RuntimeError(f"no checkpoint in {self.folder} could be loaded ({'; '.join(failures)}); "
                           "the model may be partly overwritten, so training does not start")

    def load_latest(self, rewind_metrics: bool = True) -> Optional[int]:
        """Reload the newest complete resumable checkpoint now (e.g. to roll back after a divergence),
        whatever ``load_step`` says; returns its step, or None when there is none. Collective.
        ``metrics.jsonl`` is rewound to that step as on a resume (unless ``rewind_metrics`` is false)."""
        if not self.enabled:
            return None
        self.wait()  # an in-flight save may become the newest complete checkpoint
        plan = self._on_rank0(lambda: self._plan_resume(newest=True))
        if plan.kind != "resume":
            return None
        self.plan = plan
        return self.load(rewind_metrics=rewind_metrics)

    def _load_path(self, path: str, *, model_only: bool) -> None:
        self._apply(self._read(path, model_only=model_only), path)

    def _read(self, path: str, *, model_only: bool) -> dict[str, Any]:
        """DCP-load ``path`` into this run's layout: model tensors in place, the rest returned."""
        keys = self._on_rank0(lambda: set(layout.read_metadata(path).state_dict_metadata))
        state: dict[str, Any] = {"model": get_model_state_dict(self.model)}
        if not model_only:
            state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
            state["lr_scheduler"] = b""
            state["train_state"] = dict(self.train_state.state_dict())
            own = f"dp_rank_{self.dp_rank}"
            state["dataloader"] = {own if f"dataloader.{own}" in keys else "dp_rank_0": b""}
            if f"rng.rank_{self.rank}" in keys:
                state["rng"] = {f"rank_{self.rank}": b""}
        dcp.load(state, checkpoint_id=path, process_group=self._pg, no_dist=not self.distributed)
        if not model_only:  # unpickling is part of reading: a damaged blob falls back too
            state["lr_scheduler"] = pickle.loads(state["lr_scheduler"])
            state["dataloader"] = {k: pickle.loads(v) for k, v in state["dataloader"].items()}
            if "rng" in state:
                state["rng"] = pickle.loads(state["rng"][f"rank_{self.rank}"])
        return state

    def _apply(self, state: dict[str, Any], path: str) -> None:
        set_model_state_dict(self.model, state["model"])
        if "optimizer" not in state:
            return
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.train_state.load_state_dict(state["train_state"])
        (loader_state,) = state["dataloader"].values()
        self.dataloader.load_state_dict(loader_state)
        if "rng" in state:
            restore_rng(state["rng"], self.device)
        else:
            logger.warning("checkpoint %s has no RNG state for rank %d (saved with fewer ranks); keeping the "
                           "seeded generators", path, self.rank)

    # ------------------------------------------------------------------ saving
    def save(self, step: int, *, last: bool = False, force: bool = False) -> bool:
        """Save when ``step`` is on the interval or ``last`` (model-only when ``last_save_model_only``),
        or, with ``force``, a full resumable checkpoint now (preemption). Returns whether a save
        started. Collective: every rank calls it with the same arguments."""
        if not self.enabled or (step % self.cfg.interval != 0 and not last and not force):
            return False
        model_only = last and self.cfg.last_save_model_only and not force
        dtype = _DTYPES[self.cfg.export_dtype] if model_only else None
        t0 = time.perf_counter()
        prev = self._pending_step
        self._wait_pending()  # at most one save in flight
        stats = SaveStats(step, self.mode, model_only, wait_prev_s=time.perf_counter() - t0)
        if prev is not None and stats.wait_prev_s > 0.1:
            self._warn("checkpoint step %d waited %.2f s for the write of step %d: the interval is shorter than "
                       "a write", step, stats.wait_prev_s, prev)
        self.stats.append(stats)
        state = self._state_dict(model_only, dtype)
        info = self._info(step, model_only, dtype)
        partial = self.folder / layout.partial_dir_name(step, self.token)
        final = self.folder / layout.step_dir_name(step)
        if self.mode == "disabled":
            self._write(state, partial, final, info, stats)
            stats.blocked_s = time.perf_counter() - t0
            logger.info("checkpoint %s saved in %.2f s%s", final, stats.blocked_s, " (model only)" if model_only else "")
            return True
        staged = self._stager.stage(state)
        if isinstance(staged, Future):
            self._staging = staged
            job = lambda: self._write(staged.result(), partial, final, info, stats)  # noqa: E731
        else:
            job = lambda: self._write(staged, partial, final, info, stats)  # noqa: E731
        del state
        self._pending, self._pending_step = self._writer.submit(job), step
        stats.blocked_s = time.perf_counter() - t0
        if isinstance(staged, Future):
            logger.info("checkpoint step %d: staging in the background, then an asynchronous write", step)
        else:
            logger.info("checkpoint step %d: staged for an asynchronous write (loop blocked %.1f ms)", step,
                        1e3 * stats.blocked_s)
        return True

    def wait_for_staging(self) -> None:
        """Block until the state being saved has been copied (call before the optimizer step)."""
        if self._staging is None:
            return
        t0 = time.perf_counter()
        self._staging.result()
        self._staging = None
        if self.stats:
            self.stats[-1].blocked_s += time.perf_counter() - t0

    def wait(self) -> None:
        """Block until the in-flight save (if any) is complete on disk."""
        self._wait_pending()

    def close(self) -> None:
        """Wait for the last save, then release threads and the checkpoint process group."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._pending is not None:
                logger.info("checkpoint: waiting for the write of step %d to finish", self._pending_step)
            self._wait_pending()
        finally:
            if self._stager is not None:
                self._stager.close()
            if self._writer is not None:
                self._writer.shutdown(wait=True)
            if self._pg is not None:
                dist.destroy_process_group(self._pg)
                self._pg = None

    def _wait_pending(self) -> None:
        if self._staging is not None:
            self.wait_for_staging()
        if self._pending is None:
            return
        fut, step = self._pending, self._pending_step
        self._pending = self._pending_step = None
        try:
            fut.result()
        except Exception as e:
            raise RuntimeError(f"asynchronous checkpoint save of step {step} failed: {type(e).__name__}: {e}") from e

    def _state_dict(self, model_only: bool, dtype: Optional[torch.dtype]) -> dict[str, Any]:
        model_sd = get_model_state_dict(self.model)
        if dtype is not None:
            model_sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in model_sd.items()}
        state: dict[str, Any] = {"model": model_sd}
        if model_only:
            return state
        state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        state["lr_scheduler"] = pickle.dumps(self.lr_scheduler.state_dict())
        state["train_state"] = copy.deepcopy(self.train_state.state_dict())
        state["dataloader"] = {f"dp_rank_{self.dp_rank}": pickle.dumps(self.dataloader.state_dict())}
        state["rng"] = {f"rank_{self.rank}": pickle.dumps(capture_rng(self.device))}
        return state

    def _info(self, step: int, model_only: bool, dtype: Optional[torch.dtype]) -> dict[str, Any]:
        ts = self.train_state.state_dict()
        return {
            "step": step,
            "tokens_seen": ts.get("tokens_seen"),
            "model_only": model_only,
            "dtype": str(dtype).removeprefix("torch.") if dtype is not None else None,
            "world_size": dist.get_world_size() if self.distributed else 1,
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **self.model_info,
        }

    def _write(self, state: dict[str, Any], partial: Path, final: Path, info: dict[str, Any],
               stats: SaveStats) -> None:
        t0 = time.perf_counter()
        if self.rank == 0:
            partial.mkdir(parents=True, exist_ok=True)
            layout.write_info(partial, info)
            (partial / layout.CONFIG_FILE).write_text(self.config_toml, encoding="utf-8")
        writer = dcp.FileSystemWriter(str(partial), single_file_per_rank=True, sync_files=True, thread_count=1)
        dcp.save(state, storage_writer=writer, process_group=self._pg, no_dist=not self.distributed)
        if self.rank == 0:  # DCP's coordinator wrote .metadata after every rank's data: complete
            layout.publish(partial, final, self.token)
            self._purge()
        stats.write_s = time.perf_counter() - t0
        if self.mode != "disabled":
            logger.info("checkpoint %s written in the background in %.2f s", final, stats.write_s)

    def _purge(self) -> None:
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        folders = layout.list_step_folders(self.folder)
        keep = {f.step for f in folders[-k:]}
        for f in reversed(folders):  # never delete the newest resumable checkpoint
            try:
                if not layout.read_info(f.path).get("model_only"):
                    keep.add(f.step)
                    break
            except ValueError:
                continue
        for f in folders:
            if f.step not in keep:
                logger.info("checkpoint: deleting %s (keep_latest_k=%d)", f.path, k)
                layout.remove(f.path)

    # ------------------------------------------------------------------ helpers
    def _warn(self, msg: str, *args: Any) -> None:
        """A warning every rank would log identically: rank 0 logs it."""
        if self.rank == 0:
            logger.warning(msg, *args)

    def _on_rank0(self, fn):
        """Run ``fn`` on rank 0 and give every rank its result; a ValueError/FileNotFoundError
        raised there is raised on every rank (same message)."""
        if not self.distributed:
            return fn()
        payload: Any = None
        if self.rank == 0:
            try:
                payload = ("ok", fn())
            except (ValueError, FileNotFoundError) as e:
                payload = (type(e).__name__, str(e))
        box = [payload]
        dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "ok":
            return value
        raise (FileNotFoundError if kind == "FileNotFoundError" else ValueError)(value)
