"""The model args of a seed checkpoint (``[checkpoint] initial_load_path``): :func:`model_args_from_seed`."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from titanlite.checkpoint import layout
from titanlite.checkpoint.hf_import import hf_seed
from titanlite.errors import CheckpointError, one_line
from titanlite.models.registry import adopt_seed_args, state_shapes

logger = logging.getLogger(__name__)


def model_args_from_seed(
    spec, args: Any, explicit: Collection[str], seed: str | os.PathLike, what: str = "checkpoint.initial_load_path"
) -> Any:
    """``args`` with the model args of the seed checkpoint ``seed`` taken (and logged) by the rule of
    :func:`~titanlite.models.registry.adopt_seed_args`; ``explicit``: the ``[model]`` keys the config sets. A folder
    without ``checkpoint.json``, or none at all (the checkpoint manager reports that), leaves ``args`` as they are."""
    seed = Path(seed)
    what = f"{what}={seed}"
    if not (seed / layout.INFO_FILE).is_file() and (found := hf_seed(seed)) is not None:  # an HF model folder
        name, seed_args = found[0].name, dataclasses.asdict(found[1])
    elif not (seed / layout.INFO_FILE).is_file():
        if seed.is_dir():
            logger.info(
                "%s has no %s: its model args are not known, only tensor shapes are checked", what, layout.INFO_FILE
            )
        return args
    else:
        name, seed_args = _recorded_args(seed, what)
    if name != spec.name:
        raise CheckpointError(f"{what} holds a {name!r} model but this config trains {spec.name!r} (model.name)")

    def same_shapes(a: Any, b: Any) -> bool:
        return state_shapes(spec, a) == state_shapes(spec, b)

    def same_model(a: Any, b: Any) -> bool:  # the same config.json: the same model, however the args spell it
        hf = spec.hf_adapter
        return hf is not None and hf(a).hf_config(dtype=torch.float32) == hf(b).hf_config(dtype=torch.float32)

    kw = dict(run_args=spec.run_args, same_shapes=same_shapes, seed=str(seed), same_model=same_model)
    new_args, adopted = adopt_seed_args(args, seed_args, explicit, **kw)
    for k, v in adopted.items():
        logger.info(
            "model.%s = %r from the seed checkpoint %s (the config's flavor has %r)", k, v, seed, getattr(args, k)
        )
    _check_vocab(new_args, args, what)
    _log_kept_run_args(spec, args, seed_args, explicit, seed)
    return new_args


def _check_vocab(new_args: Any, args: Any, what: str) -> None:
    """Refuse a seed whose embedding table is smaller than the tokenizer's vocabulary (``args.vocab_size``, unless
    the config sets one): token ids past its last row would index nothing."""
    seed_vocab, wanted = getattr(new_args, "vocab_size", None), getattr(args, "vocab_size", None)
    if seed_vocab is not None and wanted is not None and seed_vocab < wanted:
        raise CheckpointError(
            f"{what} has vocab_size={seed_vocab}, smaller than the tokenizer's vocabulary ({wanted}, "
            "model.tokenizer_path): train it with the tokenizer it was trained with"
        )


def _log_kept_run_args(spec, args: Any, seed_args: dict, explicit: Collection[str], seed: Path) -> None:
    """Log each run arg (rotary-table length, kernels, MoE balancing ...) whose value this run keeps although the
    seed records another, so a flavor's value never replaces the seed's unseen."""
    for k in spec.run_args:
        if k in seed_args and k not in explicit and hasattr(args, k) and getattr(args, k) != seed_args[k]:
            logger.info(
                "model.%s = %r is this run's (the config's flavor); the seed checkpoint %s has %r: set model.%s to "
                "train with another value",
                k,
                getattr(args, k),
                seed,
                seed_args[k],
                k,
            )


def _recorded_args(seed: Path, what: str) -> tuple[Any, dict]:
    """The family name and model args a step folder's ``checkpoint.json`` records."""
    try:
        info = layout.read_info(seed)
    except ValueError as e:  # also UnicodeDecodeError: bytes that are not text
        raise CheckpointError(f"{what}: {seed / layout.INFO_FILE} is unreadable ({one_line(e)})") from None
    model = info.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("args"), dict):
        raise CheckpointError(f"{what}: {seed / layout.INFO_FILE} records no model args")
    return model.get("name"), model["args"]
