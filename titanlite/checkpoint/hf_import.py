"""Hugging Face model folder -> titanlite: :func:`read_hf_config` / :func:`hf_seed` (the family and model args of
its ``config.json``), :func:`hf_state_dict` (its weights under titanlite's names), :func:`load_hf_weights` (into a
sharded model, each rank reading what its shards need) and :func:`hf_to_dcp` (a model-only step folder, planned
from the safetensors headers and streamed one tensor at a time; ``HuggingFaceStorageReader`` would hold the whole
model: docs/benchmarks.md, "Hugging Face conversion"). Outputs are written to ``<out>.partial-<token>`` and
renamed; wrong inputs are one line naming the file, nothing written.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Collection, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from titanlite.checkpoint import layout, safe_load
from titanlite.checkpoint.hf_tokenizer_files import check_tokenizer, folder_tokenizer_path, tokenizer_record
from titanlite.errors import CheckpointError, NotFoundError, UserError, one_line
from titanlite.extensions import load_extensions
from titanlite.models import get_model_spec, model_names
from titanlite.models.registry import check_model_args, matching_flavor
from titanlite.utils.dtypes import dtype_name
from titanlite.utils.fsio import atomic_dir
from titanlite.utils.nesting import loads_json

logger = logging.getLogger(__name__)

Progress = Callable[[int, int, str, tuple, torch.dtype], None]
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def no_progress(i: int, n: int, name: str, shape: tuple, dtype: torch.dtype) -> None:
    pass


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
        raise NotFoundError(f"{hf_dir}: no such folder")
    file = hf_dir / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{hf_dir} is not a Hugging Face model folder (no config.json)")
    try:
        config = loads_json(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # JSONDecodeError, UnicodeDecodeError (random bytes)
        raise CheckpointError(f"{file} is unreadable: {one_line(e)}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{file} is not a JSON object")
    return config


def _checked_tensors(path: Path, adapter: Any) -> dict[str, tuple[Path, torch.dtype]]:
    """``{HF name: (file, dtype)}`` of the weights in the HF folder ``path``, each checked from the safetensors
    headers alone (no data read) against the model of ``config.json`` (``adapter``): known name, shape."""
    hf_layout, found = adapter.hf_layout(), {}
    for hf_name, file in _tensor_files(path).items():
        try:
            native = adapter.from_hf_name(hf_name)
        except KeyError as e:
            raise CheckpointError(f"{path}: {e.args[0]}") from None
        if native is None:
            continue
        if hf_name not in hf_layout:
            explain = getattr(adapter, "unexpected_tensor", None)  # HFDecoderAdapter's; a duck-typed one may lack it
            reason = explain(hf_name) if explain else "is not a tensor of the model config.json describes"
            raise CheckpointError(f"{path}: tensor {hf_name} {reason}")
        if not (path / file).is_file():
            raise CheckpointError(f"{path}: {file} (holding {hf_name}) is missing")
        with _safe_open(path / file) as f:
            if hf_name not in f.keys():
                raise CheckpointError(f"{path / file} has no tensor {hf_name} ({INDEX_FILE} says it does)")
            header = f.get_slice(hf_name)
            shape, want = tuple(header.get_shape()), hf_layout[hf_name][1]
            if shape != want:
                raise CheckpointError(f"{path}: {hf_name} has shape {list(shape)} but config.json implies {list(want)}")
            dtype = header[:0].dtype  # an empty slice names the torch dtype, reads no data
            if not dtype.is_floating_point:
                raise CheckpointError(
                    f"{path / file}: tensor {hf_name} has dtype {dtype_name(dtype)}; expected floating-point weights "
                    "(float32, bfloat16, float16, ...)"
                )
            found[hf_name] = (path / file, dtype)
    return found


def hf_state_dict(path: Path, adapter: Any, only: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """The full weights of the HF folder ``path`` under titanlite's names, each name and shape checked against
    ``config.json`` (through ``adapter``) from the headers; stacked experts are assembled from their parts.
    ``only``: the HF tensors to read."""
    parts = {
        hf_name: _read_tensor(file, hf_name)
        for hf_name, (file, _) in _checked_tensors(path, adapter).items()
        if only is None or hf_name in only
    }
    state = {}
    for native, names in _parts_by_native(adapter, adapter.hf_layout()).items():
        if all(n in parts for n in names):
            state[native] = adapter.from_hf_parts(native, [parts.pop(n) for n in names])
    return state


def load_hf_weights(path: str | os.PathLike, model: nn.Module, *, process_group: Any = None) -> None:
    """Load the weights of the HF folder ``path`` into ``model`` (sharded or a pipeline stage's part; collective),
    each rank reading only what its slices need: renamed tensors through DCP's ``HuggingFaceStorageReader``, tensors
    reordered by rows (Llama's q/k) by rows from the safetensors file (:func:`_row_order`; DCP's reader fills a
    shard from the same stored rows), assembled or made ones (stacked experts) whole, then sharded. A tied output
    missing from the folder is read from the embedding."""
    path = Path(path)
    spec, args = hf_seed(path)
    adapter, own = spec.hf_adapter(args), get_model_state_dict(model)  # own: this rank's tensors (shards)
    files, parts = _tensor_files(path), _parts_by_native(adapter, adapter.hf_layout())
    tied = bool(args.tie_word_embeddings) and not set(parts["output.weight"]) & set(files)
    direct, rows, whole = ({}, {}), {}, {}  # direct[1]: a tied output, which reads the embedding's HF name again
    for name, tensor in own.items():
        names = parts["tok_embeddings.weight"] if tied and name == "output.weight" else parts[name]
        probe = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        if len(names) == 1 and adapter.from_hf_parts(name, [probe]) is probe:  # a rename only
            direct[int(tied and name == "output.weight")][names[0]] = tensor
        elif len(names) == 1 and (order := _row_order(adapter, name, tensor)) is not None:
            rows[name] = (names[0], order)
        else:
            whole[name] = names
    state = hf_state_dict(path, adapter, only={n for names in whole.values() for n in names})  # checks all headers
    kw = dict(process_group=process_group, no_dist=not (dist.is_available() and dist.is_initialized()))
    for group in direct[: 1 + tied]:  # the same number of collective loads on every rank
        try:
            with layout.quiet_single_process():
                dcp.load(group, storage_reader=HuggingFaceStorageReader(str(path)), **kw)
        except CheckpointException as e:  # a BaseException; a file changed or damaged past its header
            raise CheckpointError(f"{path}: cannot read its weights ({safe_load.one_line(e)})") from None
        refuse_non_finite(group, path, process_group)
    for name, (hf_name, order) in rows.items():
        local, (row, col) = _local_part(own[name])
        need = order[row : row + local.shape[0]]
        if need.numel():
            first, cols = int(need.min()), slice(col, col + local.shape[1])
            block = _read_tensor(path / files[hf_name], hf_name, (slice(first, int(need.max()) + 1), cols))
            local.copy_(block[need - first])
    refuse_non_finite({name: own[name] for name in rows}, path, process_group)
    loaded = {**direct[0], **direct[1], **{name: own[name] for name in rows}}
    set_model_state_dict(model, loaded, options=StateDictOptions(strict=False))
    full = {name: state.get(name, state.get("tok_embeddings.weight")) for name in whole}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))


def _row_order(adapter: Any, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
    """``order``, native row ``r`` of ``name`` being HF row ``order[r]``, when the adapter's conversion only reorders
    the rows of a matrix whose part on this rank is one block of it; else None. Found by converting a matrix of
    numbers ``2 * row + column`` (two columns): a reordering of rows keeps each row's pair of numbers together."""
    if tensor.dim() != 2 or (isinstance(tensor, DTensor) and len(tensor.__create_chunk_list__()) != 1):
        return None
    n = tensor.shape[0]
    out = adapter.from_hf_parts(name, [torch.arange(2 * n, dtype=torch.float64).reshape(n, 2)])  # exact to 2**53
    if out.shape != (n, 2) or not torch.equal(out[:, 1] - out[:, 0], torch.ones(n, dtype=out.dtype)):
        return None
    order = (out[:, 0] / 2).long()
    is_order = torch.equal(out[:, 0], (2 * order).to(out.dtype)) and torch.equal(order.sort().values, torch.arange(n))
    return order if is_order else None


def _local_part(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's part of a (DTensor) state-dict tensor and the global position of its first element."""
    if not isinstance(tensor, DTensor):
        return tensor, (0,) * tensor.dim()
    (chunk,) = tensor.__create_chunk_list__()  # DCP's protocol: the shard's offsets and sizes
    return tensor.to_local(), tuple(chunk.offsets)


def _read_tensor(file: Path, hf_name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
    """The tensor ``hf_name`` of a safetensors ``file`` (only ``index`` of it when given: the file's other bytes are
    not read); a file changed or damaged past its header is a one-line ValueError naming it."""
    try:
        with _safe_open(file) as f:
            tensor = f.get_tensor(hf_name) if index is None else f.get_slice(hf_name)[index]
    except Exception as e:
        raise CheckpointError(f"{file}: cannot read {hf_name} ({safe_load.one_line(e)})") from None
    if index is None:  # a part of a tensor (rows of this rank) is checked where the ranks agree on it
        refuse_non_finite({hf_name: tensor}, file)
    return tensor


def refuse_non_finite(tensors: dict[str, torch.Tensor], where: Any, group: Any = None) -> None:
    """A one-line CheckpointError naming the first of ``tensors`` (read from ``where``) holding a NaN or an infinity
    (one reduction per tensor; a DTensor: this rank's part, the verdict agreed over ``group`` when distributed)."""
    bad = next(
        (n for n, t in tensors.items() if t.is_floating_point() and not torch.isfinite(_local_part(t)[0]).all()), None
    )
    if dist.is_available() and dist.is_initialized() and any(isinstance(t, DTensor) for t in tensors.values()):
        flag = torch.tensor([int(bad is not None)], device=next(iter(tensors.values())).device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        bad = bad or ("a tensor on another rank" if flag.item() else None)
    if bad is not None:
        raise CheckpointError(f"{where}: {bad} holds NaN or infinite values; expected finite weights")


def _parts_by_native(adapter: Any, hf_layout: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, list[str]]:
    """``{native name: [its HF names, in order]}`` for every native tensor (an empty list: made from nothing)."""
    out: dict[str, list[str]] = {name: [] for name in adapter.expected_shapes()}
    for hf_name, (native, _) in hf_layout.items():
        out[native].append(hf_name)
    return out


def hf_seed(path: Path) -> tuple[Any, Any] | None:
    """``(spec, args)`` of an HF model folder (``config.json``), or None when ``path`` is not one."""
    return model_for_hf(read_hf_config(path), path / "config.json") if (path / "config.json").is_file() else None


def model_for_hf(config: dict[str, Any], file: Path):
    """``(spec, args)`` for an HF ``config.json``; any value of the wrong kind is a one-line
    ValueError naming the file (a hand-edited or damaged config must not end in a traceback)."""
    try:
        spec = _family_for_hf(config)  # its ValueError says what the model is and what converts
    except (TypeError, AttributeError) as e:
        raise CheckpointError(f"{file} has an unusable value ({type(e).__name__}: {one_line(e)})") from None
    try:
        return spec, check_model_args(spec.hf_adapter.args_from_hf_config(config))
    except ValueError as e:
        raise CheckpointError(f"{file}: {one_line(e)}") from None
    except (TypeError, KeyError, AttributeError, ArithmeticError) as e:
        raise CheckpointError(f"{file} has an unusable value ({type(e).__name__}: {one_line(e)})") from None


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
        raise CheckpointError(f"{model} is converted by the extension {hint[0]}: pass --extensions {hint[0]}")
    raise CheckpointError(f"unsupported Hugging Face model ({model}); titanlite converts: {known}")


def hf_to_dcp(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    progress: Progress = no_progress,
    extensions: Sequence[str] = (),
) -> Path:
    """A model-only titanlite DCP step folder with the weights of an HF model folder. ``extensions``: modules to
    import first (as ``[job] extensions``), recorded in ``checkpoint.json`` for :func:`dcp_to_hf`."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    extensions = load_extensions(extensions)
    config = read_hf_config(hf_dir)
    spec, args = model_for_hf(config, hf_dir / "config.json")
    adapter = spec.hf_adapter(args)
    expected, hf_layout = adapter.expected_shapes(), adapter.hf_layout()
    found = {name: (name, file, dtype) for name, (file, dtype) in _checked_tensors(hf_dir, adapter).items()}
    output, embedding = adapter.to_hf_name("output.weight"), adapter.to_hf_name("tok_embeddings.weight")
    if output not in found and args.tie_word_embeddings and embedding in found:
        found[output] = found[embedding]  # a tied model stores both names
    if missing := [n for n in hf_layout if n not in found]:
        more = f" and {len(missing) - 1} more tensor(s)" if len(missing) > 1 else ""
        raise CheckpointError(f"{hf_dir} lacks {missing[0]}{more}")
    parts_of = _parts_by_native(adapter, hf_layout)
    metas = {
        n: torch.empty(expected[n], dtype=_stored_dtype([found[p][2] for p in parts]), device="meta")
        for n, parts in parts_of.items()
    }

    loaded = []

    def load(native: str) -> torch.Tensor:
        raw = [_read_tensor(found[part][1], found[part][0]) for part in parts_of[native]]
        tensor = adapter.from_hf_parts(native, raw)
        loaded.append(native)
        progress(len(loaded), len(expected), f"model.{native}", tuple(tensor.shape), tensor.dtype)
        return tensor.contiguous()

    bos, eos = (first_token_id(config.get(f"{k}_token_id")) for k in ("bos", "eos"))
    tokenizer_path = _folder_tokenizer(spec, hf_dir, bos, args)
    planner = _LazySavePlanner({f"model.{n}": functools.partial(load, n) for n in expected})
    dtypes = {metas[n].dtype for n in expected if parts_of[n]}  # weights made from nothing (a zero bias) aside
    with atomic_dir(out_dir) as partial, layout.quiet_single_process():
        writer = dcp.FileSystemWriter(str(partial), single_file_per_rank=False, sync_files=True, thread_count=1)
        meta_state = {"model": {n: metas[n] for n in expected}}
        try:
            dcp.save(meta_state, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as e:  # a BaseException: a read error while writing, one line
            error = e.failures[min(e.failures)][0]
            raise (
                error if isinstance(error, UserError) else CheckpointError(f"{out_dir}: {safe_load.one_line(error)}")
            ) from None
        info = dict(step=0, tokens_seen=0, model_only=True, dtype=dtype_name(*dtypes) if len(dtypes) == 1 else None)
        info["model"] = {"name": spec.name, "flavor": matching_flavor(spec, args), "args": dataclasses.asdict(args)}
        info.update(extensions=extensions, tokenizer={**tokenizer_record(tokenizer_path), "bos_id": bos, "eos_id": eos})
        info["files"] = layout.file_checksums(partial)  # verified when the seed is loaded or converted
        layout.write_info(partial, {**info, "source": {"hugging_face": str(hf_dir.resolve())}})
    return out_dir


def _stored_dtype(dtypes: list[torch.dtype]) -> torch.dtype:
    """The dtype a native tensor made of HF parts of ``dtypes`` is stored in: one that holds each part exactly
    (stacked fp32 experts beside a bf16 one stay fp32); float32 for one made from nothing (a zero bias)."""
    return functools.reduce(torch.promote_types, dtypes) if dtypes else torch.float32


def _folder_tokenizer(spec, hf_dir: Path, bos: Any, args: Any) -> str:
    """The path ``checkpoint.json`` records for the HF folder's tokenizer ("" when it has none). One whose BOS or
    size is not the model's is refused; one titanlite cannot read is recorded with a warning (loading it then names
    the problem, instead of silently using the byte tokenizer)."""
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


def _tensor_files(folder: Path) -> dict[str, str]:
    """``{tensor name: file name}`` of an HF folder's safetensors (index or single file)."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = loads_json(index.read_text(encoding="utf-8")).get("weight_map")
        except (OSError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{index} is unreadable ({safe_load.one_line(e)})") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map")
        for name, file in weight_map.items():
            if not isinstance(file, str) or Path(file).name != file:  # a plain file name in this folder
                raise CheckpointError(f"{index}: weight_map[{name!r}] must be a file name in {folder}, got {file!r}")
        return weight_map
    if not (folder / SINGLE_FILE).is_file():
        raise CheckpointError(f"{folder} has no {SINGLE_FILE} or {INDEX_FILE} (only safetensors weights are supported)")
    with _safe_open(folder / SINGLE_FILE) as f:
        return dict.fromkeys(f.keys(), SINGLE_FILE)


def _safe_open(file: Path):
    """``safe_open(file)``; a truncated or garbled file is a one-line ValueError naming it."""
    try:
        return safe_open(file, framework="pt")
    except Exception as e:  # SafetensorError (header too large, file not fully covered ...), OSError
        raise CheckpointError(f"{file} is not a readable safetensors file ({safe_load.one_line(e)})") from None


def first_token_id(v: Any) -> Any:
    return v[0] if isinstance(v, list) and v else v
