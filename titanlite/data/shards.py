"""On-disk token shards, their manifest, and a memory-mapped virtual token array over them.

Shard file format (version 1, all integers little-endian)::

    offset  size        field
    0       8           magic b"TLSHARD\\0"
    8       4  uint32   format version (1)
    12      4  uint32   dtype code: bytes per token, 2 = uint16, 4 = uint32 (1 = uint8: loss-mask shards)
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
file with the final name is always complete; an interrupted write leaves at most a ``.tmp`` file.

A prepared folder also holds ``manifest.json`` (written last)::

    {"format": "titanlite-shards", "version": 1, "dtype": "uint16",
     "tokenizer": {"path": ..., "name": ..., "vocab_size": ..., "bos_id": ..., "eos_id": ...,
                   "fingerprint": "sha256:..."},
     "shards": [{"name": "train-00000.bin", "split": "train", "tokens": ..., "docs": ...,
                 "max_id": ..., "checksum": "crc32:0123abcd"}, ...],
     "totals": {"train": {"shards": ..., "tokens": ..., "docs": ...}, "val": {...}},
     ...settings used to prepare it...}

:class:`ShardedTokens` presents all shards of one split, in manifest order, as ONE token array:
``len(store)`` tokens and ``store[a:b]`` -> 1-D int64 tensor (crossing shard boundaries as needed).
Reads are memory-mapped (lazy, nothing is loaded up front) and cost one numpy copy per slice.

Integrity checks, and what they cost (figures from ``titanlite bench data`` in the README):

* at start, free: the tokenizer fingerprint (:func:`titanlite.tokenizer.tokenizer_fingerprint`,
  a hash of what every id means) against the model's tokenizer, each shard's header against the
  manifest, and each shard's recorded ``max_id`` against the vocabulary. Nothing is read beyond
  the headers, so start-up stays O(number of shards) however large the data.
* lazily, once per shard and process: the first read of a shard first checks the CRC-32 of its
  whole file against the manifest, so a shard altered after preparation (a token overwritten with
  65535, a bad copy) is refused, naming the file, before any of its tokens reach the model. It is
  done in the process that reads (a DataLoader worker verifies in the worker) and on the same
  memory mapping the tokens are then read from, so the bytes checked are the bytes used. Checking
  every shard at start instead would read the whole dataset before the first step (minutes per TB);
  lazily, the cost is spread over the first reads of each shard and paid only for shards read.
  ``titanlite prepare --verify FOLDER`` checks every shard at once (e.g. after a copy).
  CRC-32 (zlib) is used because it is several times faster than a cryptographic hash and detects
  every accidental change of up to 32 consecutive bits; it is no defence against deliberate edits.
* chat data (``prepare_data.py --format chat``, manifest ``"content": "chat"``) has a loss-mask stream:
  next to each token shard ``<split>-NNNNN.bin`` a shard ``<split>-NNNNN.mask.bin`` in the same format with
  dtype code 1 (uint8, 1 = the token is trained on), the same tokens and documents count, recorded in the
  shard's entry as ``"mask": {"name", "checksum"}`` and checked the same way (header at start, CRC lazily).
  ``ShardedTokens.masks()`` opens it; :func:`is_chat_folder` tells such a folder apart.
* manifests written before these fields existed still load, with a warning: the tokenizer is then
  matched by vocabulary size only, and a shard without a checksum is scanned for its largest id
  on first read instead.
"""

from __future__ import annotations

import bisect
import itertools
import json
import logging
import os
import re
import struct
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from titanlite.fsio import atomic_write
from titanlite.tokenizer import Tokenizer, tokenizer_fingerprint

logger = logging.getLogger(__name__)

MAGIC = b"TLSHARD\0"
VERSION = 1
HEADER = struct.Struct("<8sIIQQ")  # magic, version, dtype code, num_tokens, num_docs
HEADER_SIZE = HEADER.size  # 32
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "titanlite-shards"
SPLITS = ("train", "val")
_ENTRY_KEYS = ("name", "split", "tokens", "docs")  # of each "shards" entry of the manifest
CHECKSUM_PREFIX = "crc32:"  # the entries' optional "checksum" (and "max_id") are absent from older manifests
_CHECKSUM_RE = re.compile(re.escape(CHECKSUM_PREFIX) + "[0-9a-f]{8}")
_CHECKSUM_CHUNK = 16 << 20  # bytes hashed per call

_DTYPES = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4")}
_NAMES = {"uint8": 1, "uint16": 2, "uint32": 4}
TOKEN_DTYPES = ("uint16", "uint32")  # what a manifest's token "dtype" may be; uint8 is for mask shards only
CHAT_CONTENT = "chat"  # the manifest's "content" for chat data (token shards + loss-mask shards)

PathLike = str | os.PathLike


class ShardIntegrityError(ValueError):
    """A shard whose bytes do not match its manifest (changed after preparation, or ids outside the
    vocabulary); raised while reading, so a launcher can tell it from other errors."""


def dtype_for_vocab(vocab_size: int) -> str:
    """ "uint16" when every id of a ``vocab_size`` vocabulary fits in 16 bits (<= 65536), else "uint32"."""
    return "uint16" if vocab_size <= 65536 else "uint32"


def _dtype_code(dtype: Any) -> int:
    dt = np.dtype(dtype)
    if dt.kind == "u" and dt.itemsize in _DTYPES:
        return dt.itemsize
    raise ValueError(f"unsupported shard dtype {dtype!r} (use uint16 or uint32, or uint8 for masks)")


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
    """Write one shard from concatenated ``tokens`` and per-document ``lengths`` (atomic rename).

    Returns its manifest entry: name, tokens, docs, ``max_id`` (-1 when empty) and the file's
    ``checksum``; ``before_rename(entry)`` is called once the data is on disk, before the rename."""
    path, code = Path(path), _dtype_code(dtype)
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
            raise ValueError(f"{path}: token ids {lo}..{hi} do not fit {_DTYPES[code].name}")
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
    """One shard file, validated and memory-mapped.

    ``num_tokens``, ``num_docs``, ``dtype`` (numpy), ``doc_offsets`` (uint64 numpy array, num_docs+1),
    ``len(reader)``, ``reader[a:b]`` -> 1-D int64 tensor, ``reader[i]`` -> int, ``reader.doc(i)``;
    ``checksum()`` and ``max_id()`` read the whole file (the manifest's integrity fields).
    Errors are one-line ``ValueError``\\ s naming the file. Pickles as its path (reopened on unpickling,
    e.g. in DataLoader workers).
    """

    def __init__(self, path: PathLike):
        self.path = Path(path)

        def fail(what: str) -> ValueError:
            return ValueError(f"{self.path}: {what}")

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


def _entry(sh: dict) -> dict:
    """A manifest "shards" entry: the required keys, then max_id and checksum where known."""
    entry = {k: sh[k] if k in ("name", "split") else int(sh[k]) for k in _ENTRY_KEYS}
    if "max_id" in sh:
        entry["max_id"] = int(sh["max_id"])
    if "checksum" in sh:
        entry["checksum"] = str(sh["checksum"])
    if "mask" in sh:
        entry["mask"] = {"name": str(sh["mask"]["name"]), "checksum": str(sh["mask"]["checksum"])}
    return entry


def build_manifest(shards: Sequence[dict], dtype: Any, tokenizer: dict, **settings: Any) -> dict:
    """The manifest dict: ``shards`` entries need name, split, tokens, docs (max_id and checksum are
    kept when given); totals are computed."""
    entries = [_entry(sh) for sh in shards]
    totals = {s: {"shards": 0, "tokens": 0, "docs": 0} for s in SPLITS}
    for e in entries:
        t = totals.setdefault(e["split"], {"shards": 0, "tokens": 0, "docs": 0})
        t.update(shards=t["shards"] + 1, tokens=t["tokens"] + e["tokens"], docs=t["docs"] + e["docs"])
    return {
        "format": MANIFEST_FORMAT,
        "version": VERSION,
        "dtype": dtype_name(dtype),
        "tokenizer": dict(tokenizer),
        **settings,
        "shards": entries,
        "totals": totals,
    }


def write_json_atomic(path: PathLike, obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=1) + "\n")


def read_manifest(folder: PathLike) -> dict:
    """Load and sanity-check ``<folder>/manifest.json`` (one-line ValueError naming the file)."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not folder.is_dir():
        raise ValueError(f"{folder}: shard folder not found")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(
            f"{path}: not found (prepare the folder with titanlite prepare; an interrupted run writes no manifest)"
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
    if manifest["dtype"] not in TOKEN_DTYPES:
        raise ValueError(f"{path}: bad dtype {manifest['dtype']!r}")
    for i, sh in enumerate(manifest["shards"]):
        if not isinstance(sh, dict) or not set(_ENTRY_KEYS) <= set(sh):
            raise ValueError(f"{path}: shard entry {i} needs name, split, tokens and docs")
        if "max_id" in sh and (not isinstance(sh["max_id"], int) or isinstance(sh["max_id"], bool)):
            raise ValueError(f"{path}: shard entry {i} ({sh['name']}): max_id must be an integer, got {sh['max_id']!r}")
        if "checksum" in sh and not (isinstance(sh["checksum"], str) and _CHECKSUM_RE.fullmatch(sh["checksum"])):
            raise ValueError(
                f"{path}: shard entry {i} ({sh['name']}): checksum must look like '{CHECKSUM_PREFIX}<8 hex digits>', "
                f"got {sh['checksum']!r}"
            )
        mask = sh.get("mask")
        if mask is not None and not (
            isinstance(mask, dict)
            and isinstance(mask.get("name"), str)
            and isinstance(mask.get("checksum"), str)
            and _CHECKSUM_RE.fullmatch(mask["checksum"])
        ):
            raise ValueError(f"{path}: shard entry {i} ({sh['name']}): mask must be {{name, checksum}}, got {mask!r}")
        if manifest.get("content") == CHAT_CONTENT and mask is None:
            raise ValueError(f"{path}: shard entry {i} ({sh['name']}): chat data needs a 'mask' entry")
    return manifest


def is_chat_folder(folder: PathLike) -> bool:
    """Whether a prepared folder holds chat data (token shards with loss-mask shards)."""
    return read_manifest(folder).get("content") == CHAT_CONTENT


def mask_entry(entry: dict) -> dict:
    """The manifest-style entry of a token shard's loss-mask shard (same tokens and docs, ids 0/1)."""
    mask = entry["mask"]
    return {**entry, "name": mask["name"], "checksum": mask["checksum"], "max_id": 1}


def describe_tokenizer(info: dict) -> str:
    """One line naming a tokenizer from its manifest-style ``info`` (name, path, vocab_size, fingerprint)."""
    fp = info.get("fingerprint")
    where = info.get("path") or "built-in"
    return f"{info.get('name')!r} ({where}, {info.get('vocab_size')} tokens, " + (
        f"fingerprint {fp[:19]})" if fp else "no fingerprint recorded)"
    )


def tokenizer_info(tokenizer: Tokenizer) -> dict:
    """What the manifest records about the tokenizer its shards were made with."""
    t = tokenizer
    return dict(
        path=t.path,
        name=t.name,
        vocab_size=t.vocab_size,
        bos_id=t.bos_id,
        eos_id=t.eos_id,
        fingerprint=tokenizer_fingerprint(t),
    )


def check_tokenizer(manifest: dict, manifest_path: PathLike, tokenizer: Tokenizer) -> None:
    """Refuse shards made with another tokenizer (one-line ValueError naming the manifest and both).

    The fingerprint is compared when the manifest has one; older manifests are matched by vocabulary
    size only, with a warning: a different tokenizer of the same size would go unnoticed."""
    recorded, ours = manifest["tokenizer"], tokenizer_info(tokenizer)
    fp = recorded.get("fingerprint")
    same = fp == ours["fingerprint"] if fp else int(recorded.get("vocab_size", -1)) == ours["vocab_size"]
    if not same:
        raise ValueError(
            f"{manifest_path}: shards were tokenized with {describe_tokenizer(recorded)}, but the model's "
            f"tokenizer (model.tokenizer_path) is {describe_tokenizer(ours)}; use the tokenizer the shards were "
            f"prepared with, or prepare them again with this one"
        )
    if not fp:
        logger.warning(
            "%s: no tokenizer fingerprint (prepared by an older titanlite): only the vocabulary size (%d) could be "
            "checked against %s; prepare the shards again to record one",
            manifest_path,
            ours["vocab_size"],
            describe_tokenizer(ours),
        )


def open_shard(manifest_path: Path, manifest: dict, entry: dict) -> ShardReader:
    """The shard of a manifest ``entry``, its header checked against the entry and its recorded
    ``max_id`` against the vocabulary (reads the header only); one-line ValueError naming the file."""
    reader = ShardReader(manifest_path.parent / entry["name"])
    if reader.num_tokens != int(entry["tokens"]) or reader.num_docs != int(entry["docs"]):
        raise ValueError(
            f"{reader.path}: header says {reader.num_tokens} tokens / {reader.num_docs} docs, "
            f"{manifest_path} says {entry['tokens']} / {entry['docs']}"
        )
    if reader.dtype.itemsize != _NAMES[manifest["dtype"]]:
        raise ValueError(f"{reader.path}: dtype {reader.dtype.name} differs from {manifest_path} ({manifest['dtype']})")
    vocab = int(manifest["tokenizer"]["vocab_size"])
    if entry.get("max_id", -1) >= vocab:
        raise ValueError(
            f"{reader.path}: {manifest_path} records token id {entry['max_id']}, outside the vocabulary of "
            f"{vocab} tokens (ids 0..{vocab - 1})"
        )
    return reader


def verify_shard_bytes(reader: ShardReader, entry: dict, vocab_size: int, manifest_path: PathLike) -> None:
    """Read the whole shard: its checksum must be the manifest's (or, for an entry without one, every
    token id must be inside the vocabulary); one-line :class:`ShardIntegrityError` naming the file."""
    if "checksum" in entry:
        got = reader.checksum()
        if got != entry["checksum"]:
            raise ShardIntegrityError(
                f"{reader.path}: checksum {got} differs from {entry['checksum']} in {manifest_path}: the file "
                f"changed after it was prepared; restore it or prepare the data again"
            )
    elif (hi := reader.max_id()) >= vocab_size:
        raise ShardIntegrityError(
            f"{reader.path}: holds token id {hi}, outside the vocabulary of {vocab_size} tokens recorded in "
            f"{manifest_path}; the file is damaged or was not made with that tokenizer"
        )


class ShardedTokens:
    """All shards of one split of a prepared folder as ONE virtual 1-D token array (see the module docstring).

    Also ``store.gather(starts, length)`` (``[len(starts), length]`` windows in one preallocated array),
    ``eos_id``, ``bos_id``, ``vocab_size``, ``dtype`` (name), ``num_docs``, ``manifest``, ``shards``
    (:class:`ShardReader` list), ``shard_starts`` (first global token of each shard, then the total)
    and ``doc_offsets()``. Each shard's header is checked against the manifest (tokens, docs, dtype);
    a mismatch, a recorded ``max_id`` outside the vocabulary or a split with no tokens is a one-line
    ``ValueError`` naming the file; with ``tokenizer``, so is a manifest made with another tokenizer
    (:func:`check_tokenizer`). Each shard's checksum is verified on its first read in this process
    (:meth:`verify_shard`). Pickles as (folder, split): a DataLoader worker verifies for itself.
    """

    def __init__(
        self, folder: PathLike, split: str = "train", tokenizer: Tokenizer | None = None, stream: str = "tokens"
    ):
        folder = Path(folder)
        if folder.name == MANIFEST and folder.is_file():
            folder = folder.parent
        self.folder, self.split, self.stream = folder, split, stream
        self.manifest = manifest = read_manifest(folder)
        self.manifest_path = mpath = folder / MANIFEST
        tok = manifest["tokenizer"]
        self.vocab_size, self.bos_id, self.eos_id = (int(tok[k]) for k in ("vocab_size", "bos_id", "eos_id"))
        if tokenizer is not None:
            check_tokenizer(manifest, mpath, tokenizer)
        self.dtype = manifest["dtype"]
        self.entries = entries = [sh for sh in manifest["shards"] if sh["split"] == split]
        if stream == "mask":  # the loss-mask shards, checked like token shards (see the module docstring)
            if manifest.get("content") != CHAT_CONTENT:
                raise ValueError(f"{mpath}: has no loss-mask stream (not chat data: prepare it with --format chat)")
            self.entries = entries = [mask_entry(sh) for sh in entries]
            self.dtype, manifest = "uint8", {**manifest, "dtype": "uint8"}
        if not entries:
            splits = sorted({sh["split"] for sh in manifest["shards"]})
            raise ValueError(
                f"{mpath}: split {split!r} has no shards (splits present: {', '.join(splits) or 'none'}"
                f"{'; prepared with --val-fraction 0?' if split == 'val' else ''})"
            )
        self.shards = [open_shard(mpath, manifest, sh) for sh in entries]
        self.shard_starts = [0, *itertools.accumulate(r.num_tokens for r in self.shards)]
        self._arrays = [r.tokens for r in self.shards]
        self._verified = [False] * len(self.shards)  # per shard: checked in this process (verify_shard)
        self._len = self.shard_starts[-1]
        if self._len == 0:
            raise ValueError(f"{mpath}: split {split!r} has no tokens")
        self.num_docs = sum(r.num_docs for r in self.shards)
        unchecked = sum("checksum" not in sh for sh in entries)
        if unchecked:
            logger.warning(
                "%s: %d of the %d %s shards have no recorded checksum (prepared by an older titanlite): changes to "
                "their bytes cannot be detected; each is scanned for token ids outside the vocabulary on first read",
                mpath,
                unchecked,
                len(entries),
                split,
            )

    def verify_shard(self, i: int) -> None:
        """Check shard ``i`` against the manifest once per process, before any of its tokens are used.

        The checksum of the whole file (or, for a manifest without one, the largest token id) is
        computed on the memory mapping the tokens are read from; a one-line ValueError names the file.
        """
        if not self._verified[i]:
            verify_shard_bytes(self.shards[i], self.entries[i], self.vocab_size, self.manifest_path)
            self._verified[i] = True

    def __len__(self) -> int:
        return self._len

    def _copy_into(self, out: np.ndarray, start: int, stop: int) -> None:
        """Copy global tokens [start, stop) into ``out`` (int64, length stop-start), crossing shards."""
        starts, pos = self.shard_starts, 0
        i = bisect.bisect_right(starts, start) - 1
        while start < stop:
            if not self._verified[i]:
                self.verify_shard(i)
            end = min(stop, starts[i + 1])
            out[pos : pos + end - start] = self._arrays[i][start - starts[i] : end - starts[i]]
            pos += end - start
            start, i = end, i + 1

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            start, stop, step = idx.indices(self._len)
            if step != 1:
                raise ValueError("ShardedTokens slices must have step 1")
            out = np.empty(max(0, stop - start), dtype=np.int64)
            self._copy_into(out, start, stop)
            return torch.from_numpy(out)
        i = int(idx) + (self._len if int(idx) < 0 else 0)
        if not 0 <= i < self._len:
            raise IndexError(f"token index {idx} out of range for {self._len} tokens")
        k = bisect.bisect_right(self.shard_starts, i) - 1
        self.verify_shard(k)
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
        parts = [r.doc_offsets[1:].astype(np.int64) + s0 for r, s0 in zip(self.shards, self.shard_starts)]
        return np.concatenate([np.zeros(1, dtype=np.int64), *parts])

    def masks(self) -> ShardedTokens:
        """The split's loss-mask stream (chat data): ``store[a:b]`` is 1 where tokens ``a..b`` are trained on."""
        return ShardedTokens(self.folder, self.split, stream="mask")

    def __reduce__(self):
        return type(self), (self.folder, self.split, None, self.stream)

    def __repr__(self) -> str:
        return (
            f"ShardedTokens({str(self.folder)!r}, split={self.split!r}, tokens={self._len}, "
            f"docs={self.num_docs}, shards={len(self.shards)}, dtype={self.dtype})"
        )
