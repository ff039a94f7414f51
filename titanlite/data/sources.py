"""Raw-text document sources: plain text, Markdown, JSON Lines, JSON and Parquet files or folders.

:func:`iter_documents` yields documents (``str``) in a deterministic order. A folder is walked recursively in
sorted order of the relative POSIX paths, reading ``.txt``, ``.md``, ``.jsonl``, ``.json``, ``.parquet`` (and
their ``.gz``) files not named ``.*``. A text file (or a directly named file of any other suffix) is one document,
or with ``txt_split="paragraphs"`` one per run of lines between blank lines (a held-out split of a single file
needs many documents). JSON Lines (also a ``.json`` not starting with ``[``) hold one object per line, the
document in ``text_field``; a ``.json`` array holds such objects or strings; Parquet (needs ``pyarrow``) the
column ``text_field``. UTF-8 only; empty documents are skipped; errors are one line naming the file and line.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from titanlite.config.toml_io import decode_utf8
from titanlite.errors import DataError, MissingPackageError
from titanlite.utils.nesting import loads_json

PathLike = str | os.PathLike

FORMATS = ("auto", "text", "jsonl", "json", "parquet")
TXT_SPLITS = ("file", "paragraphs")
_SUFFIX_FORMAT = {".txt": "text", ".md": "text", ".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}


def file_format_of(path: PathLike) -> str | None:
    """The format of a file from its suffix (``None`` when the suffix is not a known one)."""
    name = Path(path).name.lower()
    fmt = _SUFFIX_FORMAT.get(os.path.splitext(name.removesuffix(".gz"))[1])
    return None if fmt == "parquet" and name.endswith(".gz") else fmt


def list_files(paths: PathLike | Sequence[PathLike]) -> list[Path]:
    """The files :func:`iter_documents` reads, in order (folders expanded recursively, sorted)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            found = []
            for root, dirs, files in os.walk(p):
                dirs[:] = [d for d in dirs if not d.startswith(".")]
                found += [Path(root, f) for f in files if not f.startswith(".") and file_format_of(f) is not None]
            out.extend(sorted(found, key=lambda f: f.relative_to(p).as_posix()))
        elif p.is_file():
            out.append(p)
        else:
            raise DataError(f"{p}: {'not a regular file or folder' if p.exists() else 'input not found'}")
    return out


def _open_binary(path: Path):
    f = open(path, "rb")
    return (gzip.GzipFile(fileobj=f, mode="rb") if path.name.endswith(".gz") else f), f


def _paragraphs(text: str) -> Iterator[str]:
    for nonblank, lines in itertools.groupby(text.splitlines(), key=lambda line: bool(line.strip())):
        if nonblank:
            yield "\n".join(lines) + "\n"


def _text_docs(path: Path, txt_split: str) -> Iterator[tuple[str, int]]:
    size = path.stat().st_size
    stream, raw = _open_binary(path)
    with raw:
        text = decode_utf8(stream.read(), path)
    for doc in [text] if txt_split == "file" else _paragraphs(text):
        if doc:
            yield doc, size


def _record_text(obj, where: str, text_field: str) -> str:
    if isinstance(obj, str):
        return obj
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object with a {text_field!r} field, got {type(obj).__name__}")
    if text_field not in obj:
        keys = ", ".join(list(obj)[:8]) or "none"
        raise DataError(f"{where}: no {text_field!r} field (keys: {keys}); choose the field with --text-field")
    value = obj[text_field]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {text_field!r} is {type(value).__name__}, not a string")
    return value


def _jsonl_docs(path: Path, text_field: str) -> Iterator[tuple[str, int]]:
    stream, raw = _open_binary(path)
    with raw:
        for lineno, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            try:
                obj = loads_json(decode_utf8(line, path, lineno))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
            text = _record_text(obj, f"{path}:{lineno}", text_field)
            if text:
                yield text, raw.tell()


def _json_docs(path: Path, text_field: str) -> Iterator[tuple[str, int]]:
    stream, raw = _open_binary(path)
    with raw:
        head = stream.read(4096).lstrip()
        data = head + stream.read() if head[:1] == b"[" else None
    if data is None:
        # Not an array: JSON Lines with a .json suffix (as C4's and many Hugging Face dumps are).
        yield from _jsonl_docs(path, text_field)
        return
    try:
        records = loads_json(decode_utf8(data, path))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: invalid JSON ({e.msg} at line {e.lineno} column {e.colno} of the array)") from None
    size = path.stat().st_size
    for i, obj in enumerate(records):
        text = _record_text(obj, f"{path}: record {i}", text_field)
        if text:
            yield text, size


def _parquet_docs(path: Path, text_field: str) -> Iterator[tuple[str, int]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise MissingPackageError(
            f"{path}: reading Parquet files needs the 'pyarrow' package (pip install pyarrow)"
        ) from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own error types
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{path}: not a readable Parquet file ({why})") from None
    names = pf.schema_arrow.names
    if text_field not in names:
        raise DataError(
            f"{path}: no {text_field!r} column (columns: {', '.join(names[:8])}); choose the column with --text-field"
        )
    size = path.stat().st_size
    groups = pf.num_row_groups or 1
    for g in range(pf.num_row_groups):
        column = pf.read_row_group(g, columns=[text_field]).column(0)
        done = size * (g + 1) // groups
        for value in column.to_pylist():
            if value is not None and not isinstance(value, str):
                raise DataError(f"{path}: column {text_field!r} holds {type(value).__name__}, not strings")
            if value:
                yield value, done


def iter_file_documents(
    path: PathLike, text_field: str = "text", file_format: str = "auto", txt_split: str = "file"
) -> Iterator[tuple[str, int]]:
    """Documents of ONE file as ``(text, bytes of the file consumed so far)`` (for progress/ETA)."""
    path = Path(path)
    if file_format not in FORMATS:
        raise DataError(f"unknown file format {file_format!r} (choose from {', '.join(FORMATS)})")
    if txt_split not in TXT_SPLITS:
        raise DataError(f"unknown txt_split {txt_split!r} (choose from {', '.join(TXT_SPLITS)})")
    fmt = file_format if file_format != "auto" else (file_format_of(path) or "text")
    try:
        if fmt == "text":
            yield from _text_docs(path, txt_split)
        else:
            yield from {"jsonl": _jsonl_docs, "json": _json_docs, "parquet": _parquet_docs}[fmt](path, text_field)
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DataError(f"{path}: corrupt gzip data ({e})") from None
    except FileNotFoundError:
        raise DataError(f"{path}: input not found") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a folder") from None
    except PermissionError:
        raise DataError(f"{path}: permission denied") from None


def iter_documents(
    path: PathLike | Sequence[PathLike], text_field: str = "text", file_format: str = "auto", txt_split: str = "file"
) -> Iterator[str]:
    """Documents of a file, a folder or a list of them; ``file_format``: "auto" (from each file's suffix), or
    one of "text", "jsonl", "json", "parquet" for every file."""
    for f in list_files(path):
        for text, _ in iter_file_documents(f, text_field, file_format, txt_split):
            yield text
