"""Writing ``.safetensors`` files one tensor at a time (bounded memory), sharded like Hugging Face.

A safetensors file is: 8 bytes (little-endian u64) header length ``N``, ``N`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, offsets
relative to the data area, padded with spaces to a multiple of 8), then the raw tensor bytes,
contiguous and in offset order. Since every name, shape and dtype is known before any data is
read, the header can be written first and the tensors streamed behind it.

:class:`ShardedSafetensorsWriter` splits the tensors (in the given order) into shards of at most
``max_shard_bytes`` (a single tensor larger than that gets a shard of its own), names them
``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` and writes
``model.safetensors.index.json`` when there is more than one.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Optional, Sequence

import torch

ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


def parse_size(text: str | int) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or a number of bytes."""
    if isinstance(text, int):
        return text
    t = text.strip().upper().replace(" ", "")
    units = {"KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4,
             "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4, "B": 1}
    for unit, mult in units.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)


class _Shard:
    def __init__(self, entries: list[tuple[str, tuple[int, ...], torch.dtype]]):
        self.entries = entries
        self.header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, dtype in entries:
            size = nbytes(shape, dtype)
            self.header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        self.data_bytes = offset


class ShardedSafetensorsWriter:
    """Streams tensors, in exactly the planned order, into one or more safetensors files."""

    def __init__(self, folder: str | os.PathLike, entries: Sequence[tuple[str, Sequence[int], torch.dtype]],
                 max_shard_bytes: int = 5 * 1000**3):
        self.folder = Path(folder)
        self.shards: list[_Shard] = []
        current: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        size = 0
        for name, shape, dtype in entries:
            if dtype not in ST_DTYPES:
                raise ValueError(f"safetensors cannot store dtype {dtype} ({name})")
            b = nbytes(shape, dtype)
            if current and size + b > max_shard_bytes:
                self.shards.append(_Shard(current))
                current, size = [], 0
            current.append((name, tuple(int(s) for s in shape), dtype))
            size += b
        if current or not self.shards:
            self.shards.append(_Shard(current))
        n = len(self.shards)
        self.files = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self._order = [(si, e) for si, s in enumerate(self.shards) for e in s.entries]
        self._next = 0
        self._fh = None
        self._open_shard = -1

    @property
    def total_bytes(self) -> int:
        return sum(s.data_bytes for s in self.shards)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._order):
            raise ValueError(f"unexpected tensor {name}: every planned tensor has been written")
        si, (want, shape, dtype) = self._order[self._next]
        if name != want or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"expected {want} {list(shape)} {dtype}, got {name} {list(tensor.shape)} {tensor.dtype}")
        if si != self._open_shard:
            self._start_shard(si)
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        if data.numel():
            self._fh.write(memoryview(data.view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._order):
            missing = self._order[self._next][1][0]
            raise ValueError(f"safetensors output incomplete: {missing} and later tensors were never written")
        if self._open_shard == -1:  # no tensors at all
            self._start_shard(0)
        self._finish_shard()
        if len(self.shards) > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {name: self.files[si] for si, (name, _, _) in self._order}}
            with open(self.folder / INDEX_FILE, "w", encoding="utf-8") as f:
                json.dump(index, f, indent=2)
                f.write("\n")

    def _start_shard(self, si: int) -> None:
        self._finish_shard()
        header = json.dumps(self.shards[si].header, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        self._fh = open(self.folder / self.files[si], "wb")
        self._fh.write(struct.pack("<Q", len(header)))
        self._fh.write(header)
        self._open_shard = si

    def _finish_shard(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None


def hf_tensor_files(folder: str | os.PathLike) -> Optional[dict[str, str]]:
    """``{tensor name: file name}`` of an HF folder's safetensors (index or single file), or None."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        return dict(weight_map)
    single = folder / SINGLE_FILE
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {k: SINGLE_FILE for k in f.keys()}
    return None
