"""From the ``[training]`` / ``[validation]`` data keys to datasets: one source or a weighted mixture
(docs/recipes.md).

A *source* is one corpus: ``embedded``, ``shards``, ``text`` or ``chat``; :func:`source_kind` settles ``"auto"``
from the path. Chat data is read with its loss mask and packed as whole conversations
(:class:`~titanlite.data.windows.TokenWindows` with ``doc_offsets``); other data is cut from the token stream.
Every function takes a section's values, not the whole job config, so a foreign loop can build the same datasets.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from titanlite.config.data_tables import mixture_source_name
from titanlite.data.chat import load_chat_data
from titanlite.data.loader import load_token_store
from titanlite.data.mixture import MixtureWindows
from titanlite.data.shards import MANIFEST, is_chat_folder
from titanlite.data.windows import TokenWindows
from titanlite.errors import DataError
from titanlite.utils.nesting import loads_json

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SourceData:
    """A loaded source: its token store, and for chat data its loss-mask store and document offsets."""

    name: str
    tokens: Any
    mask: Any = None
    doc_offsets: Any = None

    @property
    def chat(self) -> bool:
        return self.doc_offsets is not None


def source_kind(dataset: str, path: str) -> str:
    """``dataset``, or for ``"auto"`` the kind the path holds (see the module docstring)."""
    if dataset != "auto":
        return dataset
    p = Path(path)
    if p.is_dir():
        return "shards" if (p / MANIFEST).is_file() else "text"
    if p.suffix == ".jsonl" and p.is_file():
        with open(p, encoding="utf-8", errors="replace") as f:
            first = next((line for line in f if line.strip()), "")
        try:
            record = loads_json(first)
        except ValueError:
            return "text"  # the text reader names the bad line
        return "chat" if isinstance(record, dict) and "messages" in record else "text"
    return "text"


def load_source(name: str, dataset: str, path: str, split: str, tokenizer: Any) -> SourceData:
    """One source's stores for ``split`` (a shard folder's own split; any other kind's path is the split)."""
    kind = source_kind(dataset, path)
    if kind == "chat" and (Path(path) / MANIFEST).is_file():
        raise DataError(
            f"{path} is a shard folder (prepare_data), not raw chat JSONL: use dataset = 'shards' (a folder prepared "
            "with --format chat brings its loss masks) or 'auto'"
        )
    if kind == "chat" or kind == "shards" and is_chat_folder(path):
        tokens, mask, offsets = load_chat_data(kind, path, split, tokenizer)
        return SourceData(name, tokens, mask, offsets)
    return SourceData(name, load_token_store(kind, path, split, tokenizer))


def mixture_entries(section: Any) -> list[dict]:
    """The section's sources as mixture entries: ``mixture``, or its single ``dataset``/``dataset_path``."""
    if section.mixture:  # a path's leading ~ is the home folder, as for the section's other paths
        return [dict(e, name=mixture_source_name(e), **_home(e)) for e in section.mixture]
    return [{"name": "data", "dataset": section.dataset, "path": section.dataset_path, "weight": 1.0}]


def _home(entry: dict) -> dict:
    """``{"path": <the entry's path with ~ expanded>}``, or nothing when it has no path."""
    return {"path": os.path.expanduser(entry["path"])} if isinstance(entry.get("path"), str) else {}


def validation_entries(training: Any, validation: Any) -> tuple[list[dict], str, bool]:
    """``[validation]``'s sources as mixture entries, a line saying what they read, and whether that line is a
    warning. ``dataset`` left empty (the default) follows the training data: the built-in corpus' held-out part,
    or a shard folder's ``val`` split (chat shards included). Training data without a held-out split (raw text or
    chat files, a mixture) leaves the built-in corpus, with a warning: such a run would otherwise report a loss
    on Python source as its validation loss, silently."""
    if validation.mixture or validation.dataset:
        entries = mixture_entries(validation)
        what = ", ".join(" ".join(filter(None, (e.get("dataset", "auto"), e.get("path")))) for e in entries)
        return entries, f"validation reads {what} (as [validation] sets)", False
    if not training.mixture and training.dataset in ("embedded", "shards"):
        entry = {"name": "data", "dataset": training.dataset, "path": training.dataset_path, "weight": 1.0}
        where = "the built-in corpus" if training.dataset == "embedded" else f"shards {training.dataset_path}"
        return [entry], f"validation reads the held-out split of the training data ({where})", False
    what = "training.mixture" if training.mixture else f"training.dataset = {training.dataset!r}"
    line = (
        f"validation reads the built-in corpus (Python source): {what} has no held-out split to follow; set "
        "[validation] dataset and dataset_path (or mixture) to validate on your own data"
    )
    return [{"name": "data", "dataset": "embedded", "path": "", "weight": 1.0}], line, True


def source_windows(
    data: SourceData,
    seq_len: int,
    *,
    loss_mask: str = "none",
    eos_id: int | None = None,
    pad_id: int | None = None,
    seed: int = 0,
    **kwargs: Any,
) -> TokenWindows:
    """The windows of one source: whole conversations packed for chat data (masked to the assistant's
    tokens with ``loss_mask = "assistant"``), the cut token stream otherwise. ``eos_id``: document ids for
    block-causal attention (None: causal); ``pad_id``: the token that fills the rest of a packed window."""
    if data.chat:
        kwargs.update(mask=data.mask if loss_mask == "assistant" else None, doc_offsets=data.doc_offsets, pad_id=pad_id)
    return TokenWindows(data.tokens, seq_len, eos_id=eos_id, seed=seed, **kwargs)


def _with_loss_labels(windows: TokenWindows, what: str) -> TokenWindows:
    """``windows``, unless a loss mask leaves none of them a token to train on: a one-line error naming ``what``."""
    if not windows.has_loss_labels():
        raise DataError(
            f"{what} has no token to train on with training.loss_mask = 'assistant': no assistant token falls in a "
            f"window of seq_len + 1 = {windows.seq_len + 1} tokens (conversations without an assistant turn, empty "
            "assistant turns, or turns cut off by the truncation of long conversations)"
        )
    return windows


def training_dataset(
    sources: list[SourceData],
    weights: list[float],
    seq_len: int,
    *,
    loss_mask: str,
    eos_id: int | None,
    pad_id: int | None,
    seed: int,
    dp_rank: int,
    dp_world: int,
    batch_size: int,
    on_exhausted: str,
    mixture: bool,
) -> Any:
    """The training windows: one source's :class:`TokenWindows` (the same windows, order and state as
    before mixtures existed), or a :class:`MixtureWindows` over several (each source with its own seed). A
    source whose loss mask leaves no token to train on is refused (one line)."""
    ranks = dict(dp_rank=dp_rank, dp_world=dp_world, batch_size=batch_size)
    kw = dict(ranks, loss_mask=loss_mask, eos_id=eos_id, pad_id=pad_id)
    if not mixture:
        return _with_loss_labels(source_windows(sources[0], seq_len, seed=seed, name="train", **kw), "training data")
    windows = [
        _with_loss_labels(
            source_windows(s, seq_len, seed=seed * 1_000 + i + 1, name=f"train/{s.name}", **kw),
            f"training.mixture[{i}] (source '{s.name}')",
        )
        for i, s in enumerate(sources)
    ]
    return MixtureWindows(windows, weights, [s.name for s in sources], seed=seed, on_exhausted=on_exhausted, **ranks)


def load_sources(
    training: Any, validation: Any, split: str, tokenizer: Any, block_causal: bool = False
) -> list[tuple[SourceData, float]]:
    """``[training]`` (``split = "train"``) or ``[validation]`` data: each source and its weight, one unless the
    section sets ``mixture``. Shards are checked against the tokenizer here; what validation reads is logged
    (a warning when it cannot follow the training data)."""
    section = training if split == "train" else validation
    if split == "train":
        entries = mixture_entries(training)
    else:
        entries, what, warn = validation_entries(training, validation)
        (logger.warning if warn else logger.info)(what)
    out = []
    for i, entry in enumerate(entries):
        try:
            data = load_source(entry["name"], entry.get("dataset", "auto"), entry.get("path", ""), split, tokenizer)
        except (ValueError, FileNotFoundError) as e:
            if not section.mixture:
                raise
            key = f"{'training' if split == 'train' else 'validation'}.mixture[{i}]"
            raise type(e)(f"{key} (source '{entry['name']}'): {e}") from e
        out.append((data, float(entry["weight"])))
    if split == "train" and training.loss_mask == "assistant" and not any(d.chat for d, _ in out):
        raise DataError(
            "training.loss_mask = 'assistant' needs chat data, but no training source is chat data "
            "(dataset = 'chat' for JSONL conversations, or shards prepared with --format chat)"
        )
    if any(data.chat for data, _ in out) and (tokenizer.eos_id if block_causal else None) is None:
        logger.warning(
            "chat data packs several conversations per window; with [model] attn_mask_type = 'causal' they "
            "attend to one another: set attn_mask_type = 'block_causal' to keep them apart"
        )
    return out
