"""Training windows cut from one long token stream, shuffled, split per data-parallel rank, resumable.

The stream is anything with ``len(store)`` and ``store[a:b]`` -> 1-D integer tensor (a tensor, or
:class:`titanlite.data.shards.ShardedTokens`), cut into ``len // (seq_len + 1)`` non-overlapping windows (inputs,
and labels shifted by one). Each epoch permutes the windows from ``(seed, epoch)``; a global cursor walks the
permutation ``dp_world`` windows at a time and rank ``r`` takes ``perm[pos + r]``, so the ranks read disjoint
windows, and a resume with another data-parallel degree continues exactly where the old run stopped. DataLoader
worker ``w`` of ``n`` makes the batches ``b % n == w``, the order the loader hands them out, so the sequence is the
one without workers. A finite dataset (validation) restarts from its first window on every ``iter()``.

**Packing whole documents** (``doc_offsets``, chat data): windows are filled next-fit with whole consecutive
documents and padded (``pad_id`` inputs, labels -100, each pad its own document with ``eos_id``). Document ids come
from the offsets, not from EOS tokens: a chat EOS (``<|eot_id|>``) ends every message, and a scan would cut
conversations into messages. A document longer than a window is truncated (``num_truncated``, logged once).
**Loss masks** (``mask``, 1 = train on this token): labels whose target has mask 0 become -100.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from titanlite.errors import DataError

logger = logging.getLogger(__name__)

# The end of the one-line error when a resume finds the data pipeline changed in kind (a mixture or a seq_len
# schedule added or removed): the saved position means nothing to the new pipeline.
CHANGE_OF_KIND = (
    "a resume keeps the data pipeline's kind: train on with the checkpoint's data settings, or start a new run "
    "from its weights (checkpoint.initial_load_path in another job.dump_folder)"
)


IGNORE_INDEX = -100  # labels that carry no loss (F.cross_entropy's default ignore_index)


def pack_documents(doc_offsets: Any, window_tokens: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Next-fit packing of whole documents into windows of ``window_tokens`` tokens: ``(starts, lengths,
    num_truncated)``, window ``w`` holding ``tokens[starts[w] : starts[w] + lengths[w]]``. Consecutive
    documents share a window while they fit; a longer document gets a window of its own, truncated."""
    offsets = np.asarray(doc_offsets, dtype=np.int64)
    sizes = np.diff(offsets)
    starts, lengths = [], []
    start, fill = 0, 0  # the open window: its first token and how many tokens it holds
    for doc_start, size in zip(offsets[:-1].tolist(), sizes.tolist()):
        if size == 0:
            continue
        if fill and fill + size > window_tokens:  # does not fit: close the open window
            starts.append(start)
            lengths.append(fill)
            fill = 0
        if not fill:
            start = doc_start
        fill += size
    if fill:
        starts.append(start)
        lengths.append(fill)
    lengths_arr = np.asarray(lengths, dtype=np.int64)
    truncated = int((lengths_arr > window_tokens).sum())
    return np.asarray(starts, dtype=np.int64), np.minimum(lengths_arr, window_tokens), truncated


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Per-token document index within a window: a new document starts after every EOS."""
    starts = torch.zeros_like(tokens)
    starts[..., 1:] = (tokens[..., :-1] == eos_id).to(tokens.dtype)
    return starts.cumsum(-1)


def check_repartition(what: str, old_world: int, new_world: int, sample: int, batch_size: int) -> None:
    """A resume onto another data-parallel degree continues from the global cursor; it is refused (one line)
    inside DataLoader workers (each would re-partition alone) and in the middle of a batch."""
    change = f"{what} from {old_world} to {new_world}"
    if get_worker_info() is not None:
        raise DataError(f"cannot re-partition {change} ranks with DataLoader workers; resume with num_workers=0")
    if sample % batch_size:
        raise DataError(f"cannot re-partition {change} ranks in the middle of a batch")


class TokenWindows(IterableDataset):
    """Stateful iterable over ``{"input_ids", "labels"[, "document_ids"]}`` windows of one rank."""

    def __init__(
        self,
        store: Any,
        seq_len: int,
        *,
        dp_rank: int = 0,
        dp_world: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        infinite: bool = True,
        batch_size: int = 1,
        eos_id: int | None = None,
        name: str = "train",
        mask: Any = None,
        doc_offsets: Any = None,
        pad_id: int | None = None,
    ):
        self.store, self.seq_len, self.name = store, seq_len, name
        self.dp_rank, self.dp_world, self.seed = dp_rank, dp_world, seed
        self.shuffle, self.infinite, self.batch_size, self.eos_id = shuffle, infinite, batch_size, eos_id
        self.mask, self.pad_id = mask, pad_id if pad_id is not None else eos_id
        self.packed = None  # (starts, lengths) of whole-document windows
        if doc_offsets is not None:
            if self.pad_id is None:
                raise DataError(f"{name} data: packing documents needs a pad_id (or eos_id) for the padding")
            self.doc_offsets = np.asarray(doc_offsets, dtype=np.int64)
            starts, lengths, self.num_truncated = pack_documents(self.doc_offsets, seq_len + 1)
            self.packed = (starts, lengths)
            if self.num_truncated:
                logger.info(
                    "%s data: %d documents are longer than seq_len+1 = %d tokens and are truncated",
                    name,
                    self.num_truncated,
                    seq_len + 1,
                )
        self.num_windows = len(store) // (seq_len + 1) if self.packed is None else len(self.packed[0])
        if self.num_windows < dp_world:
            raise DataError(
                f"{name} data has {len(store)} tokens: fewer than one window of seq_len+1={seq_len + 1} "
                f"tokens per data-parallel rank ({dp_world} ranks)"
            )
        self.epoch, self.pos, self.sample = 0, 0, 0  # the cursor; `sample` counts this rank's samples

    def has_loss_labels(self, chunk: int = 1 << 22) -> bool:
        """Whether any window has a label that carries loss (always, without a ``mask``). The mask is first read
        in large chunks (a mask of zeros only is the usual reason for False); then the windows are read until one
        has a target inside its masked span (a trained token may also fall outside every window: truncated)."""
        if self.mask is None:
            return True
        if not any(bool(self.mask[a : a + chunk].any()) for a in range(0, len(self.mask), chunk)):
            return False
        size = self.seq_len + 1
        for w in range(self.num_windows):
            start, n = (w * size, size) if self.packed is None else (int(self.packed[0][w]), int(self.packed[1][w]))
            if bool(self.mask[start + 1 : start + n].any()):
                return True
        return False

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_windows)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_windows, generator=g)

    def _window(self, w: int) -> dict[str, torch.Tensor]:
        size = self.seq_len + 1
        start, n = (w * size, size) if self.packed is None else (int(self.packed[0][w]), int(self.packed[1][w]))
        tokens = self.store[start : start + n].to(torch.int64)
        keep = None if self.mask is None else self.mask[start : start + n].to(torch.bool)
        if n < size:  # a packed window's padding: never a target
            tokens = torch.cat([tokens, tokens.new_full((size - n,), self.pad_id)])
            pad = torch.zeros(size - n, dtype=torch.bool)
            keep = torch.cat([torch.ones(n, dtype=torch.bool) if keep is None else keep, pad])
        labels = tokens[1:] if keep is None else tokens[1:].masked_fill(~keep[1:], IGNORE_INDEX)
        item = {"input_ids": tokens[:-1], "labels": labels}
        if self.eos_id is not None and self.packed is None:
            item["document_ids"] = document_ids(item["input_ids"], self.eos_id)
        elif self.eos_id is not None:
            item["document_ids"] = self._packed_document_ids(start, n)
        return item

    def _packed_document_ids(self, start: int, n: int) -> torch.Tensor:
        """Document ids of the packed window holding ``tokens[start : start + n]``: a new document at every
        document offset inside it, and at every padding position (each pad its own document)."""
        size = self.seq_len + 1
        offsets = self.doc_offsets
        inner = offsets[np.searchsorted(offsets, start, side="right") : np.searchsorted(offsets, start + n)] - start
        new_doc = torch.zeros(size, dtype=torch.int64)
        new_doc[torch.from_numpy(inner)] = 1
        new_doc[n:] = 1
        return new_doc.cumsum(0)[:-1]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if not self.infinite:  # a finite (validation) pass always covers the same windows, from the first
            self.epoch, self.pos, self.sample = 0, 0, 0
        order = self._order(self.epoch)
        while True:
            if self.pos + self.dp_world > self.num_windows:
                if not self.infinite:
                    return
                self.epoch, self.pos = self.epoch + 1, 0
                order = self._order(self.epoch)
                if worker == 0:
                    logger.info("%s data: starting epoch %d (%d windows)", self.name, self.epoch, self.num_windows)
            w = int(order[self.pos + self.dp_rank])
            mine = (self.sample // self.batch_size) % num_workers == worker
            self.pos += self.dp_world
            self.sample += 1
            if mine:
                yield self._window(w)

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("epoch", "pos", "sample", "dp_world", "num_windows", "seq_len", "seed")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "setup" in state:  # a MixtureWindows state
            names = ", ".join(map(str, (state.get("setup") or {}).get("names") or []))
            raise DataError(
                f"cannot resume {self.name} data: the checkpoint was saved with training.mixture (sources {names}) "
                f"and this run has none; {CHANGE_OF_KIND}"
            )
        for key in ("seq_len", "seed", "num_windows"):  # the cause before its consequence
            if state[key] != getattr(self, key):
                raise DataError(
                    f"cannot resume {self.name} data: checkpoint has {key}={state[key]}, this run has "
                    f"{getattr(self, key)} (the data or its windowing changed)"
                )
        if state["dp_world"] != self.dp_world:
            check_repartition(f"{self.name} data", state["dp_world"], self.dp_world, state["sample"], self.batch_size)
            msg = "%s data: re-partitioning from %d to %d data-parallel ranks at epoch %d, window %d"
            logger.info(msg, self.name, state["dp_world"], self.dp_world, state["epoch"], state["pos"])
        self.epoch, self.pos, self.sample = state["epoch"], state["pos"], state["sample"]
