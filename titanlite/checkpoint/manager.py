"""CheckpointManager: periodic (optionally asynchronous) DCP saves of any Stateful objects, exact resume
(docs/checkpoints.md).

``CheckpointManager(section, folder, states={...})`` saves the objects by name (:mod:`~titanlite.checkpoint.state`
sorts them: the model and optimizers sharded and keyed by parameter name, so DCP re-partitions them to any layout;
a ``StatefulDataLoader`` per data-parallel rank, ``<name>.dp_rank_<r>``, a rank missing after a degree change taking
``dp_rank_0``'s position; every rank's RNG states when an optimizer is saved, unless ``rng`` says otherwise).
Non-tensor states are JSON in tensors (:mod:`~titanlite.checkpoint.codec`) sized from the metadata at load, so a
state whose shape changed still loads and nothing but DCP's ``.metadata`` is ever unpickled.

Asynchronous saves are ``dcp.async_save`` with a ``DefaultStager`` copying the state on its own thread during the
next forward and backward; the loop waits for the copy, if at all, in :meth:`wait_for_staging` before the
optimizer step. At most one save is in flight, its collectives on a gloo group of their own. Saves are published
by rename (:mod:`~titanlite.checkpoint.layout`); :class:`~titanlite.checkpoint.resume.ResumePlanner` decides what
to load. An enabled manager holds ``<folder>/.titanlite.lock`` until :meth:`close`.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import logging
import shutil
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
)
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlite.checkpoint import hf_import, layout, safe_load
from titanlite.checkpoint.resume import LoadPlan, ResumePlanner, changed_settings
from titanlite.checkpoint.safe_load import one_line
from titanlite.checkpoint.state import CheckpointStates
from titanlite.errors import CheckpointError, UserError
from titanlite.parallel.distributed import run_on_rank0
from titanlite.utils import torch_compat
from titanlite.utils.dtypes import DTYPES, dtype_name
from titanlite.utils.fsio import atomic_write
from titanlite.utils.run_lock import RunLock

logger = logging.getLogger("titanlite.checkpoint")

# Errors that mean "these files cannot be read", as opposed to a mismatch with this run.
_READ_ERRORS = (CheckpointException, OSError, EOFError, RuntimeError, ValueError, KeyError)
CHECKPOINT_PG_TIMEOUT_S = 3600


class CheckpointWriteError(UserError, OSError):
    """A save failed because the disk (or quota) is full; the message is one line for the user."""


def _disk_full(exc: BaseException, folder: Path) -> bool:
    """Whether a failed save ran out of space: ENOSPC/EDQUOT anywhere in the exception chain (DCP
    wraps each rank's error in a CheckpointException), or under 1 MiB left in ``folder``."""
    stack, seen = [exc], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        stack += [e.__cause__, e.__context__]
        for f in (getattr(e, "failures", None) or {}).values():
            stack.append(f[0] if isinstance(f, tuple) else f)
    try:
        return shutil.disk_usage(folder).free < (1 << 20)
    except OSError:
        return False


@dataclasses.dataclass
class SaveStats:
    step: int
    mode: str
    model_only: bool
    blocked_s: float = 0.0  # time the training loop waited for this save (wait_prev_s included)
    wait_prev_s: float = 0.0  # part of it spent waiting for the previous save's write to finish
    write_s: float | None = None  # background (or inline) write time, once finished
    checksum_s: float = 0.0  # part of write_s spent computing the files' checksums (rank 0)


class CheckpointManager:
    def __init__(
        self,
        section: Any,
        folder: str | Path,
        states: dict[str, Any],
        *,
        dp_rank: int = 0,
        device: torch.device | None = None,
        info: dict[str, Any] | None = None,
        config_toml: str = "",
        final_step: int | None = None,
        rng: bool | None = None,
    ):
        self.cfg, self.folder, self.dp_rank, self.final_step = section, Path(folder), dp_rank, final_step
        self.info, self.config_toml = dict(info or {}), config_toml
        self.enabled, self.mode = bool(section.enable), section.async_mode
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.stats: list[SaveStats] = []
        self.last_saved_step: int | None = None
        self.states = CheckpointStates(states, dp_rank=dp_rank, rank=self.rank, device=device, rng=rng)
        self.model_key, self.model = self.states.model_key, self.states.model
        self._pg = None
        if self.enabled and self.distributed:  # collective: every rank builds the manager
            timeout = datetime.timedelta(seconds=CHECKPOINT_PG_TIMEOUT_S)
            self._pg = dist.new_group(backend="gloo", timeout=timeout)
        self._stager = self._new_stager() if self.enabled and self.mode == "async_with_pinned_mem" else None
        self._pending: Future | None = None
        self._resumed_step: int | None = None  # set by a resume, until commit_resume()
        self._pending_step: int | None = None
        self._staging: Future | None = None
        self._closed = False
        # global shapes, computed on every rank (rank 0 alone plans, and must not run collectives)
        sd = get_model_state_dict(self.model) if self.enabled or section.initial_load_path else {}
        shapes = {k: tuple(v.shape) for k, v in sd.items()}
        self.resume = ResumePlanner(section, self.folder, shapes, self.model_key, final_step)
        self._lock = RunLock(self.folder, "checkpoint.folder")  # rank 0 holds it while enabled (ResumePlanner.prepare)
        self.token, self.plan = self._on_rank0(lambda: self.resume.prepare(self.enabled, self._lock))

    # ------------------------------------------------------------------ planning (constructor)
    def load(self) -> int | None:
        """Carry out the plan; returns the step resumed from (None when nothing was resumed)."""
        for k, v in self.states.per_rank.items():
            if isinstance(v[0], StatefulDataLoader) and torch_compat.loader_is_iterating(v[0]):
                raise RuntimeError(
                    f"CheckpointManager.load(): the data loader {k!r} is already being iterated, so "
                    "its saved position would not reach that iterator; load before iter(loader)"
                )
        return self._load(self.plan)

    def load_latest(self) -> int | None:
        """Reload the newest complete resumable checkpoint now (a rollback), whatever ``load_step``
        says; returns its step, or None when there is none. Collective. Take a new iterator of the
        data loader afterwards: the loaded position applies to the next ``iter()``."""
        if not self.enabled:
            return None
        self.wait()  # an in-flight save may become the newest complete checkpoint
        plan = self._on_rank0(lambda: self.resume.plan_resume(newest=True))
        step = self._load(plan) if plan.kind == "resume" else None
        self.commit_resume()
        return step

    def commit_resume(self) -> None:
        """Once the resume is known to be good (the caller has checked the data position too, e.g. by ``iter(loader)``),
        move the abandoned lineage's newer step folders aside (:meth:`ResumePlanner.set_aside_newer`). Collective; also
        done by the first :meth:`save`, so a resume that fails before leaves the folder as it was."""
        step, self._resumed_step = self._resumed_step, None
        if step is not None:
            self._on_rank0(lambda: self.resume.set_aside_newer(step))

    def _load(self, plan: LoadPlan) -> int | None:
        for note in plan.notes:
            self._warn(note)
        if plan.kind == "complete":
            return None
        if plan.kind == "none":
            if self.enabled:
                logger.info(f"checkpoint: nothing to resume in {self.folder}; starting from step 0")
            return None
        if plan.kind == "initial":
            path = plan.paths[0]
            if plan.hf:
                hf_import.load_hf_weights(path, self.model, process_group=self._pg)
            else:
                self.states.apply(self._read(path, model_only=plan.model_only), path)
            what = "model weights only" if plan.model_only else "the full training state"
            self._warn(
                f"checkpoint: no checkpoint to resume in {self.folder}; loaded {what} from initial_load_path {path}"
            )
            return None if plan.model_only else self._on_rank0(lambda: layout.read_info(path)["step"])
        failures = []
        for i, path in enumerate(plan.paths):
            name = Path(path).name
            problem = self._on_rank0(lambda p=path: self.resume.unusable(p)) if i > 0 else None
            if problem:  # the first candidate was checked when planning
                self._warn(f"checkpoint {path} is {problem}; falling back to the previous one")
                failures.append(f"{name}: {problem}")
                continue
            error = None
            try:
                state = self._read(path, model_only=False)
            except _READ_ERRORS as e:
                error = e
            if not self._all_ranks_ok(error is None):  # every rank falls back together, or none does
                msg = "failed on another rank" if error is None else one_line(error)
                self._warn(f"checkpoint {path} could not be read ({msg}); falling back to the previous one")
                failures.append(f"{name}: {msg[:150]}")
                continue
            self.states.apply(state, path)
            info = self._on_rank0(lambda p=path: layout.read_info(p))
            self._resumed_step = info["step"]  # newer folders move aside once the resume is committed
            tokens, what = info.get("tokens_seen") or 0, ", ".join(state)
            self._warn(f"checkpoint: RESUMED from {path}: step {info['step']}, {tokens:,} tokens seen; {what} restored")
            for line in self._on_rank0(lambda p=path: changed_settings(p, self.info, self.config_toml)):
                self._warn(line)
            return info["step"]
        raise CheckpointError(
            f"no checkpoint in {self.folder} could be loaded ({'; '.join(failures)}); "
            "the model may be partly overwritten, so training does not start"
        )

    def _all_ranks_ok(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (a MIN all-reduce on the checkpoint process group)."""
        if not self.distributed or self._pg is None:
            return ok
        flag = torch.tensor([int(ok)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._pg)
        return bool(flag.item())

    def _read(self, path: str, *, model_only: bool) -> dict[str, Any]:
        """DCP-load ``path`` into this run's layout: model tensors in place, the rest returned, decoded (decoding is
        part of reading: a damaged value falls back too)."""
        entries = self._on_rank0(lambda: layout.stored_entries(path))
        state = self.states.placeholders(path, entries, model_only)
        with layout.quiet_single_process():  # allowlisted .metadata, non-tensor items refused unless plain data
            safe_load.load(state, path, process_group=self._pg, no_dist=not self.distributed)
        return self.states.decode(state)

    # ------------------------------------------------------------------ saving
    def save(self, step: int, *, last: bool = False, force: bool = False) -> bool:
        """Save when ``step`` is on the interval or ``last`` (model-only when ``last_save_model_only``),
        or, with ``force``, a full resumable checkpoint now (preemption). Returns whether a save
        started. Collective: every rank calls it with the same arguments."""
        if not self.enabled or (step % self.cfg.interval != 0 and not last and not force):
            return False
        self.commit_resume()  # never write into the abandoned lineage's place
        model_only = last and self.cfg.last_save_model_only and not force
        dtype = DTYPES[self.cfg.export_dtype] if model_only else None
        t0 = time.perf_counter()
        prev = self._pending_step
        self.wait()  # at most one save in flight
        stats = SaveStats(step, self.mode, model_only, wait_prev_s=time.perf_counter() - t0)
        if prev is not None and stats.wait_prev_s > 0.1:
            self._warn(f"checkpoint step {step} waited {stats.wait_prev_s:.2f} s for the write of step {prev}")
        self.stats.append(stats)
        state = self.states.to_save(model_only, dtype, self._pg)
        partial = self.folder / layout.partial_dir_name(step, self.token)
        final = self.folder / layout.step_dir_name(step)
        info = self._info(step, model_only, dtype)  # now; written by rank 0 with the rest (DCP makes the folder)
        writer = dcp.FileSystemWriter(str(partial), single_file_per_rank=True, sync_files=True, thread_count=1)
        if self.mode == "disabled":
            try:
                with layout.quiet_single_process():
                    dcp.save(state, storage_writer=writer, process_group=self._pg, no_dist=not self.distributed)
                self._published(partial, final, info, stats, t0)
            except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
                self._raise_if_disk_full(e, step)
                raise RuntimeError(f"checkpoint save of step {step} failed: {one_line(e)}") from e
            stats.blocked_s, self.last_saved_step = time.perf_counter() - t0, step
            logger.info(
                "checkpoint %s saved in %.2f s%s", final, stats.blocked_s, " (model only)" if model_only else ""
            )
            return True
        stager = self._stager or self._new_stager()
        if torch.cuda.is_available():  # the staging stream must see the optimizer's queued writes
            torch.cuda.synchronize()
        response = dcp.async_save(
            state, storage_writer=writer, process_group=self._pg, async_stager=stager, no_dist=not self.distributed
        )
        self._staging, upload = response.staging_completion, response.upload_completion
        published: Future = Future()  # done once this rank's write is complete and, on rank 0, renamed
        self._pending, self._pending_step, self.last_saved_step = published, step, step

        def done(fut: Future) -> None:  # on DCP's writer thread, once this rank's part is written
            try:
                fut.result()
                self._published(partial, final, info, stats, t0)
                logger.info("checkpoint %s written in the background in %.2f s", final, stats.write_s)
                published.set_result(None)
            except BaseException as e:  # noqa: BLE001 - raised in the loop by the next wait
                published.set_exception(e)
            finally:
                if stager is not self._stager:
                    stager.close()

        upload.add_done_callback(done)
        stats.blocked_s = time.perf_counter() - t0
        logger.info("checkpoint step %d: staging in the background, then an asynchronous write", step)
        return True

    def _new_stager(self) -> DefaultStager:
        cuda = torch.cuda.is_available()
        options = StagingOptions(
            use_pinned_memory=cuda and self.mode == "async_with_pinned_mem",
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=cuda,
        )
        stager = DefaultStager(options)
        executor = torch_compat.staging_executor(stager)
        if cuda and executor is not None:
            # A new thread starts on CUDA device 0; leaving the staging stream's context there would make a
            # CUDA context on GPU 0 for every rank, so the staging thread is put on this rank's device first.
            executor.submit(torch.cuda.set_device, torch.cuda.current_device()).result()
        return stager

    def _info(self, step: int, model_only: bool, dtype: torch.dtype | None) -> dict[str, Any]:
        train = self.states.shared.get("train_state")
        return {
            "step": step,
            "tokens_seen": train.state_dict().get("tokens_seen") if train is not None else None,
            "model_only": model_only,
            "dtype": dtype_name(dtype) if dtype is not None else None,
            "world_size": dist.get_world_size() if self.distributed else 1,
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **self.info,
        }

    def _published(self, partial: Path, final: Path, info: dict, stats: SaveStats, t0: float) -> None:
        """This rank's part is written; rank 0 (whose save ends after every rank's) adds checkpoint.json
        and config.toml and publishes it. Off the training thread: file-system calls can stall behind
        the fsyncs of a write in flight (docs/benchmarks.md, "Checkpoint saves")."""
        if self.rank == 0:
            t1 = time.perf_counter()
            info["files"] = layout.file_checksums(partial)  # every rank's files are complete by now
            stats.checksum_s = time.perf_counter() - t1
            layout.write_info(partial, info)
            atomic_write(partial / layout.CONFIG_FILE, self.config_toml, hidden_tmp=True)
            layout.publish(partial, final, self.token)
            self._purge()
        stats.write_s = time.perf_counter() - t0

    def wait_for_staging(self) -> None:
        """Block until the state being saved has been copied (call before the optimizer step)."""
        if self._staging is None:
            return
        t0 = time.perf_counter()
        self._staging.result()
        self._staging = None
        if self.stats:
            self.stats[-1].blocked_s += time.perf_counter() - t0

    def close(self) -> None:
        """Wait for the last save, then release the stager, the checkpoint process group and the folder's lock."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._pending is not None:
                logger.info("checkpoint: waiting for the write of step %d to finish", self._pending_step)
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
            if self._pg is not None:
                dist.destroy_process_group(self._pg)
                self._pg = None
            self._lock.release()

    def wait(self) -> None:
        """Block until the in-flight save (if any) is complete on disk."""
        self.wait_for_staging()
        fut, step = self._pending, self._pending_step
        self._pending = self._pending_step = None
        if fut is None:
            return
        try:
            fut.result()
        except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
            self._raise_if_disk_full(e, step)
            raise RuntimeError(f"asynchronous checkpoint save of step {step} failed: {one_line(e)}") from e

    def intact(self) -> str:
        """``the previous checkpoints are intact (step-5, step-10)``: what a failure left to resume from."""
        have = ", ".join(f.path.name for f in layout.list_step_folders(self.folder)) or "none"
        return f"the previous checkpoints are intact ({have})"

    def _raise_if_disk_full(self, exc: Exception, step: int) -> None:
        if not _disk_full(exc, self.folder):
            return
        free = shutil.disk_usage(self.folder).free / 2**20
        err = CheckpointWriteError(
            f"disk full: checkpoint step {step} could not be written to {self.folder} ({free:.0f} MiB free); "
            f"{self.intact()}: free some space and rerun the same command to resume"
        )
        err.errno = errno.ENOSPC
        raise err from exc

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
        return run_on_rank0(fn) if self.distributed else fn()
