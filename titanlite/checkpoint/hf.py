"""Conversion between titanlite DCP step folders and Hugging Face model folders, with bounded memory.

- :func:`dcp_to_hf`: reads the model args from the step folder's ``checkpoint.json``, then loads
  one tensor at a time (DCP reads only that tensor's byte ranges, from however many ranks' files
  it was sharded over), converts it with the family's HF adapter (names, q/k row order) and
  collects it into the current safetensors shard, which ``safetensors.torch.save_file`` writes as
  soon as it is full. Peak memory is about one shard (``max_shard_bytes``, or one larger tensor).
  A torchtitan step folder of a Llama 3 model (v0.2 or 0.3.0 names, no ``checkpoint.json``) is
  read too, with model args from :func:`torchtitan_model_args`.
- :func:`hf_to_dcp`: reads ``config.json`` for the model args, plans the DCP checkpoint from the
  safetensors headers alone (meta tensors), and lets DCP pull each tensor lazily from the
  safetensors file while writing (one file per tensor, so nothing accumulates). The result is a
  model-only step folder that ``[checkpoint] initial_load_path`` loads under any parallel layout.

Both write into ``<out>.partial-<token>`` and rename at the end: an interrupted conversion leaves
no half-written output behind the final name. Wrong inputs (also damaged ones: a garbled
``.metadata``, a truncated ``.distcp`` or ``.safetensors``, a ``config.json`` or ``checkpoint.json``
that is not what it should be) raise ``ValueError`` / ``FileNotFoundError`` with a one-line
message naming the file, and nothing is written.

Checkpoints are data, never code: DCP folders are read through :mod:`titanlite.checkpoint.safe_load`
(no pickle in them can run code), and the extension modules a ``checkpoint.json`` records are not
imported unless the caller names them too (``extensions`` / ``--extensions``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import secrets
import shutil
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from titanlite.checkpoint import layout, safe_load
from titanlite.checkpoint.hf_tokenizer_files import check_tokenizer, folder_tokenizer_path, write_tokenizer_files
from titanlite.dtypes import dtype_name
from titanlite.extensions import load_extensions
from titanlite.hf_tokenizer import tokenizer_files
from titanlite.models import get_model_spec, model_names
from titanlite.models.registry import (
    adopt_seed_args,
    check_arg_types,
    check_model_args,
    matching_flavor,
    state_shapes,
)
from titanlite.nesting import loads_json

logger = logging.getLogger(__name__)

Progress = Callable[[int, int, str, tuple, torch.dtype], None]
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _no_progress(i: int, n: int, name: str, shape: tuple, dtype: torch.dtype) -> None:
    pass


# ----------------------------------------------------------------------------- DCP -> HF


def dcp_to_hf(
    step_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 1000**3,
    progress: Progress = _no_progress,
    extensions: Sequence[str] = (),
    model_args: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``model.safetensors`` (+ index), ``config.json``, ``generation_config.json`` and the tokenizer
    files of the tokenizer ``checkpoint.json`` records (:mod:`titanlite.checkpoint.hf_tokenizer_files`: also
    for a tiktoken file or the byte tokenizer; none when its file is gone, with a warning).

    ``extensions`` (modules that register the model family) are imported first. Those that the
    checkpoint's ``checkpoint.json`` records are never imported on that file's word alone: a
    checkpoint is data, and importing a module it names would run code chosen by whoever wrote
    it; a family that needs one gets an error naming the module to pass.

    A torchtitan step folder of a Llama 3 model (v0.2 or 0.3.0 names, no ``checkpoint.json``) is
    read too; its model args are not recorded, so they come from :func:`torchtitan_model_args`
    (the tensor shapes, torchtitan's llama3 defaults, and ``model_args`` given by the caller, which
    win). ``model_args`` is refused for a titanlite folder: its ``checkpoint.json`` records them.
    """
    step_dir, out_dir = Path(step_dir), Path(out_dir)
    given = load_extensions(extensions)
    if not step_dir.is_dir():
        raise FileNotFoundError(f"{step_dir}: no such folder")
    metadata = safe_load.read_metadata(step_dir)
    torchtitan = not (step_dir / layout.INFO_FILE).exists()
    if torchtitan:
        info, version = {}, torchtitan_version(metadata.state_dict_metadata, step_dir)
        prefix = "model." if version == "old" else ""
    else:
        if model_args:
            raise ValueError(f"{step_dir / layout.INFO_FILE} records the model args: model args are not taken too")
        info, version, prefix = _read_info(step_dir), "titanlite", "model."
    if problem := layout.problem_with(step_dir, require_info=not torchtitan, verify=True):
        raise ValueError(f"{step_dir} is damaged: {problem}")  # sizes, and the checksums recorded at save
    if torchtitan:
        spec = get_model_spec("llama3")
        args = torchtitan_model_args(metadata.state_dict_metadata, prefix, version, step_dir, model_args or {})
        whose = "the model args taken for this torchtitan checkpoint"
    else:
        spec, args = model_from_info(info, step_dir, given)
        if spec.hf_adapter is None:
            raise ValueError(f"model family {spec.name!r} has no Hugging Face adapter: it does not convert")
        whose = "the args in checkpoint.json"
    adapter = spec.hf_adapter(args)
    stored = metadata.state_dict_metadata
    expected = adapter.expected_shapes()
    tied = bool(getattr(args, "tie_word_embeddings", False))
    sources: dict[str, tuple[str, Any]] = {}  # native name written -> (DCP key read, its metadata)
    for name, shape in expected.items():
        src = prefix + torchtitan_name(name, version)
        if name == "output.weight" and tied and src not in stored:
            src = prefix + "tok_embeddings.weight"
        md = stored.get(src)
        if md is None or not hasattr(md, "size"):
            raise ValueError(f"{step_dir} has no tensor {src} (it is not a {spec.name} model with {whose})")
        if tuple(md.size) != shape:
            raise ValueError(f"{step_dir}: {src} has shape {list(md.size)}, {whose} give {list(shape)}")
        sources[name] = (src, md)
    out_dtype = dtype or stored[prefix + "tok_embeddings.weight"].properties.dtype
    sizes = {name: math.prod(shape) * out_dtype.itemsize for name, shape in expected.items()}
    shards = _plan_shards(sizes, max_shard_bytes)
    n = len(shards)
    files = [SINGLE_FILE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    reader, weight_map = safe_load.SafeFileSystemReader(str(step_dir)), {}
    bos, eos = _token_ids(info, step_dir)
    recorded = info.get("tokenizer") if isinstance(info.get("tokenizer"), dict) else {}
    tokenizer_path = str(recorded.get("path") or "")
    known = not torchtitan and "path" in recorded  # a checkpoint.json that names no tokenizer: none is exported
    tokenizer = _recorded_tokenizer(spec, tokenizer_path, bos, args, step_dir) if known else None
    with _atomic_output(out_dir) as partial, layout.quiet_single_process():
        done = 0
        for file, shard in zip(files, shards):
            tensors = {}  # one shard in memory at a time: save_file takes all of a file's tensors at once
            for name in shard:
                src, md = sources[name]
                tensor = _load_tensor(step_dir, metadata, reader, src, md)
                done += 1
                for hf_name, part in adapter.to_hf_tensors(name, tensor):  # one, several (experts) or none
                    tensors[hf_name], weight_map[hf_name] = part.to(out_dtype).contiguous(), file
                    progress(done, len(expected), hf_name, tuple(part.shape), out_dtype)
            save_file(tensors, partial / file, metadata={"format": "pt"})
            layout.fsync_dir(partial / file)  # save_file does not fsync; fsync_dir works on a file too
        if n > 1:
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
            layout.write_json(partial / INDEX_FILE, index)
        hf_config = adapter.hf_config(dtype=out_dtype, bos_token_id=bos, eos_token_id=eos)
        layout.write_json(partial / "config.json", hf_config)
        layout.write_json(partial / "generation_config.json", adapter.generation_config(bos, eos))
        for file in files:  # safetensors writes 0600; give the weights the permissions of their siblings
            shutil.copymode(partial / "config.json", partial / file)
        if tokenizer is not None:
            write_tokenizer_files(partial, tokenizer_path, tokenizer, getattr(args, "max_seq_len", None))
    return out_dir


def _recorded_tokenizer(spec, path: str, bos: int | None, args: Any, step_dir: Path) -> Any:
    """The tokenizer ``checkpoint.json`` records ("": the byte tokenizer), checked against the model; None
    (with a warning) when its file is gone or the family registers no tokenizer."""
    if spec.tokenizer_builder is None or (path not in ("", "bytes") and not tokenizer_files(path)):
        if path:
            logger.warning("tokenizer %s recorded in checkpoint.json not found: the export has no tokenizer", path)
        return None
    what = f"the tokenizer {path or 'bytes'!r} recorded in {step_dir / layout.INFO_FILE}"
    try:
        tokenizer = spec.tokenizer_builder(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{what} cannot be read ({' '.join(str(e).split())})") from None
    where = str(step_dir / layout.INFO_FILE)
    check_tokenizer(tokenizer, bos_id=bos, vocab_size=getattr(args, "vocab_size", None), what=what, where=where)
    return tokenizer


def _read_info(step_dir: Path) -> dict[str, Any]:
    """``checkpoint.json``, or a one-line ValueError naming it (also for bytes that are not text)."""
    try:
        return layout.read_info(step_dir)
    except UnicodeDecodeError:
        raise ValueError(f"{step_dir / layout.INFO_FILE} is unreadable (not UTF-8 JSON text)") from None
    except layout.InfoIntegrityError:  # says what to do itself
        raise
    except ValueError as e:
        raise ValueError(f"{e}: cannot tell the model args (not a titanlite checkpoint step folder?)") from None


def _load_tensor(step_dir: Path, metadata, reader, key: str, md) -> torch.Tensor:
    """The stored tensor ``key`` (its DCP name, e.g. ``model.norm.weight``); a damaged data file is a
    ValueError naming that file."""
    tensor = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    try:
        safe_load.load({key: tensor}, step_dir, storage_reader=reader, no_dist=True)
    except ValueError as e:
        files = sorted({i.relative_path for idx, i in metadata.storage_data.items() if idx.fqn == key})
        where = ", ".join(str(step_dir / f) for f in files) or str(step_dir)
        why = str(e).removeprefix(f"{step_dir}: ")
        raise ValueError(f"{where}: cannot read {key} ({why})") from None
    return tensor


# ----------------------------------------------------------------------------- torchtitan step folders

TORCHTITAN_QKV = ".attention.qkv_linear."  # torchtitan 0.3.0's Q/K/V projections inside a block
# n_heads of torchtitan's llama3 flavors (v0.2 and 0.3.0), by model dim
TORCHTITAN_LLAMA3_HEADS = {256: 16, 2048: 32, 3072: 24, 4096: 32, 8192: 64, 16384: 128}
# RoPE, norm eps and context of every torchtitan llama3 flavor (v0.2 and 0.3.0): Llama 3.1's (scaling
# factor 8), as titanlite's own 8B flavor has them
TORCHTITAN_LLAMA3_KEYS = (
    "rope_theta",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_position",
    "max_seq_len",
    "norm_eps",
)


def torchtitan_version(keys: Mapping[str, Any], where: Path | str) -> str:
    """Which torchtitan wrote a Llama 3 DCP folder, from its keys: ``"0.3"`` (``lm_head``,
    ``attention.qkv_linear.*``), ``"0.2"`` (Meta's names at the top level) or ``"old"`` (Meta's
    names under ``model.``). A one-line ValueError when it holds no Llama 3 model."""
    if "tok_embeddings.weight" in keys:
        return "0.3" if any(k.startswith("layers.") and TORCHTITAN_QKV in k for k in keys) else "0.2"
    if "model.tok_embeddings.weight" in keys:
        return "old"
    raise ValueError(
        f"{where}: no checkpoint.json and no tok_embeddings.weight: neither a titanlite checkpoint "
        "nor a torchtitan checkpoint of a Llama 3 model"
    )


def torchtitan_name(name: str, version: str, fused: bool = False) -> str:
    """The name torchtitan ``version`` gives titanlite's Llama 3 parameter ``name``: 0.3.0 calls the
    output ``lm_head`` and keeps the Q/K/V projections in ``attention.qkv_linear`` (``fused``: the
    single ``qkv_linear.wqkv.weight`` parameter its optimizer state is keyed by); other versions
    (and titanlite) use Meta's names."""
    if version != "0.3":
        return name
    if name == "output.weight":
        return "lm_head.weight"
    block, sep, proj = name.rpartition(".attention.")
    if sep and proj in ("wq.weight", "wk.weight", "wv.weight"):
        return f"{block}{TORCHTITAN_QKV}{'wqkv.weight' if fused else proj}"
    return name


def torchtitan_model_args(
    keys: Mapping[str, Any], prefix: str, version: str, where: Path, given: Mapping[str, Any]
) -> Any:
    """titanlite Llama 3 args for a torchtitan checkpoint, which records none. ``given`` wins; then
    the shapes decide ``vocab_size``, ``dim``, ``n_layers``, ``n_kv_heads`` and the SwiGLU size;
    ``n_heads`` comes from the torchtitan flavor of that ``dim`` (else it must be given); RoPE and
    norm are torchtitan's llama3 constants (``TORCHTITAN_LLAMA3_KEYS`` of the Llama 3.1 8B flavor)."""
    spec = get_model_spec("llama3")
    fields = set(spec.args_cls.__dataclass_fields__)
    if unknown := sorted(set(given) - fields):
        raise ValueError(f"unknown llama3 model args: {', '.join(unknown)} (known: {', '.join(sorted(fields))})")
    check_arg_types(spec.args_cls, given)  # before any arithmetic with them (n_heads=abc was a TypeError)

    def shape(name: str) -> list[int]:
        md = keys.get(prefix + torchtitan_name(name, version))
        if md is None or not hasattr(md, "size"):
            raise ValueError(f"{where} has no tensor {prefix + torchtitan_name(name, version)}")
        return list(md.size)

    vocab, dim = shape("tok_embeddings.weight")
    layers = {k[len(prefix) :].split(".")[1] for k in keys if k.startswith(prefix + "layers.")}
    n_heads = given.get("n_heads", TORCHTITAN_LLAMA3_HEADS.get(dim))
    if n_heads is None:
        raise ValueError(
            f"{where} has no checkpoint.json, and its model dim {dim} is no torchtitan llama3 flavor's: "
            "give the model arg n_heads (--model-arg n_heads=N)"
        )
    kv_rows = shape("layers.0.attention.wk.weight")[0]
    inferred = dict(vocab_size=vocab, dim=dim, n_layers=len(layers), n_heads=n_heads)
    inferred["n_kv_heads"] = kv_rows // (dim // n_heads) if dim % n_heads == 0 else None
    llama31 = get_model_spec("llama3").flavors["8B"]
    base = {**{k: getattr(llama31, k) for k in TORCHTITAN_LLAMA3_KEYS}, **inferred, **given}
    try:
        args = spec.args_cls(**base)
        if "multiple_of" not in given and "ffn_dim_multiplier" not in given:
            hidden = shape("layers.0.feed_forward.w1.weight")[0]
            args = spec.args_cls(**{**base, "multiple_of": hidden, "ffn_dim_multiplier": None})
            if args.ffn_hidden_dim != hidden:  # Meta's rounding gives more than hidden: scale it down
                raw = int(2 * 4 * dim / 3)
                args = spec.args_cls(**{**base, "multiple_of": hidden, "ffn_dim_multiplier": hidden / raw})
        check_model_args(args)
    except (TypeError, ValueError, ArithmeticError) as e:
        raise ValueError(f"{where}: invalid model args {base} ({' '.join(str(e).split())})") from None
    logger.info("%s: torchtitan %s checkpoint, exported with llama3 model args %s", where, version, args)
    return args


def _token_ids(info: dict[str, Any], where: Path) -> tuple[int | None, int | None]:
    """``(bos_id, eos_id)`` recorded in checkpoint.json (None when unknown)."""
    tok = info.get("tokenizer") or {}
    ids = tuple(tok.get(k) if isinstance(tok, dict) else None for k in ("bos_id", "eos_id"))
    for key, v in zip(("bos_id", "eos_id"), ids):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise ValueError(f"{where / layout.INFO_FILE}: tokenizer.{key} must be an integer, got {v!r}")
    return ids


def model_from_info(info: dict[str, Any], where: Path, extensions: Sequence[str] = ()):
    """``(spec, args)`` of the model a ``checkpoint.json`` describes; its family must be registered
    (by core, or by one of ``extensions``, already imported). ValueError (one line) otherwise, naming
    the extension module to pass when the file records one that was not given."""
    file = where / layout.INFO_FILE
    model = info.get("model")
    name = model.get("name") if isinstance(model, dict) else None
    if not isinstance(name, str):
        raise ValueError(f"{file} names no model family (model.name)")
    if name not in model_names():
        recorded = info.get("extensions") or []
        if not isinstance(recorded, list) or not all(isinstance(m, str) for m in recorded):
            raise ValueError(f"{file}: extensions must be a list of module names, got {recorded!r}")
        if missing := [m for m in recorded if m not in extensions]:
            raise ValueError(
                f"{where}: model family {name!r} is registered by extension {', '.join(missing)} (recorded in "
                f"{layout.INFO_FILE}, never imported from there): pass --extensions {','.join(missing)}"
            )
        raise ValueError(f"{where}: unknown model family {name!r} in {layout.INFO_FILE}")
    spec = get_model_spec(name)
    args = model.get("args") or {}
    if not isinstance(args, dict):
        raise ValueError(f"{file}: model.args must be a table of model args, got {args!r}")
    if unknown := sorted(set(args) - set(getattr(spec.args_cls, "__dataclass_fields__", {}))):
        raise ValueError(f"{where}: {layout.INFO_FILE} has model args unknown to this titanlite: {', '.join(unknown)}")
    try:
        return spec, check_model_args(spec.args_cls(**args))
    except (TypeError, ValueError, ArithmeticError) as e:
        raise ValueError(f"{file}: invalid model args ({' '.join(str(e).split())})") from None


# ----------------------------------------------------------------------------- seeds


def model_args_from_seed(
    spec, args: Any, explicit: Collection[str], seed: str | os.PathLike, what: str = "checkpoint.initial_load_path"
) -> Any:
    """``args`` with the model args of the seed checkpoint ``seed`` (``[checkpoint]
    initial_load_path``) taken by the rule of :func:`~titanlite.models.registry.adopt_seed_args`;
    ``explicit``: the ``[model]`` keys the config sets (``model.overrides``). Each value taken is
    logged. A folder without ``checkpoint.json`` (DCP written elsewhere), or no folder at all (the
    checkpoint manager reports that, or ignores it when resuming), leaves ``args`` as they are."""
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
        raise ValueError(f"{what} holds a {name!r} model but this config trains {spec.name!r} (model.name)")

    def same_shapes(a: Any, b: Any) -> bool:
        return state_shapes(spec, a) == state_shapes(spec, b)

    def same_model(a: Any, b: Any) -> bool:  # the same config.json: the same model, however the args spell it
        return spec.hf_adapter is not None and _hf_config_of(spec, a) == _hf_config_of(spec, b)

    kw = dict(run_args=spec.run_args, same_shapes=same_shapes, seed=str(seed), same_model=same_model)
    new_args, adopted = adopt_seed_args(args, seed_args, explicit, **kw)
    for k, v in adopted.items():
        logger.info(
            "model.%s = %r from the seed checkpoint %s (the config's flavor has %r)", k, v, seed, getattr(args, k)
        )
    return new_args


def _hf_config_of(spec, args: Any) -> dict[str, Any]:
    return spec.hf_adapter(args).hf_config(dtype=torch.float32)


def _recorded_args(seed: Path, what: str) -> tuple[Any, dict]:
    """The family name and model args a step folder's ``checkpoint.json`` records."""
    try:
        info = layout.read_info(seed)
    except ValueError as e:  # also UnicodeDecodeError: bytes that are not text
        raise ValueError(f"{what}: {seed / layout.INFO_FILE} is unreadable ({' '.join(str(e).split())})") from None
    model = info.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("args"), dict):
        raise ValueError(f"{what}: {seed / layout.INFO_FILE} records no model args")
    return model.get("name"), model["args"]


# ----------------------------------------------------------------------------- HF -> DCP


class _LazySavePlanner(DefaultSavePlanner):
    """Plans from meta tensors; each tensor's data is produced only when DCP writes it."""

    def __init__(self, loaders: dict[str, Callable[[], torch.Tensor]]):
        super().__init__()
        self._loaders = loaders

    def resolve_data(self, write_item):
        load = self._loaders.get(write_item.index.fqn)
        return super().resolve_data(write_item) if load is None else load()


def read_hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise FileNotFoundError(f"{hf_dir}: no such folder")
    file = hf_dir / "config.json"
    if not file.is_file():
        raise ValueError(f"{hf_dir} is not a Hugging Face model folder (no config.json)")
    try:
        config = loads_json(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # JSONDecodeError, UnicodeDecodeError (random bytes)
        raise ValueError(f"{file} is unreadable: {' '.join(str(e).split())}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} is not a JSON object")
    return config


def hf_state_dict(path: Path, adapter: Any) -> dict[str, torch.Tensor]:
    """The full weights of the HF folder ``path`` under titanlite's names (``adapter``: the family's
    HF adapter for the folder's args); a tensor of a shape ``config.json`` does not imply is an error.
    Native tensors made of several HF tensors (stacked experts) are assembled once all their parts are read."""
    hf_layout, parts = adapter.hf_layout(), {}
    for hf_name, file in _tensor_files(path).items():
        try:
            native = adapter.from_hf_name(hf_name)
        except KeyError as e:
            raise ValueError(f"{path}: {e.args[0]}") from None
        if native is None:
            continue
        with _safe_open(path / file) as f:
            if hf_name not in f.keys():
                raise ValueError(f"{path / file} has no tensor {hf_name}")
            tensor = f.get_tensor(hf_name)
        want = hf_layout.get(hf_name)
        if want is None or tuple(tensor.shape) != want[1]:
            raise ValueError(
                f"{path}: {hf_name} has shape {list(tensor.shape)}, config.json implies "
                f"{list(want[1]) if want else 'no such tensor'}"
            )
        parts[hf_name] = tensor
    state = {}
    for native, names in _parts_by_native(adapter, hf_layout).items():
        if all(n in parts for n in names):
            state[native] = adapter.from_hf_parts(native, [parts.pop(n) for n in names])
    return state


def _parts_by_native(adapter: Any, hf_layout: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, list[str]]:
    """``{native name: [its HF names, in order]}`` for every native tensor (an empty list: made from nothing)."""
    out: dict[str, list[str]] = {name: [] for name in adapter.expected_shapes()}
    for hf_name, (native, _) in hf_layout.items():
        out[native].append(hf_name)
    return out


def hf_seed(path: Path) -> tuple[Any, Any] | None:
    """``(spec, args)`` of an HF model folder (``config.json``), or None when ``path`` is not one."""
    return _model_for_hf(read_hf_config(path), path / "config.json") if (path / "config.json").is_file() else None


def _model_for_hf(config: dict[str, Any], file: Path):
    """``(spec, args)`` for an HF ``config.json``; any value of the wrong kind is a one-line
    ValueError naming the file (a hand-edited or damaged config must not end in a traceback)."""
    try:
        spec = _family_for_hf(config)  # its ValueError says what the model is and what converts
    except (TypeError, AttributeError) as e:
        raise ValueError(f"{file} has an unusable value ({type(e).__name__}: {' '.join(str(e).split())})") from None
    try:
        return spec, check_model_args(spec.hf_adapter.args_from_hf_config(config))
    except ValueError as e:
        raise ValueError(f"{file}: {' '.join(str(e).split())}") from None
    except (TypeError, KeyError, AttributeError, ArithmeticError) as e:
        raise ValueError(f"{file} has an unusable value ({type(e).__name__}: {' '.join(str(e).split())})") from None


def _family_for_hf(config: dict[str, Any]):
    archs = config.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    specs = [spec for spec in map(get_model_spec, model_names()) if spec.hf_adapter is not None]
    for spec in specs:
        if spec.hf_adapter.architecture in archs or config.get("model_type") == spec.hf_adapter.model_type:
            return spec
    known = ", ".join(spec.hf_adapter.architecture for spec in specs)
    model = f"model_type={config.get('model_type')!r}, architectures={archs}"
    # installed extensions declare the architectures they convert (entry points: metadata, not imported)
    hint = [ep.value for ep in entry_points(group="titanlite.hf_architectures") if ep.name in archs]
    if hint:
        raise ValueError(f"{model} is converted by the extension {hint[0]}: pass --extensions {hint[0]}")
    raise ValueError(f"unsupported Hugging Face model ({model}); titanlite converts: {known}")


def hf_to_dcp(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    progress: Progress = _no_progress,
    extensions: Sequence[str] = (),
) -> Path:
    """A model-only titanlite DCP step folder with the weights of an HF model folder.

    ``extensions``: modules to import first when the family comes from one (as ``[job]
    extensions``); they are recorded in ``checkpoint.json`` so that :func:`dcp_to_hf` finds them.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    extensions = load_extensions(extensions)
    config = read_hf_config(hf_dir)
    spec, args = _model_for_hf(config, hf_dir / "config.json")
    adapter = spec.hf_adapter(args)
    expected, hf_layout = adapter.expected_shapes(), adapter.hf_layout()
    found: dict[str, tuple[str, Path, torch.dtype]] = {}  # HF name -> (name in the files, file, dtype)
    for hf_name, file in _tensor_files(hf_dir).items():
        try:
            native = adapter.from_hf_name(hf_name)
        except KeyError as e:
            raise ValueError(f"{hf_dir}: {e.args[0]}") from None
        if native is None:
            continue
        if hf_name not in hf_layout:
            layers = config.get("num_hidden_layers")
            raise ValueError(
                f"{hf_dir}: tensor {hf_name} does not belong to a model with {layers} layers (config.json)"
            )
        if not (hf_dir / file).is_file():
            raise ValueError(f"{hf_dir}: {file} (holding {hf_name}) is missing")
        with _safe_open(hf_dir / file) as f:
            if hf_name not in f.keys():
                raise ValueError(f"{hf_dir / file} has no tensor {hf_name} ({INDEX_FILE} says it does)")
            header = f.get_slice(hf_name)
            shape, want = tuple(header.get_shape()), hf_layout[hf_name][1]
            if shape != want:
                raise ValueError(f"{hf_dir}: {hf_name} has shape {list(shape)} but config.json implies {list(want)}")
            dtype = header[:0].dtype  # an empty slice: safetensors names the torch dtype, no data is read
        found[hf_name] = (hf_name, hf_dir / file, dtype)
    output, embedding = adapter.to_hf_name("output.weight"), adapter.to_hf_name("tok_embeddings.weight")
    if output not in found and args.tie_word_embeddings and embedding in found:
        found[output] = found[embedding]  # a tied model stores both names
    if missing := [n for n in hf_layout if n not in found]:
        more = f" and {len(missing) - 1} more tensor(s)" if len(missing) > 1 else ""
        raise ValueError(f"{hf_dir} lacks {missing[0]}{more}")
    parts_of = _parts_by_native(adapter, hf_layout)
    metas = {
        n: torch.empty(expected[n], dtype=found[parts[0]][2] if parts else torch.float32, device="meta")
        for n, parts in parts_of.items()
    }

    loaded = []

    def load(native: str) -> torch.Tensor:
        raw = []
        for part in parts_of[native]:
            hf_name, file, _ = found[part]
            try:
                with _safe_open(file) as f:
                    raw.append(f.get_tensor(hf_name))
            except Exception as e:  # the file changed or is damaged past its header
                raise ValueError(f"{file}: cannot read {hf_name} ({safe_load.one_line(e)})") from None
        tensor = adapter.from_hf_parts(native, raw)
        loaded.append(native)
        progress(len(loaded), len(expected), f"model.{native}", tuple(tensor.shape), tensor.dtype)
        return tensor.contiguous()

    bos, eos = (_first(config.get(f"{k}_token_id")) for k in ("bos", "eos"))
    tokenizer_path = _folder_tokenizer(spec, hf_dir, bos, args)
    planner = _LazySavePlanner({f"model.{n}": functools.partial(load, n) for n in expected})
    dtypes = {metas[n].dtype for n in expected if parts_of[n]}  # weights made from nothing (a zero bias) aside
    with _atomic_output(out_dir) as partial, layout.quiet_single_process():
        writer = dcp.FileSystemWriter(str(partial), single_file_per_rank=False, sync_files=True, thread_count=1)
        meta_state = {"model": {n: metas[n] for n in expected}}
        try:
            dcp.save(meta_state, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as e:  # a BaseException: a read error while writing, one line
            error = e.failures[min(e.failures)][0]
            raise (
                error if isinstance(error, ValueError) else ValueError(f"{out_dir}: {safe_load.one_line(error)}")
            ) from None
        info = dict(step=0, tokens_seen=0, model_only=True, dtype=dtype_name(*dtypes) if len(dtypes) == 1 else None)
        info["model"] = {"name": spec.name, "flavor": matching_flavor(spec, args), "args": dataclasses.asdict(args)}
        info.update(extensions=extensions, tokenizer={"path": tokenizer_path, "bos_id": bos, "eos_id": eos})
        info["files"] = layout.file_checksums(partial)  # verified when the seed is loaded or converted
        layout.write_info(partial, {**info, "source": {"hugging_face": str(hf_dir.resolve())}})
    return out_dir


def _folder_tokenizer(spec, hf_dir: Path, bos: Any, args: Any) -> str:
    """The path ``checkpoint.json`` records for the HF folder's tokenizer ("" when it has none), so that
    evaluating or generating with the converted checkpoint uses it. A tokenizer whose BOS or size is not
    the model's is refused; one titanlite cannot read is recorded with a warning (loading it names the
    problem, instead of silently using the byte tokenizer)."""
    path = folder_tokenizer_path(hf_dir)
    if not path or spec.tokenizer_builder is None:
        return path
    try:
        tokenizer = spec.tokenizer_builder(path)
    except (ValueError, OSError) as e:
        logger.warning("%s: titanlite cannot read its tokenizer (%s); recorded anyway", hf_dir, safe_load.one_line(e))
        return path
    what = f"the tokenizer of {hf_dir}"
    check_tokenizer(tokenizer, bos_id=bos, vocab_size=args.vocab_size, what=what, where=str(hf_dir / "config.json"))
    return path


def _plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """The names in order, cut into runs of at most ``max_bytes`` (a larger tensor gets a run of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _tensor_files(folder: Path) -> dict[str, str]:
    """``{tensor name: file name}`` of an HF folder's safetensors (index or single file)."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = loads_json(index.read_text(encoding="utf-8")).get("weight_map")
        except (OSError, ValueError, AttributeError) as e:
            raise ValueError(f"{index} is unreadable ({safe_load.one_line(e)})") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        for name, file in weight_map.items():
            if not isinstance(file, str) or Path(file).name != file:  # a plain file name in this folder
                raise ValueError(f"{index}: weight_map[{name!r}] must be a file name in {folder}, got {file!r}")
        return weight_map
    if not (folder / SINGLE_FILE).is_file():
        raise ValueError(f"{folder} has no {SINGLE_FILE} or {INDEX_FILE} (only safetensors weights are supported)")
    with _safe_open(folder / SINGLE_FILE) as f:
        return dict.fromkeys(f.keys(), SINGLE_FILE)


def _safe_open(file: Path):
    """``safe_open(file)``; a truncated or garbled file is a one-line ValueError naming it."""
    try:
        return safe_open(file, framework="pt")
    except Exception as e:  # SafetensorError (header too large, file not fully covered ...), OSError
        raise ValueError(f"{file} is not a readable safetensors file ({safe_load.one_line(e)})") from None


def _first(v: Any) -> Any:
    return v[0] if isinstance(v, list) and v else v


@contextlib.contextmanager
def _atomic_output(out_dir: Path) -> Iterator[Path]:
    """Yields ``<out_dir>.partial-<token>``, renamed to ``out_dir`` at the end; removed on any error,
    with the parent folders this call created (an error leaves the file system as it found it)."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"output {out_dir} already exists and is not empty (nothing was overwritten)")
    created = [p for p in reversed(out_dir.parents) if not p.exists()]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = out_dir.with_name(f"{out_dir.name}.partial-{secrets.token_hex(4)}")
    partial.mkdir()
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        for folder in reversed(created):
            with contextlib.suppress(OSError):  # only while empty: something else may have appeared
                folder.rmdir()
        raise
    if out_dir.is_dir():  # empty (checked at start)
        out_dir.rmdir()
    os.rename(partial, out_dir)
    layout.fsync_dir(out_dir.parent)
