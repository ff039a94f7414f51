"""The embedded default corpus: the Python standard library's own source files.

Every Python installation carries them, so the debug model trains on a fresh machine with no
download and no file outside the repo. Files are read in sorted path order (deterministic for a
given Python install); every ``VAL_EVERY``-th document is held out for validation.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

from titanlite.data.encode import encode_documents
from titanlite.tokenizer import Tokenizer

VAL_EVERY = 20  # 5% of the documents are held out
DEFAULT_MAX_BYTES = 6_000_000  # enough for debug runs; reading and tokenizing takes ~1 s


def stdlib_source_files() -> list[Path]:
    return list(_stdlib_source_files())


@functools.cache
def _stdlib_source_files() -> tuple[Path, ...]:
    """The ``*.py`` files under the standard library, ``site-packages`` left out (not entered: ``Path.rglob``
    walking it cost ~1 s per call, and the train and validation splits each list the files)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, names in os.walk(root):  # as rglob: symlinked folders are not entered
        dirs[:] = [d for d in dirs if d != "site-packages"]
        found += [Path(folder, name) for name in names if name.endswith(".py")]
    files = [p for p in found if p.is_file()]
    return tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))


def iter_embedded_documents(split: str, max_bytes: int = DEFAULT_MAX_BYTES) -> Iterator[str]:
    """Yield the documents of ``split`` ("train" or "val") until ``max_bytes`` of the corpus are read."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    read = 0
    for i, path in enumerate(stdlib_source_files()):
        if read >= max_bytes:
            return
        text = path.read_text(encoding="utf-8", errors="replace")
        read += len(text)
        if text.strip() and (i % VAL_EVERY == 0) == (split == "val"):
            yield text


def embedded_token_stream(tokenizer: Tokenizer, split: str, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """All documents of the split as one int64 tensor, each document as BOS + tokens + EOS."""
    docs = list(iter_embedded_documents(split, max_bytes))
    if not docs:
        raise RuntimeError(f"no Python standard-library sources found for the embedded {split} split")
    return torch.from_numpy(encode_documents(tokenizer, docs)[0])
