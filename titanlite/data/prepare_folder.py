"""``titanlite prepare``'s output folder: shard names, the journal of written shards, the settings state, the
resume step and the writers that add each split's shards.

Shards are written to ``.tmp`` and renamed, and appended to ``prepare_journal.jsonl`` (with largest id and
checksum) just before the rename, so every shard file this tool wrote is listed there or in the manifest. A re-run
with the same settings (``prepare_state.json``) keeps each split's leading journaled shards and skips their
documents; ``manifest.json`` is written last. Changed settings or inputs need ``--overwrite``, which deletes only
files the manifest or journal lists; an unlisted file named like a shard is never touched (the run is refused).
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

import numpy as np

from titanlite.data.manifest import MANIFEST, SPLITS, read_manifest, write_json_atomic
from titanlite.data.shard_file import ShardReader, write_shard_flat
from titanlite.errors import DataError
from titanlite.utils.fsio import append_line

STATE = "prepare_state.json"
JOURNAL = "prepare_journal.jsonl"  # one line per shard written, appended before its rename
_SHARD_NAME = re.compile(rf"({'|'.join(SPLITS)})-[0-9]+\.bin")


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


def mask_name(shard: str) -> str:
    """The loss-mask shard of token shard ``shard`` (chat data): ``train-00000.bin`` -> ``train-00000.mask.bin``."""
    return shard.removesuffix(".bin") + ".mask.bin"


class SplitWriter:
    """Accumulates one split's documents and writes a shard whenever it reaches ``shard_tokens``."""

    def __init__(self, out: Path, split: str, dtype: str, shard_tokens: int, kept: list[dict], chat: bool = False):
        self.out, self.split, self.dtype, self.shard_tokens = out, split, dtype, shard_tokens
        self.entries = list(kept)  # shards kept from an earlier run, then the ones written now
        self.parts, self.lengths, self.tokens = [], [], 0  # arrays, their sizes, their sum
        self.chat, self.masks = chat, []  # chat data: each document's loss mask (uint8), written as a mask shard

    def add(self, tokens: np.ndarray, mask: np.ndarray | None = None) -> None:
        self.parts.append(tokens)
        if self.chat:
            self.masks.append(mask)
        self.lengths.append(tokens.size)
        self.tokens += tokens.size
        if self.tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if self.lengths:
            path = self.out / shard_name(self.split, len(self.entries))
            extra = {"split": self.split}
            if self.chat:  # the mask shard first: a token shard with its final name always has its mask on disk
                mask = write_shard_flat(self.out / mask_name(path.name), np.concatenate(self.masks), self.lengths, "u1")
                extra["mask"] = {"name": mask["name"], "checksum": mask["checksum"]}
            record = lambda info: append_line(self.out / JOURNAL, json.dumps({**info, **extra}))  # noqa: E731
            info = write_shard_flat(path, np.concatenate(self.parts), self.lengths, self.dtype, before_rename=record)
            self.entries.append({**info, **extra})
            self.parts, self.lengths, self.tokens, self.masks = [], [], 0, []


def _read_journal(out: Path) -> dict[str, dict]:
    """Shard name -> its latest journal entry (lines torn by a crash are skipped)."""
    try:
        lines = (out / JOURNAL).read_bytes().splitlines()
    except FileNotFoundError:
        return {}
    entries = {}
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("name"), str):
            entries[entry["name"]] = entry
    return entries


def _known_shards(out: Path) -> dict[str, dict]:
    """The shards this tool wrote in ``out``: name -> entry, from the manifest and then the journal. Every entry
    must name a shard of this folder (``<split>-NNNNN.bin``, its mask ``<split>-NNNNN.mask.bin``): a listing is
    what ``--overwrite`` deletes, so one naming any other path is refused (one line naming the entry)."""
    known = {}
    if (out / MANIFEST).exists():
        try:
            known = {e["name"]: e for e in read_manifest(out)["shards"]}
        except ValueError as e:
            raise DataError(f"{e}; it is needed to tell which files in {out} prepare_data wrote") from None
    journal = _read_journal(out)
    for listing, entries in ((MANIFEST, known), (JOURNAL, journal)):
        for name, entry in entries.items():
            mask = entry["mask"].get("name") if isinstance(entry.get("mask"), dict) else None
            if not _SHARD_NAME.fullmatch(name):
                bad, want = name, "<split>-NNNNN.bin"
            elif mask not in (None, mask_name(name)):
                bad, want = mask, mask_name(name)
            else:
                continue
            raise DataError(
                f"{out / listing}: entry {bad!r} is not a shard file of this folder ({want}); prepare_data "
                f"deletes and rewrites only its own shard files: remove that entry, or choose another --output"
            )
    return {**known, **journal}


def _refuse_strays(out: Path, known: dict[str, dict]) -> None:
    """A file named like a shard that this tool did not write would be overwritten or mixed in: refuse."""
    strays = sorted(p.name for p in out.iterdir() if _SHARD_NAME.fullmatch(p.name) and p.name not in known)
    if strays:
        more = f" (and {len(strays) - 1} more)" if len(strays) > 1 else ""
        raise DataError(
            f"{out / strays[0]}{more}: named like a shard but listed in neither {MANIFEST} nor {JOURNAL}, so "
            f"prepare_data did not write it; move it out of {out} or choose another --output"
        )


def _existing_prefix(out: Path, split: str, known: dict[str, dict]) -> list[dict]:
    """The complete shards ``<split>-00000.bin, -00001, ...`` already in ``out`` whose header matches
    their journal entry (stops at the first that does not: it and the later ones are rewritten)."""
    kept = []
    while True:
        name = shard_name(split, len(kept))
        entry = known.get(name)
        if entry is None or not {"max_id", "checksum"} <= set(entry) or not (out / name).is_file():
            return kept
        try:
            r = ShardReader(out / name)
            m = ShardReader(out / entry["mask"]["name"]) if "mask" in entry else None  # chat data's loss mask
        except ValueError:
            return kept  # unreadable: it will be rewritten
        if (r.num_tokens, r.num_docs) != (entry.get("tokens"), entry.get("docs")):
            return kept
        if m is not None and (m.num_tokens, m.num_docs, m.dtype.itemsize) != (r.num_tokens, r.num_docs, 1):
            return kept
        kept.append({**entry, "split": split})


def _our_files(out: Path, known: dict[str, dict]) -> list[Path]:
    """The files of ``out`` that --overwrite deletes: the listed shards (and masks), their .tmp, our own records
    (names :func:`_known_shards` checked). Each must be a plain file: a link or a folder of that name is refused."""
    listed = [*known, *(e["mask"]["name"] for e in known.values() if isinstance(e.get("mask"), dict))]
    names = [*listed, *(n + ".tmp" for n in listed)]
    names += [n + t for n in (MANIFEST, STATE, JOURNAL) for t in ("", ".tmp")]
    found = []
    for path in sorted(out / n for n in names if os.path.lexists(out / n)):
        if not stat.S_ISREG(path.lstat().st_mode):
            kind = "a symbolic link" if path.is_symlink() else "not a plain file"
            raise DataError(
                f"{path} is {kind}, where prepare_data keeps one of its own files; it never deletes or writes "
                "through it: move it out of the folder, or choose another --output"
            )
        found.append(path)
    return found


def _why_not_resumable(state: dict, old_state: dict | None) -> str:
    if old_state is None:
        return f"holds shard files but no readable {STATE}"
    if "fingerprint" not in old_state.get("tokenizer", {}):
        return "was prepared by an older titanlite (no tokenizer fingerprint or shard checksums recorded)"
    diff = sorted(k for k in set(state) | set(old_state) if state.get(k) != old_state.get(k))
    return f"was prepared with different {', '.join(diff)} (see {STATE})"


def resume(out: Path, state: dict, overwrite: bool, say: Callable[[str], None]) -> dict[str, list[dict]]:
    """The resume step: refuse a folder that cannot be resumed (or, with ``overwrite``, delete what prepare_data
    wrote there), record ``state``, and return each split's leading shards that are kept."""
    known = _known_shards(out)
    _refuse_strays(out, known)  # before anything is deleted or written
    old_files = _our_files(out, known)
    try:
        old_state = json.loads((out / STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        old_state = None
    old_state = old_state if isinstance(old_state, dict) else None
    if old_files and old_state != state:
        if not overwrite:
            why = _why_not_resumable(state, old_state)
            raise DataError(f"{out}: {why}; use --overwrite to start over or choose another --output")
        say(f"--overwrite: deleting the {len(old_files)} files prepare_data wrote in {out}")
        for p in old_files:
            p.unlink()
        known = {}
    write_json_atomic(out / STATE, state)
    kept = {s: _existing_prefix(out, s, known) for s in SPLITS}
    if n_kept := sum(len(v) for v in kept.values()):
        say(
            f"resuming: keeping {n_kept} finished shards "
            f"({', '.join(f'{s} {len(kept[s])}' for s in SPLITS)}); skipping their documents"
        )
    return kept
