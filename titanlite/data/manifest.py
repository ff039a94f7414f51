"""A prepared folder's ``manifest.json`` (written last by ``titanlite prepare``), and the checks of a shard and
of a tokenizer against it::

    {"format": "titanlite-shards", "version": 1, "dtype": "uint16",
     "tokenizer": {"path": ..., "name": ..., "vocab_size": ..., "bos_id": ..., "eos_id": ...,
                   "fingerprint": "sha256:..."},
     "shards": [{"name": "train-00000.bin", "split": "train", "tokens": ..., "docs": ...,
                 "max_id": ..., "checksum": "crc32:0123abcd"}, ...],
     "totals": {"train": {"shards": ..., "tokens": ..., "docs": ...}, "val": {...}},
     ...settings used to prepare it...}

Why each check sits where it does: :mod:`titanlite.data.shards`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from titanlite.data.shard_file import CHECKSUM_PREFIX, VERSION, PathLike, ShardReader, dtype_name
from titanlite.errors import DataError
from titanlite.tokenizer import Tokenizer, tokenizer_fingerprint
from titanlite.utils.fsio import atomic_write

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "titanlite-shards"
SPLITS = ("train", "val")
_ENTRY_KEYS = ("name", "split", "tokens", "docs")  # of each "shards" entry of the manifest
_CHECKSUM_RE = re.compile(re.escape(CHECKSUM_PREFIX) + "[0-9a-f]{8}")
TOKEN_DTYPES = ("uint16", "uint32")  # what a manifest's token "dtype" may be; uint8 is for mask shards only
CHAT_CONTENT = "chat"  # the manifest's "content" for chat data (token shards + loss-mask shards)


class ShardIntegrityError(DataError):
    """A shard whose bytes do not match its manifest (changed after preparation, or ids outside the
    vocabulary); raised while reading, so a launcher can tell it from other errors."""


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
        raise DataError(f"{folder}: shard folder not found")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(
            f"{path}: not found (prepare the folder with titanlite prepare; an interrupted run writes no manifest)"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise DataError(f"{path}: not a titanlite shard manifest (format != {MANIFEST_FORMAT!r})")
    if manifest.get("version") != VERSION:
        raise DataError(f"{path}: unsupported manifest version {manifest.get('version')!r}")
    for key in ("dtype", "tokenizer", "shards"):
        if key not in manifest:
            raise DataError(f"{path}: missing {key!r}")
    if manifest["dtype"] not in TOKEN_DTYPES:
        raise DataError(f"{path}: bad dtype {manifest['dtype']!r}")
    for i, sh in enumerate(manifest["shards"]):
        if not isinstance(sh, dict) or not set(_ENTRY_KEYS) <= set(sh):
            raise DataError(f"{path}: shard entry {i} needs name, split, tokens and docs")
        if "max_id" in sh and (not isinstance(sh["max_id"], int) or isinstance(sh["max_id"], bool)):
            raise DataError(f"{path}: shard entry {i} ({sh['name']}): max_id must be an integer, got {sh['max_id']!r}")
        if "checksum" in sh and not (isinstance(sh["checksum"], str) and _CHECKSUM_RE.fullmatch(sh["checksum"])):
            raise DataError(
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
            raise DataError(f"{path}: shard entry {i} ({sh['name']}): mask must be {{name, checksum}}, got {mask!r}")
        if manifest.get("content") == CHAT_CONTENT and mask is None:
            raise DataError(f"{path}: shard entry {i} ({sh['name']}): chat data needs a 'mask' entry")
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
    """Refuse shards made with another tokenizer, by fingerprint; an older manifest without one is matched by
    vocabulary size only, with a warning (another tokenizer of the same size would go unnoticed)."""
    recorded, ours = manifest["tokenizer"], tokenizer_info(tokenizer)
    fp = recorded.get("fingerprint")
    same = fp == ours["fingerprint"] if fp else int(recorded.get("vocab_size", -1)) == ours["vocab_size"]
    if not same:
        raise DataError(
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
        raise DataError(
            f"{reader.path}: header says {reader.num_tokens} tokens / {reader.num_docs} docs, "
            f"{manifest_path} says {entry['tokens']} / {entry['docs']}"
        )
    if reader.dtype.name != manifest["dtype"]:
        raise DataError(f"{reader.path}: dtype {reader.dtype.name} differs from {manifest_path} ({manifest['dtype']})")
    vocab = int(manifest["tokenizer"]["vocab_size"])
    if entry.get("max_id", -1) >= vocab:
        raise DataError(
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
