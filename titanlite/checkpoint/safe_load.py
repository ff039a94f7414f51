"""Reading DCP checkpoint folders without running code that a checkpoint file carries (docs/checkpoints.md,
"Trusting checkpoints").

torch unpickles ``.metadata`` and every non-tensor ``BYTE_IO`` item without restriction, and a pickle can call any
importable function. :class:`SafeFileSystemReader` rebuilds only DCP's own metadata records (and ``torch.Size``,
dtypes, layouts, paths); :class:`SafeLoadPlanner` reads ``BYTE_IO`` items with ``weights_only=True``, as DCP reads
tensors; :func:`load` / :func:`read_metadata` use both, with DCP's multi-line exception as one line.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from titanlite.errors import CheckpointError
from titanlite.errors import one_line as plain_one_line
from titanlite.utils import torch_compat

METADATA_FILE = ".metadata"
_DCP_MODULES = ("torch.distributed.checkpoint.", "torch.distributed._shard.")  # older torch kept records here
_TORCH_NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
_PATH_CLASSES = {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds a pickle that would do more than rebuild plain data (refused unread)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP's metadata records and nothing else: every global the pickle names is checked."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _TORCH_NAMES or (module == "pathlib" and name in _PATH_CLASSES):
            return super().find_class(module, name)
        if module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        elif module.startswith(_DCP_MODULES):
            obj = _record_class(module, name)
            if obj is not None:
                return obj
        raise pickle.UnpicklingError(f"refused to load global {module}.{name} (not DCP metadata)")


def _record_class(module: str, name: str) -> type | None:
    """``module.name`` when it is a dataclass or an enum of torch's checkpoint modules (a record)."""
    try:
        obj = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
    if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
        return obj
    return None


def _why(e: pickle.UnpicklingError) -> str:
    """The reason in torch's weights-only refusal (its ``Unsupported global: ...`` clause), not its
    advice to retry with ``weights_only=False``."""
    match = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
    return f" (it names {match.group(1)})" if match else ""


def one_line(e: BaseException) -> str:
    """``Type: message`` on one line; torch's weights-only refusal shortened to what it found (its
    advice to retry with ``weights_only=False`` is exactly what must not be done with such a file)."""
    text = plain_one_line(e)
    if isinstance(e, pickle.UnpicklingError) and "weights_only" in text:
        found = re.search(r"WeightsUnpickler error: (.*?)(?: Check the documentation|$)", text)
        text = f"not a plain-data pickle: {found.group(1) if found else 'refused by the weights-only unpickler'}"
    return f"{type(e).__name__}: {text}"[:300]


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is unpickled with an allowlist (see the module doc)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        file = Path(self.path) / METADATA_FILE
        try:
            with open(file, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise CheckpointError(f"{self.path} is not a DCP checkpoint folder (no {METADATA_FILE})") from None
        except pickle.UnpicklingError as e:
            if str(e).startswith("refused"):
                raise UnsafeCheckpointError(f"{file}: {e}; it was not written by DCP") from None
            raise CheckpointError(f"{file} is unreadable ({one_line(e)})") from None
        except Exception as e:  # truncated or random bytes: EOFError, UnicodeDecodeError, ...
            raise CheckpointError(f"{file} is unreadable ({one_line(e)})") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{file} is not DCP metadata (it holds a {type(metadata).__name__})")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader does
        return metadata


def read_metadata(path: str | os.PathLike) -> Metadata:
    """The DCP metadata of a folder; ``ValueError`` (one line, naming the file) when it is missing,
    unreadable or refused (:class:`UnsafeCheckpointError`)."""
    return SafeFileSystemReader(str(path)).read_metadata()


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` reading non-tensor items with ``weights_only=True``: a pickle naming anything but
    plain data raises :class:`UnsafeCheckpointError` (naming the item) before any of it runs. ``io.BytesIO`` counts
    as plain data (torchtitan's older ``TrainState`` saved its loss histories that way)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            with torch.serialization.safe_globals([io.BytesIO]):  # torchtitan's older TrainState stored some
                obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            if why := _why(e):  # it names a function or class: what a pickle that runs code does
                raise UnsafeCheckpointError(
                    f"checkpoint item {fqn} is not plain data, refused to unpickle it{why}"
                ) from None
            raise CheckpointError(f"checkpoint item {fqn} is unreadable ({one_line(e)})") from None
        except Exception as e:
            raise CheckpointError(f"checkpoint item {fqn} is unreadable ({one_line(e)})") from None
        if self.flatten_state_dict:
            torch_compat.set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def load(state_dict: dict[str, Any], path: str | os.PathLike, **kwargs: Any) -> None:
    """``dcp.load(state_dict)`` from the folder ``path`` with :class:`SafeFileSystemReader` and
    :class:`SafeLoadPlanner` (``kwargs``: ``process_group``, ``no_dist``, or a ``storage_reader`` of that class);
    a failure on any rank is one line naming ``path`` (:class:`UnsafeCheckpointError` for a refused pickle)."""
    kwargs.setdefault("storage_reader", SafeFileSystemReader(str(path)))
    if not isinstance(kwargs["storage_reader"], SafeFileSystemReader):
        raise TypeError("safe_load.load needs a SafeFileSystemReader")
    kwargs["storage_reader"].read_metadata()  # DCP would swallow this error (retrying other files) and assert
    try:
        dcp.load(state_dict, planner=SafeLoadPlanner(), **kwargs)
    except CheckpointException as e:
        rank = min(e.failures)
        error = e.failures[rank][0]
        if isinstance(error, UnsafeCheckpointError):
            raise UnsafeCheckpointError(f"{path}: {error}") from None
        if type(error) is ValueError:  # raised here, already one line
            raise CheckpointError(f"{path}: {error}") from None
        raise CheckpointError(f"{path}: {one_line(error)}") from None


__all__ = ["SafeFileSystemReader", "SafeLoadPlanner", "UnsafeCheckpointError", "load", "one_line", "read_metadata"]
