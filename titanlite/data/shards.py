"""On-disk token shards, their manifest, and a memory-mapped virtual token array over them.

Shard file format (version 1, all integers little-endian)::

    offset  size        field
    0       8           magic b"TLSHARD\\0"
    8       4  uint32   format version (1)
    12      4  uint32   dtype code: bytes per token, 2 = uint16, 4 = uint32
    16      8  uint64   num_tokens  (T)
    24      8  uint64   num_docs    (D)
    32      8*(D+1)     document offsets, uint64: doc i is tokens[off[i]:off[i+1]];
                        off[0] = 0, off[D] = T, non-decreasing
    32+8*(D+1)  T*itemsize   tokens

The index comes before the tokens so the token array starts on an 8-byte boundary, and the exact
file size is ``32 + 8*(D+1) + itemsize*T``: a truncated, padded or foreign file is detected from
the header alone, without reading the tokens. Tokens use uint16 when the vocabulary has at most
65536 entries, else uint32. Each document is stored as ``BOS + tokens + EOS``.

:func:`write_shard` writes ``<path>.tmp``, fsyncs it and renames it over ``<path>`` (atomic), so a
file with the final name is always complete; an interrupted write leaves only a ``.tmp`` file.

A prepared folder also holds ``manifest.json`` (written last)::

    {"format": "titanlite-shards", "version": 1, "dtype": "uint16",
     "tokenizer": {"path": ..., "name": ..., "vocab_size": ..., "bos_id": ..., "eos_id": ...},
     "shards": [{"name": "train-00000.bin", "split": "train", "tokens": ..., "docs": ...}, ...],
     "totals": {"train": {"shards": ..., "tokens": ..., "docs": ...}, "val": {...}},
     ...settings used to prepare it...}

:class:`ShardedTokens` presents all shards of one split, in manifest order, as ONE token array:
``len(store)`` tokens and ``store[a:b]`` -> 1-D int64 tensor (crossing shard boundaries as needed).
Reads are memory-mapped (lazy, nothing is loaded up front) and cost one numpy copy per slice.
"""

from __future__ import annotations

import bisect
import json
import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

MAGIC = b"TLSHARD\0"
VERSION = 1
HEADER = struct.Struct("<8sIIQQ")  # magic, version, dtype code, num_tokens, num_docs
HEADER_SIZE = HEADER.size  # 32
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "titanlite-shards"
SPLITS = ("train", "val")

_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
_NAMES = {"uint16": 2, "uint32": 4}
_CODE_NAMES = {2: "uint16", 4: "uint32"}

PathLike = str | os.PathLike


def dtype_for_vocab(vocab_size: int) -> str:
    """ "uint16" when every id of a ``vocab_size`` vocabulary fits in 16 bits (<= 65536), else "uint32"."""
    return "uint16" if vocab_size <= 65536 else "uint32"


def _dtype_code(dtype: Any) -> int:
    if isinstance(dtype, str) and dtype in _NAMES:
        return _NAMES[dtype]
    dt = np.dtype(dtype)
    if dt.kind == "u" and dt.itemsize in _DTYPES:
        return dt.itemsize
    raise ValueError(f"unsupported shard dtype {dtype!r} (use uint16 or uint32)")


def dtype_name(dtype: Any) -> str:
    """ "uint16" or "uint32" for a dtype given as a name or numpy dtype."""
    return _CODE_NAMES[_dtype_code(dtype)]


def write_shard_flat(
    path: PathLike, tokens: np.ndarray, lengths: Sequence[int], dtype: Any, fsync: bool = True
) -> dict:
    """Write one shard from concatenated ``tokens`` and per-document ``lengths`` (atomic rename)."""
    path = Path(path)
    code = _dtype_code(dtype)
    dt = _DTYPES[code]
    tokens = np.asarray(tokens)
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if tokens.ndim != 1:
        raise ValueError(f"{path}: tokens must be 1-D")
    if (lengths < 0).any() or int(lengths.sum()) != tokens.size:
        raise ValueError(f"{path}: document lengths sum to {int(lengths.sum())}, but there are {tokens.size} tokens")
    if tokens.size:
        if tokens.dtype.kind not in "iu":
            raise ValueError(f"{path}: tokens must be integers, got {tokens.dtype}")
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= 1 << (8 * code):
            raise ValueError(f"{path}: token ids {lo}..{hi} do not fit {_CODE_NAMES[code]}")
    offsets = np.zeros(lengths.size + 1, dtype="<u8")
    np.cumsum(lengths, out=offsets[1:])
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, code, tokens.size, lengths.size))
        f.write(offsets.tobytes())
        f.write(np.ascontiguousarray(tokens, dtype=dt).tobytes())
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"name": path.name, "tokens": int(tokens.size), "docs": int(lengths.size)}


def write_shard(path: PathLike, docs_token_lists: Iterable[Sequence[int]], dtype: Any, fsync: bool = True) -> dict:
    """Write one shard holding the given documents' token lists (each already BOS + ... + EOS).

    Writes ``<path>.tmp`` then renames it to ``path``. Returns ``{"name", "tokens", "docs"}``.
    """
    arrays = [np.asarray(d, dtype=np.int64).reshape(-1) for d in docs_token_lists]
    lengths = [a.size for a in arrays]
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    return write_shard_flat(path, flat, lengths, dtype, fsync=fsync)


class ShardReader:
    """One shard file, validated and memory-mapped.

    ``num_tokens``, ``num_docs``, ``dtype`` (numpy), ``doc_offsets`` (uint64 numpy array, num_docs+1),
    ``len(reader)``, ``reader[a:b]`` -> 1-D int64 tensor, ``reader[i]`` -> int, ``reader.doc(i)``.
    Pickles as its path (reopened on unpickling, e.g. in DataLoader workers).
    """

    def __init__(self, path: PathLike):
        self.path = Path(path)
        self._open()

    def _fail(self, what: str) -> ValueError:
        return ValueError(f"{self.path}: {what}")

    def _open(self) -> None:
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(HEADER_SIZE)
                if head[: len(MAGIC)] != MAGIC[: len(head)] or not head:
                    raise self._fail(f"not a titanlite token shard (magic {head[:8]!r}, expected {MAGIC!r})")
                if len(head) < HEADER_SIZE:
                    raise self._fail(f"truncated shard: {size} bytes, shorter than the {HEADER_SIZE}-byte header")
                _, version, code, num_tokens, num_docs = HEADER.unpack(head)
                if version != VERSION:
                    raise self._fail(f"unsupported shard format version {version} (this build reads {VERSION})")
                if code not in _DTYPES:
                    raise self._fail(f"bad dtype code {code} in header (expected 2=uint16 or 4=uint32)")
                tok_offset = HEADER_SIZE + 8 * (num_docs + 1)
                expected = tok_offset + code * num_tokens
                if size != expected:
                    kind = "truncated shard" if size < expected else "shard has trailing bytes"
                    raise self._fail(
                        f"{kind}: {size} bytes, expected {expected} for {num_tokens} "
                        f"{_CODE_NAMES[code]} tokens in {num_docs} documents"
                    )
                offsets = np.fromfile(f, dtype="<u8", count=num_docs + 1)
        except FileNotFoundError:
            raise self._fail("shard file not found") from None
        except IsADirectoryError:
            raise self._fail("is a folder, expected a shard file") from None
        if (
            offsets.size != num_docs + 1
            or offsets[0] != 0
            or offsets[-1] != num_tokens
            or (num_docs and bool((np.diff(offsets.astype(np.int64)) < 0).any()))
        ):
            raise self._fail("corrupt document index (offsets must go from 0 to num_tokens, non-decreasing)")
        self.num_tokens, self.num_docs, self.dtype = int(num_tokens), int(num_docs), _DTYPES[code]
        self.doc_offsets = offsets
        self.tokens_offset = tok_offset
        if self.num_tokens:
            mm = np.memmap(self.path, dtype=self.dtype, mode="r", offset=tok_offset, shape=(self.num_tokens,))
            self.tokens: np.ndarray = np.asarray(mm)  # plain ndarray view backed by the mapping
        else:
            self.tokens = np.zeros(0, dtype=self.dtype)

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

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.path = state["path"]
        self._open()

    def __repr__(self) -> str:
        return (
            f"ShardReader({str(self.path)!r}, tokens={self.num_tokens}, docs={self.num_docs}, dtype={self.dtype.name})"
        )


# --- manifest -------------------------------------------------------------------------------------


def build_manifest(shards: Sequence[dict], dtype: Any, tokenizer: dict, **settings: Any) -> dict:
    """The manifest dict: ``shards`` entries need name, split, tokens, docs; totals are computed."""
    totals = {s: {"shards": 0, "tokens": 0, "docs": 0} for s in SPLITS}
    for sh in shards:
        t = totals.setdefault(sh["split"], {"shards": 0, "tokens": 0, "docs": 0})
        t["shards"] += 1
        t["tokens"] += int(sh["tokens"])
        t["docs"] += int(sh["docs"])
    return {
        "format": MANIFEST_FORMAT,
        "version": VERSION,
        "dtype": dtype_name(dtype),
        "tokenizer": dict(tokenizer),
        **settings,
        "shards": [
            {"name": s["name"], "split": s["split"], "tokens": int(s["tokens"]), "docs": int(s["docs"])} for s in shards
        ],
        "totals": totals,
    }


def write_json_atomic(path: PathLike, obj: Any) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(folder: PathLike) -> dict:
    """Load and sanity-check ``<folder>/manifest.json`` (one-line ValueError naming the file)."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not folder.is_dir():
        raise ValueError(f"{folder}: shard folder not found")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise ValueError(
            f"{path}: not found (prepare the folder with scripts/prepare_data.py; "
            f"an interrupted run writes no manifest)"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{path}: not a titanlite shard manifest (format != {MANIFEST_FORMAT!r})")
    if manifest.get("version") != VERSION:
        raise ValueError(f"{path}: unsupported manifest version {manifest.get('version')!r}")
    for key in ("dtype", "tokenizer", "shards"):
        if key not in manifest:
            raise ValueError(f"{path}: missing {key!r}")
    if manifest["dtype"] not in _NAMES:
        raise ValueError(f"{path}: bad dtype {manifest['dtype']!r}")
    for i, sh in enumerate(manifest["shards"]):
        if not isinstance(sh, dict) or not {"name", "split", "tokens", "docs"} <= set(sh):
            raise ValueError(f"{path}: shard entry {i} needs name, split, tokens and docs")
    return manifest


class ShardedTokens:
    """All shards of one split of a prepared folder as ONE virtual 1-D token array.

    * ``len(store)``: total tokens of the split; ``store[a:b]`` -> 1-D ``torch.int64`` tensor
      (any ``a:b`` with step 1, crossing shards as needed); ``store[i]`` -> int.
    * ``store.gather(starts, length)`` -> ``[len(starts), length]`` int64 tensor of windows
      ``store[s:s+length]`` (one preallocated output, no per-window tensors).
    * ``eos_id``, ``bos_id``, ``vocab_size``, ``dtype`` (name), ``num_docs``, ``manifest``,
      ``shards`` (list of :class:`ShardReader`), ``shard_starts`` (first global token index of
      each shard + the total at the end), ``doc_offsets()`` (global document boundaries).

    Each shard's header is checked against the manifest (tokens, docs, dtype); a mismatch or a
    split with no tokens is a one-line ``ValueError`` naming the file. Pickles as (folder, split).
    """

    def __init__(self, folder: PathLike, split: str = "train"):
        folder = Path(folder)
        if folder.name == MANIFEST and folder.is_file():
            folder = folder.parent
        self.folder, self.split = folder, split
        self._open()

    def _open(self) -> None:
        folder, split = self.folder, self.split
        manifest = read_manifest(folder)
        mpath = folder / MANIFEST
        self.manifest = manifest
        tok = manifest["tokenizer"]
        self.vocab_size = int(tok["vocab_size"])
        self.bos_id = int(tok["bos_id"])
        self.eos_id = int(tok["eos_id"])
        self.dtype = manifest["dtype"]
        entries = [sh for sh in manifest["shards"] if sh["split"] == split]
        if not entries:
            splits = sorted({sh["split"] for sh in manifest["shards"]})
            raise ValueError(
                f"{mpath}: split {split!r} has no shards (splits present: {', '.join(splits) or 'none'}"
                f"{'; prepared with --val-fraction 0?' if split == 'val' else ''})"
            )
        self.shards: list[ShardReader] = []
        for sh in entries:
            reader = ShardReader(folder / sh["name"])
            if reader.num_tokens != int(sh["tokens"]) or reader.num_docs != int(sh["docs"]):
                raise ValueError(
                    f"{reader.path}: header says {reader.num_tokens} tokens / {reader.num_docs} docs, "
                    f"{mpath} says {sh['tokens']} / {sh['docs']}"
                )
            if reader.dtype.itemsize != _NAMES[self.dtype]:
                raise ValueError(f"{reader.path}: dtype {reader.dtype.name} differs from {mpath} ({self.dtype})")
            self.shards.append(reader)
        starts = [0]
        for r in self.shards:
            starts.append(starts[-1] + r.num_tokens)
        self.shard_starts = starts
        self._arrays = [r.tokens for r in self.shards]
        self._len = starts[-1]
        if self._len == 0:
            raise ValueError(f"{mpath}: split {split!r} has no tokens")
        self.num_docs = sum(r.num_docs for r in self.shards)

    def __len__(self) -> int:
        return self._len

    def _copy_into(self, out: np.ndarray, start: int, stop: int) -> None:
        """Copy global tokens [start, stop) into ``out`` (int64, length stop-start), crossing shards."""
        starts, arrays = self.shard_starts, self._arrays
        i = bisect.bisect_right(starts, start) - 1
        pos = 0
        while start < stop:
            s0, s1 = starts[i], starts[i + 1]
            end = min(stop, s1)
            n = end - start
            out[pos : pos + n] = arrays[i][start - s0 : end - s0]
            pos += n
            start = end
            i += 1

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            start, stop, step = idx.indices(self._len)
            if step != 1:
                raise ValueError("ShardedTokens slices must have step 1")
            if stop <= start:
                return torch.empty(0, dtype=torch.int64)
            starts = self.shard_starts
            i = bisect.bisect_right(starts, start) - 1
            if stop <= starts[i + 1]:  # fast path: inside one shard
                s0 = starts[i]
                return torch.from_numpy(self._arrays[i][start - s0 : stop - s0].astype(np.int64))
            out = np.empty(stop - start, dtype=np.int64)
            self._copy_into(out, start, stop)
            return torch.from_numpy(out)
        i = int(idx)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"token index {idx} out of range for {self._len} tokens")
        k = bisect.bisect_right(self.shard_starts, i) - 1
        return int(self._arrays[k][i - self.shard_starts[k]])

    def gather(self, starts: Sequence[int], length: int) -> torch.Tensor:
        """Windows ``store[s:s+length]`` for each ``s`` in ``starts`` as one ``[B, length]`` int64 tensor."""
        starts = [int(s) for s in starts]
        out = np.empty((len(starts), length), dtype=np.int64)
        for row, s in enumerate(starts):
            if s < 0 or s + length > self._len:
                raise IndexError(f"window [{s}, {s + length}) out of range for {self._len} tokens")
            self._copy_into(out[row], s, s + length)
        return torch.from_numpy(out)

    def doc_offsets(self) -> np.ndarray:
        """Global document boundaries (int64, num_docs+1): doc j is ``store[off[j]:off[j+1]]``."""
        parts = [np.zeros(1, dtype=np.int64)]
        for r, s0 in zip(self.shards, self.shard_starts):
            parts.append(r.doc_offsets[1:].astype(np.int64) + s0)
        return np.concatenate(parts)

    def __getstate__(self):
        return {"folder": self.folder, "split": self.split}

    def __setstate__(self, state):
        self.folder, self.split = state["folder"], state["split"]
        self._open()

    def __repr__(self) -> str:
        return (
            f"ShardedTokens({str(self.folder)!r}, split={self.split!r}, tokens={self._len}, "
            f"docs={self.num_docs}, shards={len(self.shards)}, dtype={self.dtype})"
        )
