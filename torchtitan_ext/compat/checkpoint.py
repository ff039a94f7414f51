"""Resume titanlite training from a torchtitan DCP checkpoint of a Llama 3 model.

What torchtitan (v0.2) writes in ``<dump_folder>/<checkpoint.folder>/step-N/`` (``.metadata`` +
``__<rank>_0.distcp``, no titanlite ``checkpoint.json``), as DCP keys:

=============================  ==============================================================
``tok_embeddings.weight`` ...  the model, *flattened to the top level* (v0.2; torchtitan before
                               its state-dict flattening stored it under ``model.``: both read)
``optimizer.state.<fqn>.*``    AdamW ``exp_avg``, ``exp_avg_sq``, ``step`` per parameter, from
                               ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``;
                               ``optimizer.param_groups.<fqn>.*`` hyper-parameters
``lr_scheduler.*``             the LambdaLR state (``last_epoch`` ...)
``dataloader.*``               ``dp_rank_<r>`` pickles of torchtitan's data loader, ``world_size``
``train_state.*``              ``step`` and ``ntokens_seen`` (ints; older versions: tensors)
=============================  ==============================================================

A model-only save (``last_save_model_only``, or the step-0 seed checkpoint) holds the model keys only.

Parameter names are the same in titanlite's Llama 3 (Meta's names, ``layers`` a ModuleDict), so
:func:`load_torchtitan_checkpoint` reads the model and AdamW moments straight into titanlite's
(possibly FSDP/TP-sharded) model and optimizer, DCP resharding as needed. It takes the step and
token count from ``train_state``; the learning-rate position follows from the step (the compat
trainer uses torchtitan's schedule formula). Not restored: the data position (torchtitan's loader
state describes its own datasets; titanlite's loader starts from the beginning of its data order,
with a warning) and the optimizer hyper-parameters (taken from the config, as torchtitan does on
resume, except that torchtitan would also restore its stored lr, which its scheduler overwrites).
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titanlite.checkpoint import layout, safe_load
from titanlite.checkpoint.layout import list_step_folders

logger = logging.getLogger("torchtitan_ext.compat")

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def is_torchtitan_checkpoint(path: str | os.PathLike) -> bool:
    """A DCP folder (``.metadata``) that titanlite did not write (no ``checkpoint.json``)."""
    p = Path(path)
    return (p / ".metadata").is_file() and not (p / "checkpoint.json").exists()


def list_torchtitan_checkpoints(folder: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of torchtitan step folders in ``folder``, oldest first (torchtitan's own rule:
    ``step-N`` with a ``.metadata`` file)."""
    return [(f.step, f.path) for f in list_step_folders(folder) if is_torchtitan_checkpoint(f.path)]


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """What a torchtitan checkpoint holds (from its DCP metadata only, read without running code
    a crafted ``.metadata`` could carry: :mod:`titanlite.checkpoint.safe_load`)."""
    keys = safe_load.read_metadata(path).state_dict_metadata
    if "tok_embeddings.weight" in keys:
        prefix = ""
    elif "model.tok_embeddings.weight" in keys:
        prefix = "model."
    else:
        raise ValueError(
            f"{path}: no tok_embeddings.weight (or model.tok_embeddings.weight): not a torchtitan "
            "checkpoint of a Llama 3 model"
        )
    return {
        "keys": keys,
        "prefix": prefix,
        "optimizer": any(k.startswith("optimizer.state.") for k in keys),
        "train_state": "train_state.step" in keys,
        "dataloader": any(k.startswith("dataloader.") for k in keys),
    }


def _placeholder(md) -> Any:
    if isinstance(md, TensorStorageMetadata):
        return torch.zeros(tuple(md.size), dtype=md.properties.dtype)
    if isinstance(md, BytesStorageMetadata):
        return 0  # an int (or any object): DCP unpickles the stored value in its place
    raise ValueError(f"unexpected DCP metadata {type(md).__name__}")


@torch.no_grad()
def load_torchtitan_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    model_only: bool = False,
    exclude: Iterable[str] = (),
) -> dict[str, Any]:
    """Load a torchtitan checkpoint into ``model`` (and ``optimizer``) in place; collective when
    distributed. Returns ``{"step", "tokens_seen", "loaded": [...], "skipped": [...]}``.

    ``model_only`` (or a checkpoint that has nothing else) loads the weights only, step 0.
    ``exclude`` names top-level states not to load (torchtitan's ``checkpoint.exclude_from_loading``).
    A model whose parameter names or shapes differ raises a one-line ``ValueError``, and so does a
    non-tensor item that is not plain data (a pickle that would run code is refused unread).
    """
    path = str(path)
    info = describe(path)
    keys, prefix = info["keys"], info["prefix"]
    exclude = set(exclude)
    model_sd = get_model_state_dict(model)
    for name, tensor in model_sd.items():
        md = keys.get(prefix + name)
        if md is None:
            raise ValueError(f"{path} has no {prefix + name}: it was saved from another model")
        if tuple(md.size) != tuple(tensor.shape):
            raise ValueError(
                f"{path}: {name} is {list(md.size)} in the checkpoint but {list(tensor.shape)} in this "
                "model (another flavor, or another tokenizer vocabulary)"
            )
    state: dict[str, Any] = dict(model_sd) if prefix == "" else {"model": model_sd}
    loaded, skipped = ["model"], []
    full = not model_only
    osd = None
    if full and optimizer is not None and info["optimizer"] and "optimizer" not in exclude:
        osd = get_optimizer_state_dict(model, optimizer, options=FLAT)  # initializes empty AdamW state
        moments = {k: v for k, v in osd.items() if k.startswith("state.")}
        missing = [k for k in moments if f"optimizer.{k}" not in keys]
        if missing:
            raise ValueError(f"{path} lacks optimizer.{missing[0]} (saved with another optimizer or model)")
        state["optimizer"] = moments
        loaded.append("optimizer")
    elif full and "optimizer" not in exclude:
        skipped.append("optimizer")
    train_state = None
    if full and info["train_state"] and "train_state" not in exclude:
        train_state = {
            k.split(".", 1)[1]: _placeholder(md)
            for k, md in keys.items()
            if k.startswith("train_state.") and k.count(".") == 1
        }
        state["train_state"] = train_state
        loaded.append("train_state")
    safe_load.load(state, path)
    step = tokens = 0
    if train_state is not None:
        step = _as_int(train_state.get("step", 0), f"{path}: train_state.step")
        tokens = _as_int(train_state.get("ntokens_seen", 0), f"{path}: train_state.ntokens_seen")
    set_model_state_dict(model, model_sd if prefix == "" else state["model"])
    if osd is not None:
        osd.update(state["optimizer"])
        set_optimizer_state_dict(model, optimizer, osd, options=FLAT)
    if full and info["dataloader"] and "dataloader" not in exclude:
        skipped.append("dataloader")
    return {"step": step, "tokens_seen": tokens, "loaded": loaded, "skipped": skipped, "prefix": prefix}


def _as_int(v: Any, what: str) -> int:
    """An int, a one-element tensor, or (older torchtitan) a BytesIO holding a ``torch.save``-d one."""
    try:
        if hasattr(v, "seek"):
            v.seek(0)
            v = torch.load(v, weights_only=True)  # plain data only: a pickle that runs code is refused
        return int(v.item() if isinstance(v, torch.Tensor) else v)
    except (pickle.UnpicklingError, TypeError, ValueError, RuntimeError, EOFError) as e:
        raise ValueError(f"{what} is not an integer ({safe_load.one_line(e)})") from None


def choose_source(
    torchtitan_folder: str, load_step: int, initial_load_path: str, initial_model_only: bool
) -> dict[str, Any] | None:
    """Which torchtitan checkpoint to start from, torchtitan's way: the newest (or ``load_step``)
    step folder of the run's checkpoint folder, else ``initial_load_path``; step 0 is model-only."""
    found = list_torchtitan_checkpoints(torchtitan_folder) if torchtitan_folder else []
    if found:
        if load_step != -1:
            match = [p for s, p in found if s == load_step]
            if not match:
                raise ValueError(
                    f"checkpoint.load_step={load_step}: no torchtitan checkpoint step-{load_step} in "
                    f"{torchtitan_folder} (have: {', '.join(str(s) for s, _ in found)})"
                )
            step, path = load_step, match[0]
        else:
            step, path = found[-1]
        problem = _problem_with(path)
        if problem:
            raise ValueError(f"torchtitan checkpoint {path} is damaged: {problem}")
        return {"path": str(path), "model_only": step == 0, "why": "torchtitan checkpoint folder"}
    if initial_load_path:
        if not is_torchtitan_checkpoint(initial_load_path):
            raise ValueError(f"checkpoint.initial_load_path={initial_load_path}: not a DCP checkpoint folder")
        problem = _problem_with(initial_load_path)
        if problem:
            raise ValueError(f"checkpoint.initial_load_path={initial_load_path}: {problem}")
        return {"path": initial_load_path, "model_only": initial_model_only, "why": "checkpoint.initial_load_path"}
    return None


def _problem_with(path: str | os.PathLike) -> str | None:
    """:func:`layout.problem_with` for a folder torchtitan wrote (no ``checkpoint.json``); its
    ``.metadata`` is read with :mod:`titanlite.checkpoint.safe_load`'s allowlist."""
    return layout.problem_with(path, require_info=False)


def broadcast_from_rank0(fn):
    """``fn()`` on rank 0, its result (or its ValueError) on every rank."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return fn()
    box = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except ValueError as e:
            box[0] = ("error", str(e))
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise ValueError(value)
    return value
