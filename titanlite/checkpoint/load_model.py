"""A trained model for inference (generation, evaluation): :func:`load_model` builds the family's model on one
device with the full weights and its tokenizer, from a titanlite step folder (family, args and tokenizer from
``checkpoint.json``, weights from DCP in any layout or dtype) or a Hugging Face folder (the family whose adapter
converts its architecture; the tokenizer from its files). The training loop evaluates its own sharded model
instead. ``tokenizer_path`` overrides the tokenizer (``"bytes"``: the built-in one); one that is not the model's is
refused. Errors are one line naming the file; extension modules a checkpoint records are never imported on its
word alone (docs/checkpoints.md).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from titanlite.checkpoint import hf_export, hf_import, layout, safe_load
from titanlite.checkpoint.hf_tokenizer_files import check_tokenizer, verified_tokenizer_path
from titanlite.config import ConfigError
from titanlite.config.sections import Training
from titanlite.config.toml_io import read_toml
from titanlite.errors import CheckpointError, NotFoundError, one_line
from titanlite.extensions import load_extensions
from titanlite.models.registry import state_shapes
from titanlite.tokenizer.hf import tokenizer_files


@dataclasses.dataclass
class LoadedModel:
    """The model (eval mode), its tokenizer, spec and args, the training ``step``, the ids that end a generation,
    where it came from, and ``trained_seq_len`` (the step folder's ``training.seq_len``, or the longest stage of its
    ``seq_len_schedule``); ``step`` and ``trained_seq_len`` are None for an HF folder."""

    model: nn.Module
    tokenizer: Any
    spec: Any
    args: Any
    step: int | None
    eos_ids: tuple[int, ...]
    path: Path
    trained_seq_len: int | None = None


def is_step_folder(path: str | os.PathLike) -> bool:
    return (Path(path) / layout.INFO_FILE).is_file()


def load_model(
    path: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    tokenizer_path: str | None = None,
    extensions: tuple[str, ...] | list[str] = (),
) -> LoadedModel:
    """Load the model in ``path`` (a titanlite step folder or an HF folder) onto ``device`` in ``dtype``."""
    path = Path(path)
    given = load_extensions(extensions)
    if not path.is_dir():
        raise NotFoundError(f"{path}: no such folder")
    if is_step_folder(path):
        spec, args, state, info = _from_step_folder(path, given)
        step, recorded = info.get("step"), (info.get("tokenizer") or {}).get("path", "")
        if tokenizer_path is None:  # the recorded one: found by its absolute path, checked by its hash
            recorded = verified_tokenizer_path(info.get("tokenizer") or {}, path / layout.INFO_FILE)
        tokenizer = _tokenizer(spec, tokenizer_path, recorded, f"the tokenizer {recorded!r} recorded in {path}")
        bos_id, eos_id = hf_export._token_ids(info, path)
        where = path / layout.INFO_FILE
        eos_ids = _ints(eos_id)
    elif (path / "config.json").is_file():
        config = hf_import.read_hf_config(path)
        spec, args = hf_import.model_for_hf(config, path / "config.json")
        state, step = hf_import.hf_state_dict(path, spec.hf_adapter(args)), None
        if tokenizer_path is None and not tokenizer_files(str(path)):
            raise CheckpointError(
                f"{path} has no tokenizer files: pass a tokenizer path (bytes for the built-in byte-level tokenizer)"
            )
        tokenizer = _tokenizer(spec, tokenizer_path, str(path), f"the tokenizer files in {path}")
        bos_id, where = hf_import.first_token_id(config.get("bos_token_id")), path / "config.json"
        eos_ids = _ints(config.get("eos_token_id"))
    else:
        raise CheckpointError(f"{path} is neither a titanlite checkpoint step folder nor a Hugging Face model folder")
    what = "the tokenizer given" if tokenizer_path is not None else f"the tokenizer of {path}"
    check_tokenizer(tokenizer, bos_id=bos_id, vocab_size=args.vocab_size, what=what, where=str(where))
    model = _build(spec, args, state, device, dtype, path)
    eos_ids = tuple(dict.fromkeys((*eos_ids, tokenizer.eos_id)))
    trained = trained_seq_len(path) if is_step_folder(path) else None
    return LoadedModel(model, tokenizer, spec, args, step, eos_ids, path, trained)


def trained_seq_len(step_folder: str | os.PathLike) -> int | None:
    """The longest sequence the run that saved ``step_folder`` trained on, from its ``config.toml``
    (``training.seq_len`` and the ``seq_len_schedule`` stages); None when the file is missing or unreadable."""
    try:
        training = read_toml(str(Path(step_folder) / layout.CONFIG_FILE)).get("training", {})
    except ConfigError:
        return None
    lengths = [training.get("seq_len", Training.seq_len)]
    lengths += [stage.get("seq_len") for stage in training.get("seq_len_schedule", []) if isinstance(stage, dict)]
    lengths = [n for n in lengths if isinstance(n, int) and not isinstance(n, bool) and n > 0]
    return max(lengths, default=None)


def _ints(value: Any) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value]
    return tuple(v for v in values if isinstance(v, int) and not isinstance(v, bool))


def _tokenizer(spec, override: str | None, recorded: str, what: str):
    """The family's tokenizer from ``override`` when given, else from ``recorded``."""
    source = recorded if override is None else override
    builder = spec.tokenizer_builder
    if builder is None:
        raise CheckpointError(f"model family {spec.name!r} registers no tokenizer")
    try:
        return builder("" if source == "bytes" else source)
    except (ValueError, OSError) as e:  # a moved or damaged tokenizer file
        where = "the tokenizer path given" if override is not None else what
        raise CheckpointError(f"{where} cannot be read ({one_line(e)}): pass a tokenizer path") from None


def _from_step_folder(path: Path, extensions: list[str]) -> tuple[Any, Any, dict[str, torch.Tensor], dict]:
    info = hf_export._read_info(path)
    if problem := layout.problem_with(path, verify=True):  # sizes and the checksums recorded at save
        raise CheckpointError(f"{path} is damaged: {problem}")
    spec, args = hf_export.model_from_info(info, path, extensions)
    stored = safe_load.read_metadata(path).state_dict_metadata
    # the family's names and shapes (a family without an HF adapter: its model's, built on the meta device)
    expected = spec.hf_adapter(args).expected_shapes() if spec.hf_adapter else state_shapes(spec, args)
    whose = "the args in checkpoint.json"
    sources = hf_export.tensor_sources(path, stored, expected, args, "model.{}".format, f"a {spec.name} model", whose)
    state = {src: torch.empty(tuple(md.size), dtype=md.properties.dtype) for src, md in sources.values()}
    with layout.quiet_single_process():
        safe_load.load(state, path, no_dist=True)
    hf_import.refuse_non_finite(state, path)
    return spec, args, {name: state[src] for name, (src, _) in sources.items()}, info


def _build(spec, args, state: dict[str, torch.Tensor], device, dtype: torch.dtype, where: Path) -> nn.Module:
    """The family's model with ``state`` loaded; rotary tables and other buffers from ``init_weights``,
    which runs under a forked RNG so a caller's random stream (a training run's) is left as it was."""
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device=device)
    with torch.random.fork_rng(devices=[]):
        model.init_weights()
    if args.tie_word_embeddings:
        state.pop("output.weight", None)  # tied: loaded through the embedding
    params = dict(model.named_parameters())
    if missing := [n for n in params if n not in state]:
        raise CheckpointError(
            f"{where} lacks {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
        )
    targets = {**dict(model.named_buffers()), **params}  # persistent buffers too (a MoE router's bias)
    with torch.no_grad():
        for name, tensor in state.items():
            targets[name].copy_(tensor)
    return model.to(dtype).eval()
