"""Streaming conversion between titanlite DCP step folders and Hugging Face model folders.

- :func:`dcp_to_hf`: reads the model args from the step folder's ``checkpoint.json``, then loads
  one tensor at a time (DCP reads only that tensor's byte ranges, from however many ranks' files
  it was sharded over), converts it with the family's HF adapter (names, q/k row order) and appends
  it to a streamed safetensors file. Peak memory is about one tensor.
- :func:`hf_to_dcp`: reads ``config.json`` for the model args, plans the DCP checkpoint from the
  safetensors headers alone (meta tensors), and lets DCP pull each tensor lazily from the
  safetensors file while writing (one file per tensor, so nothing accumulates). The result is a
  model-only step folder that ``[checkpoint] initial_load_path`` loads under any parallel layout.

Both write into ``<out>.partial-<token>`` and rename at the end: an interrupted conversion leaves
no half-written output behind the final name. Wrong inputs raise ``ValueError`` /
``FileNotFoundError`` with a one-line message.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from titanlite.checkpoint import layout
from titanlite.checkpoint.safetensors_stream import ShardedSafetensorsWriter, hf_tensor_files
from titanlite.extensions import load_extensions
from titanlite.models import get_model_spec, model_names

warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)

Progress = Callable[[int, int, str, tuple, torch.dtype], None]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _no_progress(i: int, n: int, name: str, shape: tuple, dtype: torch.dtype) -> None:
    pass


# ----------------------------------------------------------------------------- DCP -> HF


def dcp_to_hf(step_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: Optional[torch.dtype] = None,
              max_shard_bytes: int = 5 * 1000**3, progress: Progress = _no_progress,
              extensions: Sequence[str] = ()) -> Path:
    """Write ``model.safetensors`` (+ index), ``config.json`` and ``generation_config.json``.

    The model family's extension modules, when it comes from one, are imported first: those that
    ``checkpoint.json`` records (``[job] extensions`` of the run) and ``extensions``.
    """
    step_dir, out_dir = Path(step_dir), Path(out_dir)
    load_extensions(extensions)
    if not step_dir.is_dir():
        raise FileNotFoundError(f"{step_dir}: no such folder")
    metadata = layout.read_metadata(step_dir)
    try:
        info = layout.read_info(step_dir)
    except ValueError as e:
        raise ValueError(f"{e}: cannot tell the model args (not a titanlite checkpoint step folder?)") from None
    problem = layout.problem_with(step_dir)
    if problem:
        raise ValueError(f"{step_dir} is damaged: {problem}")
    spec, args = _model_from_info(info, step_dir)
    adapter = spec.hf_adapter(args)
    stored = {k[len("model."):]: v for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")}
    expected = adapter.expected_shapes()
    tied = bool(getattr(args, "tie_word_embeddings", False))
    sources: dict[str, str] = {}  # native name written -> native name read
    for name, shape in expected.items():
        src = name
        if name not in stored and name == "output.weight" and tied:
            src = "tok_embeddings.weight"
        md = stored.get(src)
        if md is None or not hasattr(md, "size"):
            raise ValueError(f"{step_dir} has no tensor model.{name} (it is not a {info['model']['name']} model "
                             "with the args in its checkpoint.json)")
        if tuple(md.size) != shape:
            raise ValueError(f"{step_dir}: model.{src} has shape {list(md.size)}, the args in checkpoint.json "
                             f"give {list(shape)}")
        sources[name] = src
    out_dtype = dtype or stored["tok_embeddings.weight"].properties.dtype
    partial = _start_output(out_dir)
    try:
        entries = [(adapter.to_hf_name(n), expected[n], out_dtype) for n in expected]
        writer = ShardedSafetensorsWriter(partial, entries, max_shard_bytes)
        reader = dcp.FileSystemReader(str(step_dir))
        for i, name in enumerate(expected, 1):
            src = sources[name]
            tensor = torch.empty(tuple(stored[src].size), dtype=stored[src].properties.dtype)
            dcp.load({"model": {src: tensor}}, storage_reader=reader, no_dist=True)
            hf_name, tensor = adapter.to_hf(name, tensor)
            writer.write(hf_name, tensor.to(out_dtype))
            progress(i, len(expected), hf_name, tuple(tensor.shape), out_dtype)
            del tensor
        writer.close()
        tok = info.get("tokenizer") or {}
        config = adapter.hf_config(dtype=out_dtype, bos_token_id=tok.get("bos_id"), eos_token_id=tok.get("eos_id"))
        _write_json(partial / "config.json", config)
        _write_json(partial / "generation_config.json",
                    adapter.generation_config(tok.get("bos_id"), tok.get("eos_id")))
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _finish_output(partial, out_dir)
    return out_dir


def _model_from_info(info: dict[str, Any], where: Path):
    load_extensions(info.get("extensions") or [])  # the family may come from a [job] extension
    model = info.get("model") or {}
    name = model.get("name")
    if name not in model_names():
        raise ValueError(f"{where}: unknown model family {name!r} in {layout.INFO_FILE}")
    spec = get_model_spec(name)
    if spec.hf_adapter is None:
        raise ValueError(f"model family {name!r} has no Hugging Face adapter")
    fields = {f for f in getattr(spec.args_cls, "__dataclass_fields__", {})}
    unknown = sorted(set(model.get("args") or {}) - fields)
    if unknown:
        raise ValueError(f"{where}: {layout.INFO_FILE} has model args unknown to this titanlite: {', '.join(unknown)}")
    return spec, spec.args_cls(**(model.get("args") or {}))


# ----------------------------------------------------------------------------- HF -> DCP


class _LazySavePlanner(DefaultSavePlanner):
    """Plans from meta tensors; each tensor's data is produced only when DCP writes it."""

    def __init__(self, loaders: dict[str, Callable[[], torch.Tensor]]):
        super().__init__()
        self._loaders = loaders

    def resolve_data(self, write_item):
        load = self._loaders.get(write_item.index.fqn)
        if load is None:
            return super().resolve_data(write_item)
        return load()


def read_hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise FileNotFoundError(f"{hf_dir}: no such folder")
    file = hf_dir / "config.json"
    if not file.is_file():
        raise ValueError(f"{hf_dir} is not a Hugging Face model folder (no config.json)")
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is unreadable: {' '.join(str(e).split())}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} is not a JSON object")
    return config


def _family_for_hf(config: dict[str, Any]):
    archs = config.get("architectures") or []
    for name in model_names():
        spec = get_model_spec(name)
        adapter = spec.hf_adapter
        if adapter is not None and (adapter.architecture in archs or config.get("model_type") == adapter.model_type):
            return spec
    raise ValueError(f"unsupported Hugging Face model (model_type={config.get('model_type')!r}, architectures="
                     f"{archs}); titanlite converts: " + ", ".join(
                         get_model_spec(n).hf_adapter.architecture for n in model_names()
                         if get_model_spec(n).hf_adapter is not None))


def hf_to_dcp(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
              progress: Progress = _no_progress, extensions: Sequence[str] = ()) -> Path:
    """A model-only titanlite DCP step folder with the weights of an HF model folder.

    ``extensions``: modules to import first when the family comes from one (as ``[job]
    extensions``); they are recorded in ``checkpoint.json`` so that :func:`dcp_to_hf` finds them.
    """
    from safetensors import safe_open

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    extensions = load_extensions(extensions)
    config = read_hf_config(hf_dir)
    spec = _family_for_hf(config)
    args = spec.hf_adapter.args_from_hf_config(config)
    adapter = spec.hf_adapter(args)
    files = hf_tensor_files(hf_dir)
    if files is None:
        raise ValueError(f"{hf_dir} has no model.safetensors or {'model.safetensors.index.json'} "
                         "(only safetensors weights are supported)")
    expected = adapter.expected_shapes()
    found: dict[str, tuple[str, str, tuple, torch.dtype]] = {}  # native -> (hf name, file, shape, dtype)
    for hf_name, file in files.items():
        try:
            native = adapter.from_hf_name(hf_name)
        except KeyError as e:
            raise ValueError(f"{hf_dir}: {e.args[0]}") from None
        if native is None:
            continue
        if native not in expected:
            raise ValueError(f"{hf_dir}: tensor {hf_name} does not belong to a model with {config.get('num_hidden_layers')} "
                             "layers (config.json)")
        path = hf_dir / file
        if not path.is_file():
            raise ValueError(f"{hf_dir}: {file} (holding {hf_name}) is missing")
        with safe_open(str(path), framework="pt") as f:
            sl = f.get_slice(hf_name)
            shape = tuple(sl.get_shape())
            dtype = _st_dtype(sl.get_dtype())
        if shape != expected[native]:
            raise ValueError(f"{hf_dir}: {hf_name} has shape {list(shape)} but config.json implies "
                             f"{list(expected[native])}")
        found[native] = (hf_name, file, shape, dtype)
    if "output.weight" not in found and args.tie_word_embeddings and "tok_embeddings.weight" in found:
        found["output.weight"] = found["tok_embeddings.weight"]  # a tied model stores both names
    missing = [n for n in expected if n not in found]
    if missing:
        raise ValueError(f"{hf_dir} lacks {adapter.to_hf_name(missing[0])}"
                         + (f" and {len(missing) - 1} more tensor(s)" if len(missing) > 1 else ""))

    order = list(expected)
    counter = {"i": 0}

    def loader(native: str) -> Callable[[], torch.Tensor]:
        hf_name, file, _, _ = found[native]

        def load() -> torch.Tensor:
            with safe_open(str(hf_dir / file), framework="pt") as f:
                tensor = f.get_tensor(hf_name)
            _, tensor = adapter.from_hf(hf_name, tensor)
            counter["i"] += 1
            progress(counter["i"], len(order), f"model.{native}", tuple(tensor.shape), tensor.dtype)
            return tensor.contiguous()

        return load

    state = {"model": {n: torch.empty(found[n][2], dtype=found[n][3], device="meta") for n in order}}
    planner = _LazySavePlanner({f"model.{n}": loader(n) for n in order})
    partial = _start_output(out_dir)
    try:
        writer = dcp.FileSystemWriter(str(partial), single_file_per_rank=False, sync_files=True, thread_count=1)
        dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
        dtypes = {found[n][3] for n in order}
        layout.write_info(partial, {
            "step": 0, "tokens_seen": 0, "model_only": True,
            "dtype": str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else None,
            "model": {"name": spec.name, "flavor": None, "args": _asdict(args)},
            "extensions": extensions,
            "tokenizer": {"path": "", "bos_id": _first(config.get("bos_token_id")),
                          "eos_id": _first(config.get("eos_token_id"))},
            "source": {"hugging_face": str(hf_dir.resolve())},
        })
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _finish_output(partial, out_dir)
    return out_dir


# ----------------------------------------------------------------------------- helpers


def _st_dtype(name: str) -> torch.dtype:
    table = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool}
    if name not in table:
        raise ValueError(f"unsupported safetensors dtype {name}")
    return table[name]


def _first(v: Any) -> Any:
    return v[0] if isinstance(v, list) and v else v


def _asdict(args: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(args)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def _start_output(out_dir: Path) -> Path:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"output {out_dir} already exists and is not empty (nothing was overwritten)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = out_dir.with_name(f"{out_dir.name}.partial-{secrets.token_hex(4)}")
    partial.mkdir()
    return partial


def _finish_output(partial: Path, out_dir: Path) -> None:
    if out_dir.is_dir():  # empty (checked at start)
        out_dir.rmdir()
    os.rename(partial, out_dir)
    layout.fsync_dir(out_dir.parent)
