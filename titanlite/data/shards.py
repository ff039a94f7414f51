"""A prepared shard folder as token arrays, and the integrity checks of its shards (every name of
:mod:`titanlite.data.shard_file` and :mod:`titanlite.data.manifest` is importable from here too).

:class:`ShardedTokens` presents the shards of one split, in manifest order, as ONE memory-mapped token array.
Where each check sits, and why (figures: docs/scale.md):

* At start, headers only (start-up stays O(shards) however large the data): the tokenizer fingerprint (a hash of
  what every id means) against the model's tokenizer, each shard's header against the manifest, and its recorded
  ``max_id`` against the vocabulary.
* Lazily, once per shard and process: the CRC-32 of the whole file against the manifest, on the first read and
  on the same memory mapping the tokens are then read from (the bytes checked are the bytes used; a DataLoader
  worker checks in the worker). At start it would read the whole dataset before the first step; lazily the cost
  is spread and paid only for shards read. CRC-32 detects accidental damage several times faster than a
  cryptographic hash; it is no defence against deliberate edits.
* Chat data has a loss-mask shard ``<split>-NNNNN.mask.bin`` beside each token shard (dtype code 1, 1 = trained
  on), recorded in its entry as ``"mask": {"name", "checksum"}`` and checked the same way
  (:meth:`ShardedTokens.masks`, :func:`is_chat_folder`).
* Manifests from before these fields still load, with a warning: the tokenizer matched by vocabulary size only,
  a shard without a checksum scanned for its largest id on first read.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from titanlite.data.manifest import (  # noqa: F401 (re-exported: the public face of prepared folders)
    CHAT_CONTENT,
    MANIFEST,
    MANIFEST_FORMAT,
    SPLITS,
    TOKEN_DTYPES,
    ShardIntegrityError,
    build_manifest,
    check_tokenizer,
    describe_tokenizer,
    is_chat_folder,
    mask_entry,
    open_shard,
    read_manifest,
    tokenizer_info,
    verify_shard_bytes,
    write_json_atomic,
)
from titanlite.data.shard_file import (  # noqa: F401
    CHECKSUM_PREFIX,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    PathLike,
    ShardReader,
    checksum,
    dtype_for_vocab,
    dtype_name,
    write_shard,
    write_shard_flat,
)
from titanlite.errors import DataError
from titanlite.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
# Why a folder has no 'val' split, and how to write one that is all validation data.
VAL_HINT = "; prepared with --val-fraction 0? a folder of validation data only: titanlite prepare --val-only"


class ShardedTokens:
    """All shards of one split of a prepared folder as ONE virtual 1-D token array: ``len(store)``, ``store[a:b]``
    (crossing shards as needed, one numpy copy per slice) and ``store.gather(starts, length)`` (windows in one
    array). Checked at construction as the module docstring says (with ``tokenizer``: :func:`check_tokenizer`),
    each shard's checksum on its first read (:meth:`verify_shard`). Pickles as (folder, split): a DataLoader
    worker verifies for itself.
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
                raise DataError(f"{mpath}: has no loss-mask stream (not chat data: prepare it with --format chat)")
            self.entries = entries = [mask_entry(sh) for sh in entries]
            self.dtype, manifest = "uint8", {**manifest, "dtype": "uint8"}
        if not entries:
            splits = sorted({sh["split"] for sh in manifest["shards"]})
            raise DataError(
                f"{mpath}: split {split!r} has no shards (splits present: {', '.join(splits) or 'none'}"
                f"{VAL_HINT if split == 'val' else ''})"
            )
        self.shards = [open_shard(mpath, manifest, sh) for sh in entries]
        self.shard_starts = [0, *itertools.accumulate(r.num_tokens for r in self.shards)]
        self._arrays = [r.tokens for r in self.shards]
        self._verified = [False] * len(self.shards)  # per shard: checked in this process (verify_shard)
        self._len = self.shard_starts[-1]
        if self._len == 0:
            raise DataError(f"{mpath}: split {split!r} has no tokens")
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
        """Check shard ``i`` against the manifest once per process, before any of its tokens are used: its checksum
        (or, without one, its largest id) on the memory mapping the tokens are read from."""
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
        return int(self[i : i + 1][0])

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
