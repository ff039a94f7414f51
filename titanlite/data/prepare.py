"""Tokenize raw text into binary token shards for ``[training] dataset = "shards"``.

    python scripts/prepare_data.py --input data/ more.jsonl --tokenizer tokenizer.model \\
        --output shards/ --val-fraction 0.01 --workers 8 --shard-tokens 100000000

Inputs are files or folders (see ``titanlite.data.sources``: .txt/.md/.jsonl/.json/.parquet).
Every document becomes ``BOS + tokens + EOS``. The split is decided per document from a hash of
its text (``blake2b(text) / 2**64 < val_fraction`` -> val), so it depends neither on the worker
count nor on the order of files, and identical documents always land in the same split. Each
split's documents are cut, in input order, into shards ``<split>-NNNNN.bin``: a shard is closed
as soon as it holds >= ``--shard-tokens`` tokens (documents are never split across shards), so
the shard numbering is a function of the inputs and settings only.

Restarts: shards are written to ``.tmp`` and renamed, so an existing ``<split>-NNNNN.bin`` is
complete. A re-run with the same settings (recorded in ``prepare_state.json``) keeps the existing
leading shards of each split, skips their documents without tokenizing them, and overwrites any
leftover ``.tmp``. ``manifest.json`` is written last; a folder without it is unfinished. Changed
settings or inputs are refused unless ``--overwrite`` is given (which deletes the old shards).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import numpy as np

from titanlite.data.encode import ParallelEncoder
from titanlite.data.shards import (
    MANIFEST,
    SPLITS,
    ShardReader,
    build_manifest,
    dtype_for_vocab,
    write_json_atomic,
    write_shard_flat,
)
from titanlite.data.sources import FORMATS, TXT_SPLITS, iter_file_documents, list_files
from titanlite.tokenizer import build_tokenizer

STATE = "prepare_state.json"
DEFAULT_SHARD_TOKENS = 100_000_000
CHUNK_CHARS = 1 << 18  # characters of text per task sent to a worker
CHUNK_DOCS = 4096


def split_of(text: str, val_fraction: float) -> str:
    """The split of a document: "val" for a deterministic ``val_fraction`` of them (by a hash of the text)."""
    if val_fraction <= 0.0:
        return "train"
    if val_fraction >= 1.0:
        return "val"
    h = int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")
    return "val" if h < val_fraction * 18446744073709551616.0 else "train"


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


def _fmt_time(seconds: float) -> str:
    h, rem = divmod(int(max(0, seconds)), 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class _SplitWriter:
    """Accumulates one split's documents and writes a shard whenever it reaches ``shard_tokens``."""

    def __init__(self, out: Path, split: str, dtype: str, shard_tokens: int, kept: list[dict]):
        self.out, self.split, self.dtype, self.shard_tokens = out, split, dtype, shard_tokens
        self.entries = list(kept)  # shards kept from an earlier run, then the ones written now
        self.parts, self.lengths, self.tokens = [], [], 0  # arrays, their sizes, their sum

    def add(self, tokens: np.ndarray) -> None:
        self.parts.append(tokens)
        self.lengths.append(tokens.size)
        self.tokens += tokens.size
        if self.tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if self.lengths:
            path = self.out / shard_name(self.split, len(self.entries))
            info = write_shard_flat(path, np.concatenate(self.parts), self.lengths, self.dtype)
            self.entries.append({**info, "split": self.split})
            self.parts, self.lengths, self.tokens = [], [], 0


def _existing_prefix(out: Path, split: str) -> list[dict]:
    """The complete shards ``<split>-00000.bin, -00001, ...`` already in ``out`` (stops at a gap)."""
    kept = []
    while True:
        path = out / shard_name(split, len(kept))
        if not path.is_file():
            return kept
        try:
            r = ShardReader(path)
        except ValueError:
            return kept  # unreadable: it will be rewritten
        kept.append({"name": path.name, "split": split, "tokens": r.num_tokens, "docs": r.num_docs})


def _our_files(out: Path) -> list[Path]:
    shards = [p for p in out.iterdir() if p.name.partition("-")[0] in SPLITS and p.name.endswith((".bin", ".bin.tmp"))]
    others = [out / n for n in (MANIFEST, STATE, MANIFEST + ".tmp", STATE + ".tmp") if (out / n).exists()]
    return sorted(shards + others)


def prepare(
    inputs: str | os.PathLike | Sequence[str | os.PathLike],
    output: str | os.PathLike,
    tokenizer: str = "",
    *,
    val_fraction: float = 0.0,
    workers: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    text_field: str = "text",
    file_format: str = "auto",
    txt_split: str = "file",
    overwrite: bool = False,
    log: TextIO | None = sys.stderr,
    progress_interval: float = 2.0,
) -> dict:
    """Tokenize ``inputs`` into shards under ``output``; returns the manifest (also written to disk).

    Raises one-line ``ValueError`` (bad input/settings) or ``ImportError`` (missing optional package).
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    for bad, msg in (
        (not inputs, "no --input given"),
        (not 0.0 <= val_fraction <= 1.0, f"--val-fraction must be in [0, 1], got {val_fraction}"),
        (workers < 1, f"--workers must be >= 1, got {workers}"),
        (shard_tokens < 1, f"--shard-tokens must be >= 1, got {shard_tokens}"),
        (file_format not in FORMATS, f"unknown file format {file_format!r} (choose from {', '.join(FORMATS)})"),
        (txt_split not in TXT_SPLITS, f"unknown --txt-split {txt_split!r} (choose from {', '.join(TXT_SPLITS)})"),
    ):
        if bad:
            raise ValueError(msg)

    def say(msg: str) -> None:
        if log is not None:
            print(f"prepare_data: {msg}", file=log, flush=True)

    files = list_files(inputs)
    if not files:
        raise ValueError(f"no input files (.txt/.md/.jsonl/.json/.parquet) found in {', '.join(map(str, inputs))}")
    tok_path = "" if tokenizer in ("", "bytes") else str(Path(tokenizer).resolve())
    tok = build_tokenizer(tok_path)
    dtype = dtype_for_vocab(tok.vocab_size)
    tok_info = dict(path=tok_path, name=tok.name, vocab_size=tok.vocab_size, bos_id=tok.bos_id, eos_id=tok.eos_id)

    out = Path(output)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: output exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)

    sizes = [f.stat().st_size for f in files]
    settings = {
        "inputs": [str(f.resolve()) for f in files],
        "shard_tokens": int(shard_tokens),
        "val_fraction": float(val_fraction),
        "text_field": text_field,
        "file_format": file_format,
        "txt_split": txt_split,
    }
    stats = [{"path": str(f.resolve()), "bytes": s, "mtime_ns": f.stat().st_mtime_ns} for f, s in zip(files, sizes)]
    state = {"settings": settings, "tokenizer": tok_info, "dtype": dtype, "input_files": stats}
    old_files = _our_files(out)
    try:
        old_state = json.loads((out / STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        old_state = None
    if old_files and old_state != state:
        if not overwrite:
            if old_state is None:
                why = f"holds shard files but no readable {STATE}"
            else:
                diff = sorted(k for k in set(state) | set(old_state) if state.get(k) != old_state.get(k))
                why = f"was prepared with different {', '.join(diff)} (see {STATE})"
            raise ValueError(f"{out}: {why}; use --overwrite to start over or choose another --output")
        say(f"--overwrite: deleting {len(old_files)} old files in {out}")
        for p in old_files:
            p.unlink()
    write_json_atomic(out / STATE, state)

    kept = {s: _existing_prefix(out, s) for s in SPLITS}
    skip = {s: sum(e["docs"] for e in kept[s]) for s in SPLITS}
    n_kept = sum(len(v) for v in kept.values())
    if n_kept:
        say(
            f"resuming: keeping {n_kept} finished shards "
            f"({', '.join(f'{s} {len(kept[s])}' for s in SPLITS)}); skipping their documents"
        )
    writers = {s: _SplitWriter(out, s, dtype, shard_tokens, kept[s]) for s in SPLITS}

    total_bytes = sum(sizes)
    t0 = last = time.monotonic()
    n_docs = n_skipped = n_tokens = 0
    bytes_read = 0  # input bytes read so far
    bytes_done = 0  # input bytes whose documents are tokenized (or skipped)

    def report(final: bool = False) -> None:
        el = max(time.monotonic() - t0, 1e-9)
        done = bytes_done if pending else bytes_read
        frac = done / total_bytes if total_bytes else 1.0
        eta = "" if final or frac <= 0 else f", ETA {_fmt_time(el * (1 - frac) / frac)}"
        skipped = f" (+{n_skipped:,} skipped)" if n_skipped else ""
        say(
            f"{n_docs:,} docs{skipped}, {n_tokens:,} tokens, {n_tokens / el:,.0f} tokens/s, "
            f"{100 * frac:.1f}% of {total_bytes / 1e6:,.1f} MB{eta}" + (f", done in {_fmt_time(el)}" if final else "")
        )

    pending: collections.deque = collections.deque()
    max_pending = 2 * workers + 1

    def consume_one() -> None:
        nonlocal n_docs, n_tokens, bytes_done
        splits, result, bytes_done = pending.popleft()
        flat, lengths = result.result()
        for split, doc in zip(splits, np.split(flat, np.cumsum(lengths)[:-1])):
            writers[split].add(doc)
        n_docs += len(splits)
        n_tokens += int(flat.size)

    with ParallelEncoder(tok, np.dtype(dtype), workers) as encoder:
        chunk: list[tuple[str, str]] = []  # (split, text) of the documents of the next task
        chunk_chars = 0

        def submit() -> None:
            nonlocal chunk, chunk_chars
            if chunk:
                splits, texts = zip(*chunk)
                pending.append((splits, encoder.submit(list(texts)), bytes_read))
                chunk, chunk_chars = [], 0
            while len(pending) > max_pending:
                consume_one()

        done_before = 0
        for f, size in zip(files, sizes):
            for text, pos in iter_file_documents(f, text_field, file_format, txt_split):
                bytes_read = done_before + min(pos, size)
                split = split_of(text, val_fraction)
                if skip[split] > 0:
                    skip[split] -= 1
                    n_skipped += 1
                else:
                    chunk.append((split, text))
                    chunk_chars += len(text)
                    if chunk_chars >= CHUNK_CHARS or len(chunk) >= CHUNK_DOCS:
                        submit()
                now = time.monotonic()
                if progress_interval >= 0 and now - last >= progress_interval:
                    last = now
                    report()
            done_before += size
            bytes_read = done_before
        submit()
        while pending:
            consume_one()
    if any(skip.values()):
        raise ValueError(
            f"{out}: existing shards hold more documents than the inputs "
            f"({', '.join(f'{s}: {n} extra' for s, n in skip.items() if n)}); use --overwrite"
        )
    for w in writers.values():
        w.flush()

    shards = [e for w in writers.values() for e in w.entries]
    manifest = build_manifest(shards, dtype, tok_info, **settings)
    write_json_atomic(out / MANIFEST, manifest)
    report(final=True)
    t = manifest["totals"]
    per_split = (f"{s} {t[s]['docs']:,} docs / {t[s]['tokens']:,} tokens in {t[s]['shards']} shards, " for s in SPLITS)
    say(f"wrote {len(shards) - n_kept} shards (kept {n_kept}): {''.join(per_split)}dtype {dtype} -> {out / MANIFEST}")
    if val_fraction > 0 and t["val"]["docs"] == 0:
        say(
            f"warning: the val split is empty ({t['train']['docs']} documents in all); "
            f"a plain-text file is one document: try --txt-split paragraphs or more documents"
        )
    if t["train"]["docs"] == 0:
        say("warning: the train split is empty")
    return manifest


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add = p.add_argument
    add(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help="Text/JSONL/JSON/Parquet files or folders (read recursively, sorted).",
    )
    add(
        "--tokenizer",
        default="",
        help='tiktoken BPE file (e.g. Llama 3 tokenizer.model); "" or "bytes" = built-in byte tokenizer.',
    )
    add("--output", required=True, metavar="DIR", help="Output folder for shards and manifest.json.")
    add("--val-fraction", type=float, default=0.0, help="Fraction of documents held out as 'val'.")
    add("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)), help="Tokenizer worker processes.")
    add("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="Close a shard once it holds this many tokens.")
    add("--text-field", default="text", help="JSON/Parquet field holding the document text.")
    add("--format", dest="file_format", default="auto", choices=FORMATS, help="Input format (auto = by file suffix).")
    add(
        "--txt-split",
        default="file",
        choices=TXT_SPLITS,
        help="Plain-text files: one document per file, or per blank-line separated paragraph.",
    )
    add("--overwrite", action="store_true", help="Delete shards prepared with other settings instead of refusing.")
    add("--quiet", action="store_true", help="No progress lines.")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    kwargs = vars(build_parser().parse_args(argv))  # the option names are prepare()'s keyword arguments
    log = None if kwargs.pop("quiet") else sys.stderr
    try:
        prepare(kwargs.pop("input"), kwargs.pop("output"), kwargs.pop("tokenizer"), log=log, **kwargs)
    except (ValueError, ImportError, OSError) as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"prepare_data: error: {msg}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "prepare_data: interrupted; finished shards are kept, re-run the same command to continue", file=sys.stderr
        )
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
