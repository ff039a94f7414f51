"""What a run loads, decided by :class:`ResumePlanner` on rank 0 when the checkpoint manager is built: the
newest intact resumable step folder (past damaged ones: the size and CRC-32 of every file are checked against
``checkpoint.json``; model-only exports skipped), ``load_step``, the ``initial_load_path`` seed (DCP or Hugging
Face), or nothing (also when the newest is at ``final_step``: a finished run). A candidate must hold this model's
global shapes; a user error is a one-line ``ValueError`` before training starts. After a resume from an older
step than the newest, the newer step folders (an abandoned lineage) move aside into
``abandoned-after-step-N-<token>``: never purged, overwritten or resumed later.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any

from titanlite.checkpoint import hf_import, layout
from titanlite.errors import CheckpointError, NotFoundError
from titanlite.utils.fsio import fsync_dir
from titanlite.utils.nesting import loads_toml

logger = logging.getLogger("titanlite.checkpoint")


def changed_settings(path: str | os.PathLike, info: dict[str, Any], config_toml: str) -> list[str]:
    """One line per setting this run changes from the checkpoint ``path`` it resumes: each model arg (from
    ``checkpoint.json``; those that change a weight's shape were refused before) and each other config key (from
    its ``config.toml``; e.g. ``quantize.linear.float8.enable``, MoE balancing coefficients), old and new."""
    old_info, new_args = layout.read_info(path), (info.get("model") or {}).get("args")
    old_args = (old_info.get("model") or {}).get("args")
    lines = _changes("model.", old_args, json.loads(json.dumps(new_args, default=str)))
    config_file = Path(path) / layout.CONFIG_FILE
    if config_toml and config_file.is_file():
        try:
            old_config = loads_toml(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            old_config = None
        seen = {key for key, _, _ in lines}  # a model arg set in [model] is named once, with its resolved value
        lines += [c for c in _changes("", _flat(old_config), _flat(loads_toml(config_toml))) if c[0] not in seen]
    where = Path(path).name
    return [f"resume: {key} changed from {old!r} ({where}) to {new!r}" for key, old, new in lines]


def _flat(table: Any, prefix: str = "") -> dict[str, Any]:
    """A TOML table as ``{"section.key": value}``."""
    if not isinstance(table, dict):
        return {}
    out: dict[str, Any] = {}
    for key, value in table.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def _changes(prefix: str, old: Any, new: Any) -> list[tuple[str, Any, Any]]:
    """``(prefix + key, old, new)`` for each key whose value differs (both mappings; nothing when either is not)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return []
    missing = "(not set)"
    return [
        (f"{prefix}{k}", old.get(k, missing), new.get(k, missing))
        for k in sorted(set(old) | set(new))
        if old.get(k, missing) != new.get(k, missing)
    ]


@dataclasses.dataclass
class LoadPlan:
    """What :meth:`CheckpointManager.load` will do; decided on rank 0 and shared."""

    kind: str = "none"  # none | resume | initial | complete (a checkpoint of final_step exists: nothing to do)
    paths: list[str] = dataclasses.field(default_factory=list)  # candidates, preferred first
    model_only: bool = False
    hf: bool = False  # an initial load from a Hugging Face model folder (weights through the family's adapter)
    notes: list[str] = dataclasses.field(default_factory=list)  # logged (warnings) at load


@dataclasses.dataclass
class ResumePlanner:
    """What a run in ``folder`` loads (``cfg``: the ``[checkpoint]`` section; ``shapes``: the model's global
    tensor shapes, stored under ``model_key``). Its methods read files: rank 0 calls them."""

    cfg: Any
    folder: Path
    shapes: dict[str, tuple[int, ...]]
    model_key: str
    final_step: int | None
    token: str = ""  # names the folder of an abandoned lineage; set by prepare()

    def prepare(self, enabled: bool, lock: Any) -> tuple[str, LoadPlan]:
        """Rank 0: clean leftovers, choose what to load, validate it. ValueError on user errors."""
        token = self.token = secrets.token_hex(4)
        plan = LoadPlan()
        if enabled:  # one run per checkpoint folder, wherever it lives: before anything is read or cleaned
            layout.refuse_inside_step_folder(self.folder, f"checkpoint.folder={self.folder}")
            lock.acquire()
        if enabled and (done := self.finished()):
            return token, LoadPlan("complete", [str(done)])
        if enabled:
            for p in layout.list_partial_folders(self.folder):
                logger.warning("checkpoint: removing incomplete save %s (interrupted before it finished)", p)
                layout.remove(p)
            plan = self.plan_resume()
        if plan.kind == "none" and self.cfg.initial_load_path:
            plan = self.plan_initial()
        elif plan.kind == "resume" and self.cfg.initial_load_path:
            plan.notes.append(
                f"checkpoint.initial_load_path={self.cfg.initial_load_path} is ignored: resuming from {plan.paths[0]}"
            )
        return token, plan

    def finished(self) -> Path | None:
        """The newest step folder when it is intact and at or past ``final_step`` (the run is done; a
        rerun must not retrain and overwrite its final export), unless ``load_step`` asks otherwise."""
        folders = layout.list_step_folders(self.folder)
        if self.final_step is None or self.cfg.load_step != -1 or not folders or folders[-1].step < self.final_step:
            return None
        if layout.problem_with(folders[-1].path):
            return None
        self.check_model(folders[-1].path, "the finished run in this folder")  # another model: one-line error
        return folders[-1].path

    def plan_resume(self, newest: bool = False) -> LoadPlan:
        folders = layout.list_step_folders(self.folder)
        if self.cfg.load_step != -1 and not newest:
            want = self.cfg.load_step
            match = [f for f in folders if f.step == want]
            if not match:
                have = ", ".join(str(f.step) for f in folders) or "none"
                raise CheckpointError(
                    f"checkpoint.load_step={want}: no checkpoint {layout.step_dir_name(want)} in "
                    f"{self.folder} (complete checkpoints: {have})"
                )
            path = match[0].path
            problem = layout.problem_with(path, verify=True)
            if problem:
                raise CheckpointError(f"checkpoint.load_step={want}: {path} is damaged: {problem}")
            if layout.read_info(path).get("model_only"):
                raise CheckpointError(
                    f"checkpoint.load_step={want}: {path} holds model weights only (an export), not "
                    "a training state; load it with checkpoint.initial_load_path in a fresh folder"
                )
            self.check_model(path, "checkpoint.load_step")
            return LoadPlan("resume", [str(path)])
        notes: list[str] = []
        paths: list[str] = []
        damaged: list[str] = []
        for f in reversed(folders):
            try:
                model_only = layout.read_info(f.path).get("model_only")
            except ValueError:
                model_only = False
            if model_only:
                if not paths:
                    notes.append(f"checkpoint {f.path.name} holds model weights only (export); not resumable, skipped")
                continue
            problem = layout.problem_with(f.path, verify=not paths)  # read it all only for the one to load
            if problem is not None:
                if not paths:  # only the ones newer than what we will load matter
                    logger.warning("checkpoint %s is damaged (%s); falling back to the previous one", f.path, problem)
                    damaged.append(f"{f.path.name}: {problem}")
                continue
            paths.append(str(f.path))
        if not paths:
            if damaged:
                raise CheckpointError(
                    f"no usable checkpoint in {self.folder} ({'; '.join(damaged)}); move the folder "
                    "away to start from scratch"
                )
            return LoadPlan(notes=notes)
        self.check_model(paths[0], "resume")
        return LoadPlan("resume", paths, notes=notes)

    def plan_initial(self) -> LoadPlan:
        path = Path(self.cfg.initial_load_path)
        what = f"checkpoint.initial_load_path={path}"
        if not path.is_dir():
            raise NotFoundError(f"{what}: no such folder")
        if not (path / layout.INFO_FILE).is_file() and (path / "config.json").is_file():
            return self.plan_initial_hf(path, what)
        problem = layout.problem_with(path, require_info=False, verify=True)
        if problem:
            raise CheckpointError(f"{what}: {problem}")
        model_only = bool(self.cfg.initial_load_model_only)
        if not model_only:
            keys = layout.read_metadata(path).state_dict_metadata
            if not any(k.startswith("optimizer.") for k in keys):
                raise CheckpointError(f"{what} holds no optimizer state; set checkpoint.initial_load_model_only = true")
        self.check_model(path, what)
        return LoadPlan("initial", [str(path)], model_only=model_only)

    def plan_initial_hf(self, path: Path, what: str) -> LoadPlan:
        """An HF model folder as the initial weights (model only): its tensors must have this model's shapes."""
        if not self.cfg.initial_load_model_only:
            raise CheckpointError(
                f"{what} is a Hugging Face folder (weights only): set checkpoint.initial_load_model_only"
            )
        spec, args = hf_import.hf_seed(path)
        expected = spec.hf_adapter(args).expected_shapes()
        for name, shape in self.shapes.items():
            if name not in expected:
                raise CheckpointError(f"{what}: the folder's {spec.name} model has no tensor {name}")
            if tuple(expected[name]) != shape:
                raise CheckpointError(
                    f"{what}: {name} has shape {list(expected[name])} in the folder but {list(shape)} in this "
                    "model (the model config differs from config.json)"
                )
        return LoadPlan("initial", [str(path)], model_only=True, hf=True)

    def check_model(self, path: str | Path, what: str) -> None:
        """The checkpoint's model tensors must exist with this model's (global) shapes."""
        stored = layout.read_metadata(path).state_dict_metadata
        own = Path(path).parent == self.folder  # this folder's run: another model needs a run of its own
        hint = "; to train another model, start a new run in another folder (job.dump_folder)" if own else ""
        for name, shape in self.shapes.items():
            md = stored.get(f"{self.model_key}.{name}")
            if md is None or not hasattr(md, "size"):
                raise CheckpointError(
                    f"{what}: {path} has no tensor {self.model_key}.{name}; it was saved from a different model{hint}"
                )
            if tuple(md.size) != shape:
                raise CheckpointError(
                    f"{what}: {path} has {self.model_key}.{name} of shape {list(md.size)} but this "
                    f"model's is {list(shape)} (the model config differs from the checkpoint's){hint}"
                )

    def set_aside_newer(self, step: int) -> None:
        """Rank 0, after resuming ``step``: move every newer step folder (an abandoned lineage, after an
        older ``load_step`` or a fallback past damaged ones) into ``abandoned-after-step-<step>-<token>``,
        so it is never purged by ``keep_latest_k``, overwritten or resumed later. Nothing is deleted."""
        newer = [f for f in layout.list_step_folders(self.folder) if f.step > step]
        if not newer:
            return
        aside = self.folder / f"abandoned-after-step-{step}-{self.token}"
        aside.mkdir(exist_ok=True)
        for f in newer:
            os.rename(f.path, aside / f.path.name)
        fsync_dir(self.folder)
        names = ", ".join(f.path.name for f in newer)
        logger.warning(f"checkpoint: resumed from step {step}, so the newer checkpoints ({names}) moved to {aside}")

    def unusable(self, path: str) -> str | None:
        """Why a fallback candidate cannot be loaded (damaged, or another model), or None."""
        problem = layout.problem_with(path, verify=True)
        if problem:
            return f"damaged ({problem})"
        try:
            self.check_model(path, "resume")
        except ValueError as e:
            return f"not this model's ({e})"
        return None
