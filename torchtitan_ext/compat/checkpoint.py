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

torchtitan 0.3.0 (read from its sources at the ``0.3.0rc1`` version commit) renamed two things and
fused the attention input projections; everything else above is unchanged (``train_state.step`` /
``ntokens_seen``, ``lr_scheduler.last_epoch``, ``dataloader.*``, the flat optimizer keys):

- the output projection is ``lm_head.weight`` (titanlite, like v0.2: ``output.weight``);
- each block's Q/K/V projections live in ``attention.qkv_linear``. With ``fuse_qkv`` (the default of
  every llama3 flavor) the *parameter* is one ``qkv_linear.wqkv.weight`` of ``(n_heads + 2 *
  n_kv_heads) * head_dim`` rows, grouped per key/value head: for kv head ``g`` the rows hold its
  ``n_heads // n_kv_heads`` query heads, then key head ``g``, then value head ``g`` (``head_dim``
  rows each) -- not ``[q; k; v]`` stacked. A state-dict hook splits it on save, so the *model*
  keys are the stock ``qkv_linear.wq/wk/wv.weight`` (same rows as titanlite's ``wq/wk/wv``), while
  the optimizer, which is keyed by parameter name, stores ``exp_avg``/``exp_avg_sq``/``step`` on
  ``qkv_linear.wqkv.weight`` in the fused row order. :func:`split_fused_qkv` undoes that grouping.
  Without ``fuse_qkv`` the optimizer state sits on ``qkv_linear.wq/wk/wv.weight``; both are read.
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
from torch.distributed.tensor import DTensor, distribute_tensor

from titanlite.checkpoint import layout, safe_load
from titanlite.checkpoint.layout import list_step_folders
from titanlite.errors import CheckpointError
from torchtitan_ext.compat.format import torchtitan_name, torchtitan_version

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


FUSED_030 = "attention.qkv_linear.wqkv.weight"  # the parameter torchtitan 0.3.0's optimizer state is keyed by


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """What a torchtitan checkpoint holds (from its DCP metadata only, read without running code
    a crafted ``.metadata`` could carry: :mod:`titanlite.checkpoint.safe_load`). ``version`` is
    ``"0.3"`` for torchtitan 0.3.0's names (``lm_head``, ``attention.qkv_linear.*``), else ``"0.2"``."""
    keys = safe_load.read_metadata(path).state_dict_metadata
    if "tok_embeddings.weight" in keys:
        prefix = ""
    elif "model.tok_embeddings.weight" in keys:
        prefix = "model."
    else:
        raise CheckpointError(
            f"{path}: no tok_embeddings.weight (or model.tok_embeddings.weight): not a torchtitan "
            "checkpoint of a Llama 3 model"
        )
    version = "0.3" if torchtitan_version(keys, path) == "0.3" else "0.2"
    return {
        "keys": keys,
        "prefix": prefix,
        "version": version,
        "fused_qkv": any(k.startswith("optimizer.state.") and FUSED_030 in k for k in keys),
        "optimizer": any(k.startswith("optimizer.state.") for k in keys),
        "train_state": "train_state.step" in keys,
        "dataloader": any(k.startswith("dataloader.") for k in keys),
    }


def split_fused_qkv(fused: torch.Tensor, n_heads: int, n_kv_heads: int) -> tuple[torch.Tensor, ...]:
    """``(q, k, v)`` rows of a torchtitan 0.3.0 fused ``wqkv``-shaped tensor (weight or its Adam
    moments): rows are grouped per kv head ``g`` as ``[q heads of g; k head g; v head g]``, so q, k
    and v come out in the stock per-projection head order (query head ``g * n_heads // n_kv_heads + j``)."""
    per_kv = n_heads // n_kv_heads
    rows, tail = fused.shape[0], tuple(fused.shape[1:])
    head_dim, rest = divmod(rows, n_kv_heads * (per_kv + 2))
    if rest or n_heads % n_kv_heads:
        raise CheckpointError(f"a fused qkv tensor of {rows} rows does not fit {n_heads} heads / {n_kv_heads} kv heads")
    grouped = fused.reshape(n_kv_heads, per_kv + 2, head_dim, *tail)
    q = grouped[:, :per_kv].reshape(-1, *tail)
    k = grouped[:, per_kv].reshape(-1, *tail)
    v = grouped[:, per_kv + 1].reshape(-1, *tail)
    return q.contiguous(), k.contiguous(), v.contiguous()


def _placeholder(md) -> Any:
    if isinstance(md, TensorStorageMetadata):
        return torch.zeros(tuple(md.size), dtype=md.properties.dtype)
    if isinstance(md, BytesStorageMetadata):
        return 0  # an int (or any object): DCP unpickles the stored value in its place
    raise CheckpointError(f"unexpected DCP metadata {type(md).__name__}")


def _check_model(path: str, keys, model_sd: dict[str, Any], prefix: str, version: str) -> dict[str, str]:
    """``{titanlite name: DCP key}`` for every model tensor; a one-line ValueError for a missing
    key or another shape."""
    names = {}
    for name, tensor in model_sd.items():
        key = prefix + torchtitan_name(name, version)
        md = keys.get(key)
        if md is None:
            raise CheckpointError(
                f"{path} has no {key}: it was saved from another model (read as a torchtitan {version} checkpoint)"
            )
        if tuple(md.size) != tuple(tensor.shape):
            raise CheckpointError(
                f"{path}: {name} is {list(md.size)} in the checkpoint but {list(tensor.shape)} in this "
                "model (another flavor, or another tokenizer vocabulary)"
            )
        names[name] = key
    return names


@torch.no_grad()
def load_torchtitan_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    model_only: bool = False,
    exclude: Iterable[str] = (),
) -> dict[str, Any]:
    """Load a torchtitan checkpoint (v0.2, older, or 0.3.0 layout) into ``model`` (and ``optimizer``)
    in place; collective when distributed. Returns ``{"step", "tokens_seen", "loaded": [...],
    "skipped": [...], "prefix", "version"}``.

    ``model_only`` (or a checkpoint that has nothing else) loads the weights only, step 0.
    ``exclude`` names top-level states not to load (torchtitan's ``checkpoint.exclude_from_loading``).
    A model whose parameter names or shapes differ raises a one-line ``ValueError``, and so does a
    non-tensor item that is not plain data (a pickle that would run code is refused unread).
    """
    path = str(path)
    info = describe(path)
    keys, prefix, version = info["keys"], info["prefix"], info["version"]
    exclude = set(exclude)
    model_sd = get_model_state_dict(model)
    names = _check_model(path, keys, model_sd, prefix, version)
    state: dict[str, Any] = {names[n]: t for n, t in model_sd.items()}  # the model's own tensors, filled in place
    loaded, skipped = ["model"], []
    full = not model_only
    osd, fused = None, {}
    if full and optimizer is not None and info["optimizer"] and "optimizer" not in exclude:
        osd = get_optimizer_state_dict(model, optimizer, options=FLAT)  # initializes empty AdamW state
        fused = _optimizer_targets(path, keys, osd, state, version, info["fused_qkv"])
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
    if fused:
        _load_fused_qkv(path, keys, osd, fused, _head_counts(model))
    step = tokens = 0
    if train_state is not None:
        step = _as_int(train_state.get("step", 0), f"{path}: train_state.step")
        tokens = _as_int(train_state.get("ntokens_seen", 0), f"{path}: train_state.ntokens_seen")
    set_model_state_dict(model, model_sd)
    if osd is not None:
        set_optimizer_state_dict(model, optimizer, osd, options=FLAT)
    if full and info["dataloader"] and "dataloader" not in exclude:
        skipped.append("dataloader")
    return {
        "step": step,
        "tokens_seen": tokens,
        "loaded": loaded,
        "skipped": skipped,
        "prefix": prefix,
        "version": version,
    }


def _optimizer_targets(
    path: str, keys, osd: dict[str, Any], state: dict[str, Any], version: str, fused_qkv: bool
) -> dict[str, list[str]]:
    """Put every AdamW moment of ``osd`` that the checkpoint stores under its own name into
    ``state`` (DCP key -> the optimizer's tensor, filled in place). Returns the moments stored on a
    fused 0.3.0 ``wqkv`` instead: ``{fused DCP key: [the optimizer's q, k, v keys]}``."""
    fused: dict[str, list[str]] = {}
    for k in (k for k in osd if k.startswith("state.")):
        name, _, moment = k[len("state.") :].rpartition(".")
        is_fused = fused_qkv and torchtitan_name(name, version, fused=True) != torchtitan_name(name, version)
        key = f"optimizer.state.{torchtitan_name(name, version, fused=is_fused)}.{moment}"
        if key not in keys:
            raise CheckpointError(f"{path} lacks {key} (saved with another optimizer or model)")
        if is_fused:
            fused.setdefault(key, []).append(k)
        else:
            state[key] = osd[k]
    return fused


def _head_counts(model: torch.nn.Module) -> tuple[int, int]:
    """``(n_heads, n_kv_heads)`` of a titanlite Llama 3 model (``model.args``)."""
    args = getattr(model, "args", None)
    if args is None or not hasattr(args, "kv_heads"):
        raise CheckpointError("splitting torchtitan 0.3.0's fused qkv optimizer state needs a titanlite Llama 3 model")
    return args.n_heads, args.kv_heads


def _load_fused_qkv(path: str, keys, osd: dict[str, Any], fused: dict[str, list[str]], heads: tuple[int, int]) -> None:
    """Read each fused ``wqkv`` moment whole (one block's at a time, so the extra memory is one
    block's fused moments on every rank), split it into q/k/v rows and copy each part into the
    optimizer's (possibly FSDP/TP-sharded) tensor of that projection."""
    by_block: dict[str, list[str]] = {}
    for key in fused:
        by_block.setdefault(key.rsplit(".", 1)[0], []).append(key)
    for block_keys in by_block.values():
        whole = {key: _placeholder(keys[key]) for key in block_keys}
        safe_load.load(whole, path)
        for key, tensor in whole.items():
            targets = sorted(fused[key], key=_projection_order)
            parts = split_fused_qkv(tensor, *heads) if tensor.dim() else (tensor,) * 3  # ``step`` is a scalar
            for target, part in zip(targets, parts):
                _copy_into(osd[target], part)


def _projection_order(optimizer_key: str) -> int:
    """0, 1, 2 for the q, k, v projection's optimizer key."""
    return ["wq", "wk", "wv"].index(optimizer_key.rsplit(".attention.", 1)[1].split(".")[0])


def _copy_into(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy the full tensor ``whole`` into ``target``, or into this rank's shard of a DTensor
    ``target`` (every rank holds ``whole``, so each cuts its own shard locally)."""
    if isinstance(target, DTensor):
        mine = distribute_tensor(
            whole.to(device=target.device, dtype=target.dtype),
            target.device_mesh,
            target.placements,
            src_data_rank=None,
        )
        target.to_local().copy_(mine.to_local())
    else:
        target.copy_(whole.to(device=target.device, dtype=target.dtype))


def _as_int(v: Any, what: str) -> int:
    """An int, a one-element tensor, or (older torchtitan) a BytesIO holding a ``torch.save``-d one."""
    try:
        if hasattr(v, "seek"):
            v.seek(0)
            v = torch.load(v, weights_only=True)  # plain data only: a pickle that runs code is refused
        return int(v.item() if isinstance(v, torch.Tensor) else v)
    except (pickle.UnpicklingError, TypeError, ValueError, RuntimeError, EOFError) as e:
        raise CheckpointError(f"{what} is not an integer ({safe_load.one_line(e)})") from None


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
                raise CheckpointError(
                    f"checkpoint.load_step={load_step}: no torchtitan checkpoint step-{load_step} in "
                    f"{torchtitan_folder} (have: {', '.join(str(s) for s, _ in found)})"
                )
            step, path = load_step, match[0]
        else:
            step, path = found[-1]
        problem = _problem_with(path)
        if problem:
            raise CheckpointError(f"torchtitan checkpoint {path} is damaged: {problem}")
        return {"path": str(path), "model_only": step == 0, "why": "torchtitan checkpoint folder"}
    if initial_load_path:
        if not is_torchtitan_checkpoint(initial_load_path):
            raise CheckpointError(f"checkpoint.initial_load_path={initial_load_path}: not a DCP checkpoint folder")
        problem = _problem_with(initial_load_path)
        if problem:
            raise CheckpointError(f"checkpoint.initial_load_path={initial_load_path}: {problem}")
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
        raise CheckpointError(value)
    return value
