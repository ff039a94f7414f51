"""Tokenize raw text into binary token shards for ``[training] dataset = "shards"``.

Every document (a file of :mod:`titanlite.data.sources`) becomes ``BOS + tokens + EOS``. Its split comes from a
hash of its text (``blake2b(text) / 2**64 < val_fraction``), so it depends on neither the worker count nor the
file order, and identical documents land in the same split. Each split's documents are cut, in input order, into
shards ``<split>-NNNNN.bin`` closed once they hold ``--shard-tokens`` tokens (documents never split), so the
numbering is a function of the inputs and settings only. Restarts and ``--overwrite``:
:mod:`titanlite.data.prepare_folder`.

``--format chat``: each JSONL conversation (:mod:`titanlite.data.chat`) is one document, its chat rendering + EOS
(split by a hash of its JSON); each token shard gets a loss-mask shard, written first and recorded with its
checksum in the token shard's journal and manifest entry (``"content": "chat"``). ``--verify FOLDER`` checks every
shard of a prepared folder against its manifest, e.g. after a copy.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TextIO

import numpy as np

from titanlite.data.chat import iter_conversations, render_conversation
from titanlite.data.encode import ParallelEncoder
from titanlite.data.manifest import (
    CHAT_CONTENT,
    MANIFEST,
    SPLITS,
    build_manifest,
    describe_tokenizer,
    mask_entry,
    open_shard,
    read_manifest,
    tokenizer_info,
    verify_shard_bytes,
    write_json_atomic,
)
from titanlite.data.prepare_folder import SplitWriter, resume
from titanlite.data.shard_file import dtype_for_vocab
from titanlite.data.sources import FORMATS, TXT_SPLITS, iter_file_documents, list_files
from titanlite.errors import DataError, UsageError, UserError, one_line
from titanlite.tokenizer import build_tokenizer

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


def _fmt_time(seconds: float) -> str:
    h, rem = divmod(int(max(0, seconds)), 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _sayer(log: TextIO | None) -> Callable[[str], None]:
    def say(msg: str) -> None:
        if log is not None:
            print(f"prepare_data: {msg}", file=log, flush=True)

    return say


def _check_settings(inputs: list, val_fraction: float, workers: int, shard_tokens: int, fmt: str, txt: str) -> None:
    for bad, msg in (
        (not inputs, "no --input given"),
        (not 0.0 <= val_fraction <= 1.0, f"--val-fraction must be in [0, 1], got {val_fraction}"),
        (workers < 1, f"--workers must be >= 1, got {workers}"),
        (shard_tokens < 1, f"--shard-tokens must be >= 1, got {shard_tokens}"),
        (fmt not in (*FORMATS, "chat"), f"unknown file format {fmt!r} (choose from {', '.join(FORMATS)}, chat)"),
        (txt not in TXT_SPLITS, f"unknown --txt-split {txt!r} (choose from {', '.join(TXT_SPLITS)})"),
    ):
        if bad:
            raise DataError(msg)


def _check_output_outside_inputs(inputs: list[Path], output: Path) -> None:
    """An ``output`` equal to or inside an input folder would be read back as input on a re-run (its manifest,
    journal and state files are .json/.jsonl): refuse before anything is read or written."""
    out = output.resolve()
    for given in inputs:
        folder = given.resolve()
        if folder.is_dir() and out.is_relative_to(folder):
            where = "is" if out == folder else "is inside"
            raise UsageError(
                f"--output {output} {where} --input {given}: the prepared files would be read as input on a "
                "re-run; choose an --output outside the input folders"
            )


class _Progress:
    """The encoding step's counts and its progress lines (every ``interval`` seconds; never when negative)."""

    def __init__(self, total_bytes: int, say: Callable[[str], None], interval: float):
        self.total_bytes, self.say, self.interval = total_bytes, say, interval
        self.t0 = self.last = time.monotonic()
        self.docs = self.skipped = self.tokens = 0
        self.bytes_read = 0  # input bytes read so far
        self.bytes_done = 0  # input bytes whose documents are tokenized (or skipped)

    def tick(self, pending: bool) -> None:
        now = time.monotonic()
        if self.interval >= 0 and now - self.last >= self.interval:
            self.last = now
            self.report(pending)

    def report(self, pending: bool = False, final: bool = False) -> None:
        el = max(time.monotonic() - self.t0, 1e-9)
        done = self.bytes_done if pending else self.bytes_read
        frac = done / self.total_bytes if self.total_bytes else 1.0
        eta = "" if final or frac <= 0 else f", ETA {_fmt_time(el * (1 - frac) / frac)}"
        skipped = f" (+{self.skipped:,} skipped)" if self.skipped else ""
        self.say(
            f"{self.docs:,} docs{skipped}, {self.tokens:,} tokens, {self.tokens / el:,.0f} tokens/s, "
            f"{100 * frac:.1f}% of {self.total_bytes / 1e6:,.1f} MB{eta}"
            + (f", done in {_fmt_time(el)}" if final else "")
        )


class _Tasks:
    """Documents batched into tasks for the encoder's worker processes (``CHUNK_CHARS``/``CHUNK_DOCS`` each, at
    most ``max_pending`` in flight); finished tasks go, in input order, to their splits' writers."""

    def __init__(self, encoder: ParallelEncoder, writers: dict, progress: _Progress, max_pending: int):
        self.encoder, self.writers, self.progress, self.max_pending = encoder, writers, progress, max_pending
        self.pending: collections.deque = collections.deque()
        self.chunk: list[tuple[str, str]] = []  # (split, text) of the documents of the next task
        self.chunk_chars = 0

    def add(self, split: str, text: str) -> None:
        self.chunk.append((split, text))
        self.chunk_chars += len(text)
        if self.chunk_chars >= CHUNK_CHARS or len(self.chunk) >= CHUNK_DOCS:
            self.submit()

    def submit(self) -> None:
        if self.chunk:
            splits, texts = zip(*self.chunk)
            self.pending.append((splits, self.encoder.submit(list(texts)), self.progress.bytes_read))
            self.chunk, self.chunk_chars = [], 0
        while len(self.pending) > self.max_pending:
            self.consume_one()

    def consume_one(self) -> None:
        splits, result, self.progress.bytes_done = self.pending.popleft()
        flat, lengths = result.result()
        for split, doc in zip(splits, np.split(flat, np.cumsum(lengths)[:-1])):
            self.writers[split].add(doc)
        self.progress.docs += len(splits)
        self.progress.tokens += int(flat.size)

    def finish(self) -> None:
        self.submit()
        while self.pending:
            self.consume_one()


def _add_texts(files: list[Path], sizes: list[int], tasks: _Tasks, skip: dict, val_fraction: float, *read) -> None:
    """The encoding step for text: every document of ``files`` to its split (by hash), skipping the first
    ``skip[split]`` of each split (kept shards hold them); ``read``: iter_file_documents' reading options."""
    progress, done_before = tasks.progress, 0
    for f, size in zip(files, sizes):
        for text, pos in iter_file_documents(f, *read):
            progress.bytes_read = done_before + min(pos, size)
            split = split_of(text, val_fraction)
            if skip[split] > 0:
                skip[split] -= 1
                progress.skipped += 1
            else:
                tasks.add(split, text)
            progress.tick(bool(tasks.pending))
        done_before += size
        progress.bytes_read = done_before
    tasks.finish()


def _summarize(out: Path, manifest: dict, n_kept: int, val_fraction: float, say: Callable[[str], None]) -> None:
    t, written = manifest["totals"], len(manifest["shards"]) - n_kept
    per_split = (f"{s} {t[s]['docs']:,} docs / {t[s]['tokens']:,} tokens in {t[s]['shards']} shards, " for s in SPLITS)
    say(f"wrote {written} shards (kept {n_kept}): {''.join(per_split)}dtype {manifest['dtype']} -> {out / MANIFEST}")
    if val_fraction > 0 and t["val"]["docs"] == 0:
        say(
            f"warning: the val split is empty ({t['train']['docs']} documents in all); "
            f"a plain-text file is one document: try --txt-split paragraphs or more documents"
        )
    if t["train"]["docs"] == 0:
        say("warning: the train split is empty")


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
    """Tokenize ``inputs`` into shards under ``output``; returns the manifest (also written to disk). Resumes
    what an earlier run left (:func:`~titanlite.data.prepare_folder.resume`), encodes into one
    :class:`~titanlite.data.prepare_folder.SplitWriter` per split, then writes the manifest."""
    inputs = [inputs] if isinstance(inputs, (str, os.PathLike)) else inputs
    _check_settings(inputs, val_fraction, workers, shard_tokens, file_format, txt_split)
    say = _sayer(log)
    inputs = [Path(p).expanduser() for p in inputs]  # a leading ~ is the home folder (also in --input=~/x)
    _check_output_outside_inputs(inputs, Path(output).expanduser())
    files = list_files(inputs)
    if not files:
        raise DataError(f"no input files (.txt/.md/.jsonl/.json/.parquet) found in {', '.join(map(str, inputs))}")
    tok_path = "" if tokenizer in ("", "bytes") else str(Path(tokenizer).expanduser().resolve())
    tok = build_tokenizer(tok_path)
    dtype = dtype_for_vocab(tok.vocab_size)
    tok_info = tokenizer_info(tok)

    out = Path(output).expanduser()
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: output exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only or foreign folder on the way: the user's --output
        raise UsageError(f"--output {out}: cannot create it ({e.strerror or e})") from None

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
    kept = resume(
        out, {"settings": settings, "tokenizer": tok_info, "dtype": dtype, "input_files": stats}, overwrite, say
    )
    skip = {s: sum(e["docs"] for e in kept[s]) for s in SPLITS}
    chat = file_format == "chat"
    writers = {s: SplitWriter(out, s, dtype, shard_tokens, kept[s], chat) for s in SPLITS}

    progress = _Progress(sum(sizes), say, progress_interval)
    if chat:  # rendering is cheap next to BPE on long text: one process
        _add_conversations(files, tok, val_fraction, skip, writers, progress)
    with ParallelEncoder(tok, np.dtype(dtype), 1 if chat else workers) as encoder:
        tasks = _Tasks(encoder, writers, progress, max_pending=2 * workers + 1)
        _add_texts([] if chat else files, sizes, tasks, skip, val_fraction, text_field, file_format, txt_split)
    if any(skip.values()):
        raise DataError(
            f"{out}: existing shards hold more documents than the inputs "
            f"({', '.join(f'{s}: {n} extra' for s, n in skip.items() if n)}); use --overwrite"
        )
    for w in writers.values():
        w.flush()

    shards = [e for w in writers.values() for e in w.entries]
    manifest = build_manifest(shards, dtype, tok_info, **settings, **({"content": CHAT_CONTENT} if chat else {}))
    write_json_atomic(out / MANIFEST, manifest)
    progress.report(final=True)
    _summarize(out, manifest, sum(len(v) for v in kept.values()), val_fraction, say)
    return manifest


def _add_conversations(files: list, tok, val_fraction: float, skip: dict, writers: dict, progress: _Progress) -> None:
    """The encoding step for chat data: every conversation of ``files`` rendered (rendering + EOS, its mask + 0)
    into its split's writer, skipping the first ``skip[split]`` of each split (kept shards hold them)."""
    for f in files:
        for where, messages in iter_conversations(f):
            split = split_of(json.dumps(messages, sort_keys=True, ensure_ascii=False), val_fraction)
            if skip[split] > 0:
                skip[split] -= 1
                progress.skipped += 1
                continue
            ids, mask = render_conversation(tok, messages, where=where)
            writers[split].add(np.asarray(ids + [tok.eos_id], dtype=np.int64), np.asarray(mask + [0], dtype=np.uint8))
            progress.docs, progress.tokens = progress.docs + 1, progress.tokens + len(ids) + 1
    progress.bytes_read = progress.total_bytes


def verify(
    folder: str | os.PathLike, workers: int = 1, log: TextIO | None = sys.stderr, progress_interval: float = 2.0
) -> list[str]:
    """The checks the loader does lazily (:mod:`titanlite.data.shards`), on every shard at once (``workers`` files
    at a time): one line per bad shard; an unusable manifest is a ValueError."""
    folder = Path(folder).expanduser()
    manifest, mpath = read_manifest(folder), folder / MANIFEST
    vocab, entries = int(manifest["tokenizer"]["vocab_size"]), manifest["shards"]

    def check(entry: dict) -> tuple[int, str]:
        try:
            reader = open_shard(mpath, manifest, entry)
            verify_shard_bytes(reader, entry, vocab, mpath)
            if "mask" in entry:  # chat data: the loss-mask shard, the same checks
                mask = open_shard(mpath, {**manifest, "dtype": "uint8"}, mask_entry(entry))
                verify_shard_bytes(mask, mask_entry(entry), vocab, mpath)
        except ValueError as e:
            return 0, str(e)
        return reader.tokens.nbytes, ""

    say = _sayer(log)
    errors, nbytes, t0 = [], 0, time.monotonic()
    last = t0
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for done, (n, error) in enumerate(pool.map(check, entries), start=1):
            nbytes += n
            errors += [error] if error else []
            if progress_interval >= 0 and time.monotonic() - last >= progress_interval:
                last = time.monotonic()
                say(f"verified {done}/{len(entries)} shards, {nbytes / 1e9:.2f} GB, {len(errors)} bad")
    el = max(time.monotonic() - t0, 1e-9)
    unchecked = sum("checksum" not in e for e in entries)
    notes = [f"{unchecked} have no checksum (older titanlite): only their token ids were checked"] * bool(unchecked)
    if "fingerprint" not in manifest["tokenizer"]:
        notes.append("no tokenizer fingerprint recorded")
    say(
        f"{mpath}: {len(entries) - len(errors)} of {len(entries)} shards OK ({nbytes / 1e9:.2f} GB of tokens in "
        f"{el:.1f} s, {nbytes / el / 1e9:.2f} GB/s), tokenizer {describe_tokenizer(manifest['tokenizer'])}"
        + "".join(f"; {n}" for n in notes)
    )
    return errors


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="titanlite prepare",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = p.add_argument
    add(
        "--input",
        nargs="+",
        metavar="PATH",
        help="Text/JSONL/JSON/Parquet files or folders (read recursively, sorted). Required unless --verify.",
    )
    add(
        "--tokenizer",
        default="",
        help='tiktoken BPE file (e.g. Llama 3 tokenizer.model), HF tokenizer.json or HF model folder; "" or "bytes" '
        "= built-in byte tokenizer.",
    )
    add("--output", metavar="DIR", help="Output folder for shards and manifest.json. Required unless --verify.")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--val-fraction", type=float, default=0.0, help="Fraction of documents held out as 'val'.")
    split.add_argument(
        "--val-only",
        action="store_true",
        help="Every document to 'val' (--val-fraction 1): a folder for [validation] dataset_path, which reads "
        "its 'val' split.",
    )
    add("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)), help="Tokenizer worker processes.")
    add("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="Close a shard once it holds this many tokens.")
    add("--text-field", default="text", help="JSON/Parquet field holding the document text.")
    add(
        "--format",
        dest="file_format",
        default="auto",
        choices=[*FORMATS, "chat"],
        help="Input format (auto = by file suffix; chat = JSONL conversations, with a loss-mask stream).",
    )
    add(
        "--txt-split",
        default="file",
        choices=TXT_SPLITS,
        help="Plain-text files: one document per file, or per blank-line separated paragraph.",
    )
    add(
        "--overwrite",
        action="store_true",
        help="Delete the shards this tool prepared with other settings (those its manifest/journal list) "
        "instead of refusing.",
    )
    add(
        "--verify",
        metavar="DIR",
        help="Instead of preparing: check every shard of a prepared folder (header, token ids, checksum).",
    )
    add("--quiet", action="store_true", help="No progress lines.")
    return p


def _error(e: object) -> None:
    msg = one_line(e) or type(e).__name__
    print(f"prepare_data: error: {msg}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 done, 1 damaged shards found by --verify, 2 bad input or settings (one
    ``prepare_data: error:`` line each), 130 interrupted; any other exception keeps its traceback."""
    parser = build_parser()
    kwargs = vars(parser.parse_args(argv))  # the option names are prepare()'s keyword arguments
    log = None if kwargs.pop("quiet") else sys.stderr
    if kwargs.pop("val_only"):
        kwargs["val_fraction"] = 1.0
    folder = kwargs.pop("verify")
    if folder is not None and (kwargs["input"] or kwargs["output"]):
        parser.error("--verify takes no --input or --output")
    if folder is None and not (kwargs["input"] and kwargs["output"]):
        parser.error("--input and --output are required (or --verify DIR)")
    try:
        if folder is not None:
            errors = verify(folder, kwargs["workers"], log=log)
            for e in errors:
                _error(e)
            return 1 if errors else 0
        prepare(kwargs.pop("input"), kwargs.pop("output"), kwargs.pop("tokenizer"), log=log, **kwargs)
    except UserError as e:  # bad input or settings, a missing optional package
        _error(e)
        return e.exit_code
    except KeyboardInterrupt:
        print(
            "prepare_data: interrupted; finished shards are kept, re-run the same command to continue", file=sys.stderr
        )
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
