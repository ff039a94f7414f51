"""The token shard file: its binary format, writing one (atomically) and reading one (memory-mapped).

Format (version 1, all integers little-endian)::

    offset  size        field
    0       8           magic b"TLSHARD\\0"
    8       4  uint32   format version (1)
    12      4  uint32   dtype code: bytes per token, 2 = uint16, 4 = uint32 (1 = uint8: loss-mask shards)
    16      8  uint64   num_tokens  (T)
    24      8  uint64   num_docs    (D)
    32      8*(D+1)     document offsets, uint64: doc i is tokens[off[i]:off[i+1]];
                        off[0] = 0, off[D] = T, non-decreasing
    32+8*(D+1)  T*itemsize   tokens

The index comes first so the tokens start on an 8-byte boundary, and the exact file size follows from the header:
a truncated, padded or foreign file is detected without reading the tokens. uint16 tokens for vocabularies of at
most 65536 entries, else uint32. :func:`write_shard` writes ``<path>.tmp``, fsyncs and renames it, so a file with
the final name is always complete.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from titanlite.errors import DataError
from titanlite.utils.fsio import atomic_write

MAGIC = b"TLSHARD\0"
VERSION = 1
HEADER = struct.Struct("<8sIIQQ")  # magic, version, dtype code, num_tokens, num_docs
HEADER_SIZE = HEADER.size  # 32
CHECKSUM_PREFIX = "crc32:"  # the manifest entries' optional "checksum" (and "max_id") are absent from older ones
_CHECKSUM_CHUNK = 16 << 20  # bytes hashed per call
_DTYPES = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4")}

PathLike = str | os.PathLike


def dtype_for_vocab(vocab_size: int) -> str:
    """ "uint16" when every id of a ``vocab_size`` vocabulary fits in 16 bits (<= 65536), else "uint32"."""
    return "uint16" if vocab_size <= 65536 else "uint32"


def _dtype_code(dtype: Any) -> int:
    dt = np.dtype(dtype)
    if dt.kind == "u" and dt.itemsize in _DTYPES:
        return dt.itemsize
    raise DataError(f"unsupported shard dtype {dtype!r} (use uint16 or uint32, or uint8 for masks)")


def dtype_name(dtype: Any) -> str:
    """ "uint16" or "uint32" for a dtype given as a name or numpy dtype."""
    return _DTYPES[_dtype_code(dtype)].name


def checksum(chunks: Iterable[Any], value: int = 0) -> str:
    """``"crc32:xxxxxxxx"`` of the concatenated byte buffers (the checksum the manifest records)."""
    for chunk in chunks:
        value = zlib.crc32(chunk, value)
    return f"{CHECKSUM_PREFIX}{value:08x}"


def write_shard_flat(
    path: PathLike,
    tokens: np.ndarray,
    lengths: Sequence[int],
    dtype: Any,
    fsync: bool = True,
    before_rename: Callable[[dict], None] | None = None,
) -> dict:
    """Write one shard from concatenated ``tokens`` and per-document ``lengths``; returns its manifest entry
    (``max_id`` -1 when empty). ``before_rename(entry)`` runs once the data is on disk, before the rename."""
    path, code = Path(path), _dtype_code(dtype)
    tokens = np.asarray(tokens)
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if tokens.ndim != 1:
        raise DataError(f"{path}: tokens must be 1-D")
    if (lengths < 0).any() or int(lengths.sum()) != tokens.size:
        raise DataError(f"{path}: document lengths sum to {int(lengths.sum())}, but there are {tokens.size} tokens")
    if tokens.size:
        if tokens.dtype.kind not in "iu":
            raise DataError(f"{path}: tokens must be integers, got {tokens.dtype}")
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= 1 << (8 * code):
            raise DataError(f"{path}: token ids {lo}..{hi} do not fit {_DTYPES[code].name}")
    offsets = np.zeros(lengths.size + 1, dtype="<u8")
    np.cumsum(lengths, out=offsets[1:])
    head = HEADER.pack(MAGIC, VERSION, code, tokens.size, lengths.size)
    chunks = [head, offsets.tobytes(), np.ascontiguousarray(tokens, dtype=_DTYPES[code]).tobytes()]
    info = {
        "name": path.name,
        "tokens": int(tokens.size),
        "docs": int(lengths.size),
        "max_id": int(tokens.max()) if tokens.size else -1,
        "checksum": checksum(chunks),
    }
    atomic_write(path, chunks, fsync=fsync, before_rename=before_rename and (lambda: before_rename(info)))
    return info


def write_shard(path: PathLike, docs_token_lists: Iterable[Sequence[int]], dtype: Any, fsync: bool = True) -> dict:
    """:func:`write_shard_flat` from per-document token lists (each already BOS + ... + EOS)."""
    arrays = [np.asarray(d, dtype=np.int64).reshape(-1) for d in docs_token_lists]
    lengths = [a.size for a in arrays]
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    return write_shard_flat(path, flat, lengths, dtype, fsync=fsync)


class ShardReader:
    """One shard file, validated and memory-mapped: ``reader[a:b]`` -> 1-D int64 tensor, ``reader.doc(i)``;
    ``checksum()`` and ``max_id()`` read the whole file. Pickles as its path (reopened in DataLoader workers)."""

    def __init__(self, path: PathLike):
        self.path = Path(path)

        def fail(what: str) -> DataError:
            return DataError(f"{self.path}: {what}")

        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(HEADER_SIZE)
                if head[: len(MAGIC)] != MAGIC[: len(head)] or not head:
                    raise fail(f"not a titanlite token shard (magic {head[:8]!r}, expected {MAGIC!r})")
                if len(head) < HEADER_SIZE:
                    raise fail(f"truncated shard: {size} bytes, shorter than the {HEADER_SIZE}-byte header")
                _, version, code, num_tokens, num_docs = HEADER.unpack(head)
                if version != VERSION:
                    raise fail(f"unsupported shard format version {version} (this build reads {VERSION})")
                if code not in _DTYPES:
                    raise fail(f"bad dtype code {code} in header (expected 1=uint8, 2=uint16 or 4=uint32)")
                tok_offset = HEADER_SIZE + 8 * (num_docs + 1)
                expected = tok_offset + code * num_tokens
                if size != expected:
                    kind = "truncated shard" if size < expected else "shard has trailing bytes"
                    raise fail(
                        f"{kind}: {size} bytes, expected {expected} for {num_tokens} "
                        f"{_DTYPES[code].name} tokens in {num_docs} documents"
                    )
                offsets = np.fromfile(f, dtype="<u8", count=num_docs + 1)
        except FileNotFoundError:
            raise fail("shard file not found") from None
        except IsADirectoryError:
            raise fail("is a folder, expected a shard file") from None
        bad_ends = offsets.size != num_docs + 1 or offsets[0] != 0 or offsets[-1] != num_tokens
        if bad_ends or (np.diff(offsets.astype(np.int64)) < 0).any():
            raise fail("corrupt document index (offsets must go from 0 to num_tokens, non-decreasing)")
        self.num_tokens, self.num_docs, self.dtype = int(num_tokens), int(num_docs), _DTYPES[code]
        self.doc_offsets = offsets
        # One mapping of the whole file: the tokens are a view of it, and checksum() hashes it, so the
        # bytes verified are the bytes read (even if the path is replaced by another file meanwhile).
        self._file: np.ndarray = np.asarray(np.memmap(self.path, dtype=np.uint8, mode="r", shape=(size,)))
        self.tokens: np.ndarray = self._file[tok_offset:].view(self.dtype)

    def checksum(self) -> str:
        """The CRC-32 of the whole file as mapped (reads every byte once; see the module docstring)."""
        view = memoryview(self._file)
        return checksum(view[i : i + _CHECKSUM_CHUNK] for i in range(0, len(view), _CHECKSUM_CHUNK))

    def max_id(self) -> int:
        """The largest token id in the shard (reads every token once); -1 when it has none."""
        return int(self.tokens.max()) if self.num_tokens else -1

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            start, stop, step = idx.indices(self.num_tokens)
            if step != 1:
                raise ValueError("shard slices must have step 1")
            return torch.from_numpy(self.tokens[start : max(start, stop)].astype(np.int64))
        return int(self.tokens[idx])

    def doc(self, i: int) -> torch.Tensor:
        """Tokens of document ``i`` (BOS ... EOS) as an int64 tensor."""
        return self[int(self.doc_offsets[i]) : int(self.doc_offsets[i + 1])]

    def __reduce__(self):
        return type(self), (self.path,)

    def __repr__(self) -> str:
        return (
            f"ShardReader({str(self.path)!r}, tokens={self.num_tokens}, docs={self.num_docs}, dtype={self.dtype.name})"
        )
