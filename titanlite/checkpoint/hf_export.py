"""DCP step folder -> Hugging Face model folder (:func:`dcp_to_hf`), with bounded memory (docs/checkpoints.md).

One tensor at a time is loaded (DCP reads only its byte ranges), converted by the family's HF adapter and added to
the current safetensors shard, written once full: peak memory is about one shard. A torchtitan Llama 3 step folder
is read too (``torchtitan_ext``'s format). Not DCP's ``HuggingFaceStorageWriter``: it serializes each file in
memory (slower, higher peak: docs/benchmarks.md, "Hugging Face conversion") and names a lone file
``model-00001-of-00001.safetensors``. Output goes to ``<out>.partial-<token>``, renamed at the end.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from collections.abc import Mapping, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from titanlite.checkpoint import layout, safe_load
from titanlite.checkpoint.hf_import import INDEX_FILE, SINGLE_FILE, Progress, no_progress
from titanlite.checkpoint.hf_tokenizer_files import check_tokenizer, verified_tokenizer_path, write_tokenizer_files
from titanlite.errors import CheckpointError, NotFoundError, TokenizerError, one_line
from titanlite.extensions import load_extensions
from titanlite.models import get_model_spec, model_names
from titanlite.models.registry import check_model_args
from titanlite.tokenizer.hf import tokenizer_files
from titanlite.utils.fsio import atomic_dir, fsync_dir

logger = logging.getLogger(__name__)


def dcp_to_hf(
    step_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 1000**3,
    progress: Progress = no_progress,
    extensions: Sequence[str] = (),
    model_args: Mapping[str, Any] | None = None,
    no_tokenizer: bool = False,
) -> Path:
    """Write ``model.safetensors`` (+ index), ``config.json``, ``generation_config.json`` and the files of the
    tokenizer ``checkpoint.json`` records (by path and SHA-256: gone or changed is an error, unless
    ``no_tokenizer``). ``extensions`` are imported first; a family needing one the checkpoint names but the caller
    does not is an error naming it. ``model_args``: only for a torchtitan folder (its args come from its shapes and
    torchtitan's llama3 defaults otherwise); a titanlite folder records them."""
    step_dir, out_dir = Path(step_dir), Path(out_dir)
    given = load_extensions(extensions)
    if not step_dir.is_dir():
        raise NotFoundError(f"{step_dir}: no such folder")
    metadata = safe_load.read_metadata(step_dir)
    torchtitan = not (step_dir / layout.INFO_FILE).exists()
    if torchtitan:
        info, key_of = {}, (folder := _foreign_folder(metadata.state_dict_metadata, step_dir)).key
    else:
        if model_args:
            raise CheckpointError(f"{step_dir / layout.INFO_FILE} records the model args: model args are not taken too")
        info, key_of = _read_info(step_dir), "model.{}".format
    if problem := layout.problem_with(step_dir, require_info=not torchtitan, verify=True):
        raise CheckpointError(f"{step_dir} is damaged: {problem}")  # sizes, and the checksums recorded at save
    if torchtitan:
        spec, args = folder.model(model_args or {})
        whose = "the model args taken for this torchtitan checkpoint"
    else:
        spec, args = model_from_info(info, step_dir, given)
        if spec.hf_adapter is None:
            raise CheckpointError(f"model family {spec.name!r} has no Hugging Face adapter: it does not convert")
        whose = "the args in checkpoint.json"
    adapter = spec.hf_adapter(args)
    stored = metadata.state_dict_metadata
    expected = adapter.expected_shapes()
    sources = tensor_sources(step_dir, stored, expected, args, key_of, f"a {spec.name} model", whose)
    out_dtype = dtype or stored[key_of("tok_embeddings.weight")].properties.dtype
    sizes = {name: math.prod(shape) * out_dtype.itemsize for name, shape in expected.items()}
    shards = _plan_shards(sizes, max_shard_bytes)
    n = len(shards)
    files = [SINGLE_FILE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    reader, weight_map = safe_load.SafeFileSystemReader(str(step_dir)), {}
    bos, eos = _token_ids(info, step_dir)
    recorded = info.get("tokenizer") if isinstance(info.get("tokenizer"), dict) else {}
    tokenizer_path = str(recorded.get("path") or "")
    known = not torchtitan and "path" in recorded and not no_tokenizer  # none recorded, or none asked: none exported
    if known:
        tokenizer_path = verified_tokenizer_path(recorded, step_dir / layout.INFO_FILE)
    tokenizer = _recorded_tokenizer(spec, tokenizer_path, bos, args, step_dir) if known else None
    with atomic_dir(out_dir) as partial, layout.quiet_single_process():
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
            fsync_dir(partial / file)  # save_file does not fsync; fsync_dir works on a file too
        if n > 1:
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
            layout.write_json(partial / INDEX_FILE, index)
        hf_config = adapter.hf_config(dtype=out_dtype, bos_token_id=bos, eos_token_id=eos)
        layout.write_json(partial / "config.json", hf_config)
        layout.write_json(partial / "generation_config.json", adapter.generation_config(bos, eos))
        for file in files:  # safetensors writes 0600; give the weights the permissions of their siblings
            shutil.copymode(partial / "config.json", partial / file)
        if tokenizer is not None:
            write_tokenizer_files(partial, tokenizer_path, tokenizer, args.max_seq_len)
    return out_dir


def tensor_sources(step_dir: Path, stored: Mapping, expected: dict, args: Any, key_of, model: str, whose: str) -> dict:
    """``{native name: (DCP key, its metadata)}`` for each tensor of ``expected`` (native name -> shape) in the DCP
    metadata ``stored`` (a tied output without a key of its own: the embedding's); one missing or of another shape
    is a one-line ValueError: the folder is not ``model`` with ``whose`` args."""
    tied, sources = bool(args.tie_word_embeddings), {}
    for name, shape in expected.items():
        src = key_of(name)
        if name == "output.weight" and tied and src not in stored:
            src = key_of("tok_embeddings.weight")
        md = stored.get(src)
        if md is None or not hasattr(md, "size"):
            raise CheckpointError(f"{step_dir} has no tensor {src} (it is not {model} with {whose})")
        if tuple(md.size) != shape:
            raise CheckpointError(f"{step_dir}: {src} has shape {list(md.size)}, {whose} give {list(shape)}")
        sources[name] = (src, md)
    return sources


def _foreign_folder(keys: Mapping[str, Any], step_dir: Path) -> Any:
    """The reader of a DCP folder another tool wrote (no ``checkpoint.json``): the first installed format (entry
    points ``titanlite.dcp_formats``; built from the folder's keys, a ValueError when it is not its) that takes it."""
    errors = []
    for ep in entry_points(group="titanlite.dcp_formats"):
        try:
            return ep.load()(keys, step_dir)
        except ValueError as e:
            errors.append(e)
    raise errors[0] if errors else CheckpointError(f"{step_dir} has no {layout.INFO_FILE}: not a titanlite step folder")


def _recorded_tokenizer(spec, path: str, bos: int | None, args: Any, step_dir: Path) -> Any:
    """The tokenizer ``checkpoint.json`` records ("": the byte tokenizer), checked against the model; None when the
    family registers no tokenizer. A file that is gone is a one-line error: an export never silently lacks it."""
    if spec.tokenizer_builder is None:
        return None
    if path not in ("", "bytes") and not tokenizer_files(path):
        raise TokenizerError(
            f"{step_dir / layout.INFO_FILE}: the tokenizer it was trained with, {path}, is not found; restore it "
            "there, or pass --no-tokenizer (no_tokenizer=True) to export without tokenizer files"
        )
    what = f"the tokenizer {path or 'bytes'!r} recorded in {step_dir / layout.INFO_FILE}"
    try:
        tokenizer = spec.tokenizer_builder(path)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{what} cannot be read ({one_line(e)})") from None
    where = str(step_dir / layout.INFO_FILE)
    check_tokenizer(tokenizer, bos_id=bos, vocab_size=args.vocab_size, what=what, where=where)
    return tokenizer


def _read_info(step_dir: Path) -> dict[str, Any]:
    """``checkpoint.json``, or a one-line ValueError naming it (also for bytes that are not text)."""
    try:
        return layout.read_info(step_dir)
    except layout.InfoIntegrityError:  # says what to do itself
        raise
    except ValueError as e:
        raise CheckpointError(f"{e}: cannot tell the model args (not a titanlite checkpoint step folder?)") from None


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
        raise CheckpointError(f"{where}: cannot read {key} ({why})") from None
    return tensor


def _token_ids(info: dict[str, Any], where: Path) -> tuple[int | None, int | None]:
    """``(bos_id, eos_id)`` recorded in checkpoint.json (None when unknown)."""
    tok = info.get("tokenizer") or {}
    ids = tuple(tok.get(k) if isinstance(tok, dict) else None for k in ("bos_id", "eos_id"))
    for key, v in zip(("bos_id", "eos_id"), ids):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise CheckpointError(f"{where / layout.INFO_FILE}: tokenizer.{key} must be an integer, got {v!r}")
    return ids


def model_from_info(info: dict[str, Any], where: Path, extensions: Sequence[str] = ()):
    """``(spec, args)`` of the model a ``checkpoint.json`` describes; its family must be registered
    (by core, or by one of ``extensions``, already imported). ValueError (one line) otherwise, naming
    the extension module to pass when the file records one that was not given."""
    file = where / layout.INFO_FILE
    model = info.get("model")
    name = model.get("name") if isinstance(model, dict) else None
    if not isinstance(name, str):
        raise CheckpointError(f"{file} names no model family (model.name)")
    if name not in model_names():
        recorded = info.get("extensions") or []
        if not isinstance(recorded, list) or not all(isinstance(m, str) for m in recorded):
            raise CheckpointError(f"{file}: extensions must be a list of module names, got {recorded!r}")
        if missing := [m for m in recorded if m not in extensions]:
            raise CheckpointError(
                f"{where}: model family {name!r} is registered by extension {', '.join(missing)} (recorded in "
                f"{layout.INFO_FILE}, never imported from there): pass --extensions {','.join(missing)}"
            )
        raise CheckpointError(f"{where}: unknown model family {name!r} in {layout.INFO_FILE}")
    spec = get_model_spec(name)
    args = model.get("args") or {}
    if not isinstance(args, dict):
        raise CheckpointError(f"{file}: model.args must be a table of model args, got {args!r}")
    if unknown := sorted(set(args) - set(getattr(spec.args_cls, "__dataclass_fields__", {}))):
        raise CheckpointError(
            f"{where}: {layout.INFO_FILE} has model args unknown to this titanlite: {', '.join(unknown)}"
        )
    try:
        return spec, check_model_args(spec.args_cls(**args))
    except (TypeError, ValueError, ArithmeticError) as e:
        raise CheckpointError(f"{file}: invalid model args ({one_line(e)})") from None


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
