"""Tokenizers (tiktoken based).

The zero-download default is :func:`build_byte_tokenizer`: 256 byte tokens plus Llama 3's special
tokens, built in code, so the debug model trains on a fresh machine with no files at all.

:func:`build_tokenizer` also loads tiktoken BPE files: Meta's Llama 3 ``tokenizer.model`` or any file
in the same format (``cl100k_base.tiktoken``, ...), one ``<base64 token> <rank>`` pair per line with
ranks ``0, 1, 2, ...`` in line order. Llama 3's 256 special tokens are appended after the base
vocabulary (so the real Llama 3 file gives BOS 128000 / EOS 128001, cl100k gives 100256 / 100257)
and Llama 3's pre-tokenization regex is used. A bad file raises a one-line ``ValueError`` naming
the file and, where there is one, the line.

:class:`ParallelEncoder` runs a pool of worker processes that each build the tokenizer once and turn
batches of documents into ``BOS + tokens + EOS`` arrays (used by ``scripts/prepare_data.py``).
``Tokenizer.encode_batch`` uses tiktoken's own thread pool.
"""
from __future__ import annotations

import base64
import binascii
import multiprocessing
import os
import sys
from typing import Optional, Sequence

import numpy as np
import tiktoken

# Llama 3's pre-tokenization regex: contractions, letter runs, 1-3 digit groups, punctuation runs,
# newlines and other whitespace.
LLAMA3_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

NUM_RESERVED_SPECIAL_TOKENS = 256


def llama3_special_tokens() -> list[str]:
    """Llama 3's 256 special tokens in id order (offset by the base vocabulary size)."""
    named = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|step_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(2, NUM_RESERVED_SPECIAL_TOKENS - len(named) + 2)]
    return named + reserved


class Tokenizer:
    """A tiktoken encoding with Llama 3 conventions (BOS/EOS from its special tokens)."""

    def __init__(self, encoding: tiktoken.Encoding, name: str, path: str = ""):
        self.encoding = encoding
        self.name = name
        self.path = path  # what build_tokenizer() was given ("" for the built-in byte tokenizer)
        self.bos_id = encoding.encode_single_token("<|begin_of_text|>")
        self.eos_id = encoding.encode_single_token("<|end_of_text|>")

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        # Special-token text inside documents is encoded as ordinary bytes, never as control tokens.
        ids = self.encoding.encode_ordinary(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_batch(self, texts: Sequence[str], bos: bool = False, eos: bool = False,
                     num_threads: int = 8) -> list[list[int]]:
        batch = self.encoding.encode_ordinary_batch(list(texts), num_threads=num_threads)
        head = [self.bos_id] if bos else []
        tail = [self.eos_id] if eos else []
        return [head + ids + tail for ids in batch]

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode(list(ids))


def build_byte_tokenizer() -> Tokenizer:
    """The built-in byte-level tokenizer: ids 0-255 are raw bytes, 256-511 Llama 3's specials."""
    ranks = {bytes([i]): i for i in range(256)}
    specials = {tok: 256 + i for i, tok in enumerate(llama3_special_tokens())}
    enc = tiktoken.Encoding(name="titanlite_bytes", pat_str=LLAMA3_PAT_STR,
                            mergeable_ranks=ranks, special_tokens=specials)
    return Tokenizer(enc, name="bytes", path="")


# Bytes that can occur in UTF-8 text: every byte except 0xC0, 0xC1 and 0xF5-0xFF. A byte-level BPE
# file must have a single-byte token for each, or tiktoken cannot encode some text.
_UTF8_BYTES = [b for b in range(256) if b not in (0xC0, 0xC1) and b < 0xF5]


def _b64decode(data: bytes) -> bytes:
    """Strict base64 decoding (rejects stray characters and bad padding)."""
    if sys.version_info >= (3, 11):
        return binascii.a2b_base64(data, strict_mode=True)
    return base64.b64decode(data, validate=True)


def _show(line: bytes, limit: int = 60) -> str:
    text = line.decode("utf-8", errors="replace")
    return repr(text if len(text) <= limit else text[:limit] + "...")


def load_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """Read a tiktoken BPE file (``<base64 token> <rank>`` per line, ranks 0..n-1 in line order).

    Blank lines are ignored. Errors are one-line ``ValueError("<path>:<line>: ...")``.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ValueError(f"{path}: tokenizer file not found") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: tokenizer path is a directory, expected a tiktoken BPE file") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read tokenizer file: {e.strerror or e}") from None

    hint = ""
    if path.endswith(".json"):
        hint = " (this looks like a Hugging Face tokenizer.json; only tiktoken BPE files are supported)"
    ranks: dict[bytes, int] = {}
    line_of_rank: list[int] = []  # ranks are the line order, so this maps rank -> line number
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        parts = raw.split()
        if len(parts) != 2:
            if not parts:
                continue  # blank line
            raise ValueError(f"{path}:{lineno}: expected '<base64 token> <rank>', got {_show(raw.strip())}{hint}")
        tok_b64, rank_s = parts
        try:
            token = _b64decode(tok_b64)
        except (binascii.Error, ValueError):
            raise ValueError(f"{path}:{lineno}: invalid base64 token {_show(tok_b64)}{hint}") from None
        if not rank_s.isdigit():
            raise ValueError(f"{path}:{lineno}: rank {_show(rank_s)} is not a non-negative integer{hint}")
        rank = int(rank_s)
        expected = len(line_of_rank)
        if rank != expected:
            if rank < expected:
                raise ValueError(f"{path}:{lineno}: duplicate rank {rank} (first on line {line_of_rank[rank]})")
            raise ValueError(f"{path}:{lineno}: rank {rank} is not contiguous: expected {expected} "
                             f"(ranks must be 0, 1, 2, ... in line order)")
        if not token:
            raise ValueError(f"{path}:{lineno}: empty token")
        if token in ranks:
            raise ValueError(f"{path}:{lineno}: duplicate token {_show(tok_b64)} "
                             f"(first on line {line_of_rank[ranks[token]]})")
        ranks[token] = rank
        line_of_rank.append(lineno)
    if not ranks:
        raise ValueError(f"{path}: empty tokenizer file (no '<base64 token> <rank>' lines){hint}")
    missing = [b for b in _UTF8_BYTES if bytes([b]) not in ranks]
    if missing:
        shown = ", ".join(f"0x{b:02x}" for b in missing[:8]) + (", ..." if len(missing) > 8 else "")
        raise ValueError(f"{path}: no single-byte token for {len(missing)} byte value(s) ({shown}); "
                         f"a byte-level BPE file needs one for every byte")
    return ranks


def build_tiktoken_tokenizer(path: str) -> Tokenizer:
    """A tiktoken BPE file + Llama 3's 256 special tokens (ids n_base..n_base+255) + Llama 3's regex."""
    ranks = load_tiktoken_ranks(path)
    n = len(ranks)
    specials = {tok: n + i for i, tok in enumerate(llama3_special_tokens())}
    enc = tiktoken.Encoding(name=os.path.basename(path) or "tiktoken", pat_str=LLAMA3_PAT_STR,
                            mergeable_ranks=ranks, special_tokens=specials,
                            explicit_n_vocab=n + len(specials))
    return Tokenizer(enc, name=os.path.basename(path), path=path)


def build_tokenizer(path: str = "") -> Tokenizer:
    """Tokenizer from a tiktoken BPE file path; "" (or "bytes") selects the built-in byte tokenizer."""
    if not path or path == "bytes":
        return build_byte_tokenizer()
    return build_tiktoken_tokenizer(str(path))


def encode_documents(tokenizer: Tokenizer, texts: Sequence[str], dtype: np.dtype,
                     num_threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``BOS + tokens + EOS`` of each text, concatenated: ``(flat tokens as dtype, per-document lengths)``."""
    if num_threads > 1:
        batch = tokenizer.encoding.encode_ordinary_batch(list(texts), num_threads=num_threads)
    else:
        enc = tokenizer.encoding.encode_ordinary
        batch = [enc(t) for t in texts]
    lengths = np.fromiter((len(ids) + 2 for ids in batch), dtype=np.int64, count=len(batch))
    flat = np.empty(int(lengths.sum()), dtype=dtype)
    pos = 0
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    for ids, n in zip(batch, lengths.tolist()):
        flat[pos] = bos
        flat[pos + 1:pos + n - 1] = ids
        flat[pos + n - 1] = eos
        pos += n
    return flat, lengths


# --- worker processes: each builds the tokenizer once -------------------------------------------

_WORKER: Optional[tuple[Tokenizer, np.dtype]] = None
_INHERIT: Optional[tuple[Tokenizer, np.dtype]] = None  # set in the parent just before a "fork" pool starts


def _worker_init(path: str, dtype: str) -> None:
    global _WORKER
    if _INHERIT is not None and _INHERIT[0].path == path and _INHERIT[1] == np.dtype(dtype):
        _WORKER = _INHERIT  # forked: the parent's tokenizer is already in memory
    else:
        _WORKER = (build_tokenizer(path), np.dtype(dtype))


def _worker_encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER is not None, "worker not initialised"
    tokenizer, dtype = _WORKER
    return encode_documents(tokenizer, texts, dtype)


def default_start_method() -> str:
    """"fork" on Linux (instant start, nothing re-imported, as torch's DataLoader does), else "spawn".

    ``TITANLITE_MP_START`` overrides it (e.g. "spawn" or "forkserver").
    """
    env = os.environ.get("TITANLITE_MP_START", "")
    if env:
        return env
    return "fork" if sys.platform.startswith("linux") else "spawn"


class ParallelEncoder:
    """Encode batches of documents to ``(flat BOS+tokens+EOS array, lengths)`` in worker processes.

    ``workers <= 1`` encodes in the calling process (no pool). Each worker gets the tokenizer once
    (inherited from the parent with "fork", rebuilt from ``tokenizer.path`` with "spawn"); see
    :func:`default_start_method`. ``submit`` returns an object with ``.get()``; results are exactly
    what the in-process path produces, so the worker count never changes the output. Use as a
    context manager.
    """

    class _Done:
        def __init__(self, value):
            self._value = value

        def get(self):
            return self._value

    def __init__(self, tokenizer: Tokenizer, dtype: np.dtype, workers: int = 1,
                 start_method: Optional[str] = None):
        global _INHERIT
        self.tokenizer, self.dtype, self.workers = tokenizer, np.dtype(dtype), max(1, int(workers))
        self._pool = None
        if self.workers > 1:
            method = start_method or default_start_method()
            ctx = multiprocessing.get_context(method)
            _INHERIT = (tokenizer, self.dtype) if method == "fork" else None
            try:
                self._pool = ctx.Pool(self.workers, initializer=_worker_init,
                                      initargs=(tokenizer.path, self.dtype.str))
            finally:
                _INHERIT = None

    def submit(self, texts: list[str]):
        if self._pool is None:
            return self._Done(encode_documents(self.tokenizer, texts, self.dtype))
        return self._pool.apply_async(_worker_encode, (texts,))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def __enter__(self) -> "ParallelEncoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
