"""Tokenizers (tiktoken based); which files load, and what is refused: docs/extensions.md, "Tokenizers".

:func:`build_byte_tokenizer` (256 byte tokens plus Llama 3's special tokens, built in code) is the zero-download
default. :func:`build_tokenizer` also loads tiktoken BPE files (Meta's Llama 3 ``tokenizer.model``,
``cl100k_base.tiktoken``: Llama 3's 256 special tokens appended after the base vocabulary, Llama 3's regex),
Hugging Face byte-level BPE ``tokenizer.json`` files (:mod:`titanlite.tokenizer.hf`) and HF model folders. A bad
file is a one-line error naming the file and line. Imports only leaves: families register :func:`build_tokenizer`
as their ``tokenizer_builder``, and model code must not depend on ``titanlite.data``.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import re
import string
import unicodedata
from collections.abc import Callable, Sequence

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from titanlite.errors import TokenizerError
from titanlite.tokenizer.hf import (
    byte_level_bytes,
    check_every_byte,
    is_hf_tokenizer_file,
    load_hf_tokenizer,
    resolve_tokenizer_file,
)

# Llama 3's pre-tokenization regex: contractions, letter runs, 1-3 digit groups, punctuation runs,
# newlines and other whitespace.
LLAMA3_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_RESERVED_SPECIAL_TOKENS = 256
# What a tiktoken file is made of. tiktoken's base64 decoding drops any other byte without a word.
_FILE_BYTES = (string.ascii_letters + string.digits + "+/= \t\r\n").encode()


def llama3_special_tokens() -> list[str]:
    """Llama 3's 256 special tokens in id order (offset by the base vocabulary size)."""
    named = (
        "begin_of_text end_of_text reserved_special_token_0 reserved_special_token_1 finetune_right_pad_id step_id "
        "start_header_id end_header_id eom_id eot_id python_tag"
    ).split()
    reserved = [f"reserved_special_token_{i}" for i in range(2, NUM_RESERVED_SPECIAL_TOKENS - len(named) + 2)]
    return [f"<|{name}|>" for name in named + reserved]


class HFEncoding(tiktoken.Encoding):
    """A tiktoken encoding that runs, as HF does, the steps before an HF pipeline's pre-tokenizer: non-special
    added tokens (``matched``: content -> ``normalized``) cut out as their own ids (leftmost-longest, raw ones
    first), the NFC normalizer (``nfc``) on the rest, then the normalized ones cut out; added tokens decode as
    HF's ByteLevel decoder does. A subclass, not a wrapper, so callers of ``tokenizer.encoding`` (the data
    pipeline) get the same ids."""

    def __init__(self, name: str, *, nfc: bool = False, matched: dict[str, bool] | None = None, **kwargs):
        super().__init__(name, **kwargs)
        self.nfc, self.matched = nfc, dict(matched or {})
        self._raw = _alternation([t for t, normalized in self.matched.items() if not normalized])
        self._normalized = _alternation([t for t, normalized in self.matched.items() if normalized])
        # added tokens whose text HF's decoder turns into other bytes than their UTF-8
        self._decoded = {i: b for t, i in self._special_tokens.items() if (b := byte_level_bytes(t)) != t.encode()}

    def __getstate__(self) -> object:
        state = dict(pat_str=self._pat_str, mergeable_ranks=self._mergeable_ranks, special_tokens=self._special_tokens)
        return dict(name=self.name, nfc=self.nfc, matched=self.matched, **state)

    def __setstate__(self, value: dict) -> None:
        self.__init__(**value)

    def _ids(self, text: str, encode: Callable[[str], list[int]]) -> list[int]:
        """``text`` cut into the ids of its added tokens and the (normalized) strings between them, ``encode``d."""
        ids: list[int] = []
        for piece in self._cut(self._raw, text):
            if isinstance(piece, str) and self.nfc:
                piece = unicodedata.normalize("NFC", piece)
            for p in self._cut(self._normalized, piece) if isinstance(piece, str) else [piece]:
                ids += [p] if isinstance(p, int) else encode(p) if p else []
        return ids

    def _cut(self, pattern: re.Pattern | None, text: str) -> list[str | int]:
        if pattern is None:
            return [text]
        out: list[str | int] = []
        start = 0
        for m in pattern.finditer(text):
            out += [text[start : m.start()], self._special_tokens[m.group()]]
            start = m.end()
        return [*out, text[start:]]

    def encode_ordinary(self, text: str) -> list[int]:
        return self._ids(text, super().encode_ordinary)

    def encode(self, text: str, **kwargs) -> list[int]:
        return self._ids(text, functools.partial(super().encode, **kwargs))

    def decode_bytes(self, tokens: Sequence[int]) -> bytes:
        plain = super().decode_bytes
        if not self._decoded or not any(t in self._decoded for t in tokens):
            return plain(tokens)
        return b"".join(self._decoded[t] if t in self._decoded else plain([t]) for t in tokens)

    def decode(self, tokens: Sequence[int], errors: str = "replace") -> str:
        return self.decode_bytes(tokens).decode("utf-8", errors=errors)


def _alternation(tokens: list[str]) -> re.Pattern | None:
    """A regex matching any of ``tokens``, the longest at the leftmost place (as HF's added-token matcher)."""
    if not tokens:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


class Tokenizer:
    """A tiktoken encoding plus its BOS/EOS ids (Llama 3's ``<|begin_of_text|>``/``<|end_of_text|>`` by default).
    ``has_bos`` is False for a tokenizer that defines no BOS (its ``bos_id`` is then the EOS id)."""

    def __init__(
        self, encoding: tiktoken.Encoding, name: str, path: str = "", bos: str = "", eos: str = "", has_bos: bool = True
    ):
        # path: what build_tokenizer() was given ("" for the built-in byte tokenizer)
        self.encoding, self.name, self.path, self.has_bos = encoding, name, path, has_bos
        self.bos_id = encoding.encode_single_token(bos or "<|begin_of_text|>")
        self.eos_id = encoding.encode_single_token(eos or "<|end_of_text|>")

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        # Special-token text inside documents is encoded as ordinary bytes, never as control tokens.
        return [self.bos_id] * bos + self.encoding.encode_ordinary(text) + [self.eos_id] * eos

    def encode_batch(self, texts: Sequence[str], bos: bool = False, eos: bool = False, num_threads: int = 8):
        """Like :meth:`encode` for each text, on tiktoken's own thread pool."""
        batch = self.encoding.encode_ordinary_batch(list(texts), num_threads=num_threads)
        return [[self.bos_id] * bos + ids + [self.eos_id] * eos for ids in batch]

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode(list(ids))


def _llama3_tokenizer(ranks: dict[bytes, int], name: str, path: str) -> Tokenizer:
    """``ranks`` + Llama 3's 256 special tokens (ids ``len(ranks)...``) + Llama 3's regex."""
    specials = {tok: len(ranks) + i for i, tok in enumerate(llama3_special_tokens())}
    encoding = tiktoken.Encoding(name, pat_str=LLAMA3_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)
    return Tokenizer(encoding, name=name, path=path)


def build_byte_tokenizer() -> Tokenizer:
    """The built-in byte-level tokenizer: ids 0-255 are raw bytes, 256-511 Llama 3's specials."""
    return _llama3_tokenizer({bytes([i]): i for i in range(256)}, name="bytes", path="")


def load_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """Read a tiktoken BPE file with tiktoken's own reader, refusing what it accepts (repeated tokens or ranks,
    gaps, a missing byte); :func:`_first_bad_line` names the offending line."""
    try:
        with open(path, "rb") as f:
            data = f.read()  # for the line count below and the error messages
    except FileNotFoundError:
        raise TokenizerError(f"{path}: tokenizer file not found") from None
    except IsADirectoryError:
        raise TokenizerError(f"{path}: tokenizer path is a directory, expected a tiktoken BPE file") from None
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read tokenizer file: {e.strerror or e}") from None
    # tiktoken 0.14's read_file_cached opens a path without "://" itself (nothing is downloaded), but
    # it also copies the file into $TIKTOKEN_CACHE_DIR (default <tmp>/data-gym-cache) under a key made
    # from the path alone, and without expected_hash it later returns that copy unchecked, even after
    # the file at the path changed. An empty TIKTOKEN_CACHE_DIR turns the cache off; it is set for
    # this call only (tokenizers are built at start-up or in fresh worker processes, not in threads).
    saved = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    try:
        ranks = load_tiktoken_bpe(path)
    except (ValueError, OSError):
        ranks = None
    finally:
        os.environ.pop("TIKTOKEN_CACHE_DIR")
        if saved is not None:
            os.environ["TIKTOKEN_CACHE_DIR"] = saved
    if ranks == {}:
        raise TokenizerError(f"{path}: empty tokenizer file (no '<base64 token> <rank>' lines)")
    # One entry per line (two fields each: no token repeated), ranks 0, 1, 2, ... in line order.
    in_order = ranks is not None and list(ranks.values()) == list(range(len(ranks)))
    if not in_order or len(data.split()) != 2 * len(ranks) or b"" in ranks or data.translate(None, _FILE_BYTES):
        raise TokenizerError(_first_bad_line(path, data))
    check_every_byte(path, ranks, "a byte-level BPE file needs one for every byte")
    return ranks


def _show(raw: bytes) -> str:
    return repr(raw.decode("utf-8", errors="replace")[:60])


def _first_bad_line(path: str, data: bytes) -> str:
    """``"<path>:<line>: why"`` for the first line that tiktoken fails on or that breaks our rules."""
    line_of_token: dict[bytes, int] = {}
    line_of_rank: list[int] = []  # ranks are the line order, so this maps rank -> line number
    for lineno, line in enumerate(data.splitlines(), start=1):
        if not line:
            continue
        parts, at = line.split(), f"{path}:{lineno}:"
        if len(parts) != 2:
            return f"{at} expected '<base64 token> <rank>', got {_show(line)}"
        try:
            token = base64.b64decode(parts[0], validate=True)
        except ValueError:
            return f"{at} invalid base64 token {_show(parts[0])}"
        if not parts[1].isdigit():
            return f"{at} rank {_show(parts[1])} is not a non-negative integer"
        rank, expected = int(parts[1]), len(line_of_rank)
        if rank < expected:
            return f"{at} duplicate rank {rank} (first on line {line_of_rank[rank]})"
        if rank > expected:
            return f"{at} rank {rank} is not contiguous: expected {expected} (ranks must be 0, 1, 2, ... in line order)"
        if token in line_of_token:
            return f"{at} duplicate token {_show(parts[0])} (first on line {line_of_token[token]})"
        if not token:
            return f"{at} empty token"
        line_of_token[token] = lineno
        line_of_rank.append(lineno)
    return f"{path}: not a tiktoken BPE file"


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """``"sha256:<hex>"`` of what every id means (its bytes or its special-token name): tells apart tokenizers of
    one vocabulary size whose shards would be each other's garbage. Not the regex: it changes how text is cut, not
    what a stored id means. From tiktoken's public API, so the same ranks give the same hash from any file."""
    enc = tokenizer.encoding
    specials = {enc.encode_single_token(s): s.encode() for s in enc.special_tokens_set}
    h = hashlib.sha256(b"titanlite-tokenizer-fingerprint-v1\0")
    for i in range(enc.n_vocab):
        if i in specials:
            kind, data = b"S", specials[i]
        else:
            try:
                kind, data = b"R", enc.decode_single_token_bytes(i)
            except KeyError:  # an id no token has (tiktoken allows gaps)
                kind, data = b"-", b""
        h.update(kind + len(data).to_bytes(4, "little") + data)
    return "sha256:" + h.hexdigest()


def build_hf_tokenizer(path: str, file: str) -> Tokenizer:
    """Tokenizer from a byte-level BPE tokenizer.json ``file`` (``path``: what the user gave). Without a BOS token
    (Qwen3) documents start with EOS, so ``BOS + tokens + EOS`` still frames each one."""
    spec = load_hf_tokenizer(file)
    name = os.path.basename(os.path.normpath(path)) or "tokenizer.json"
    kwargs = dict(pat_str=spec.pat_str, mergeable_ranks=spec.ranks, special_tokens=spec.special_tokens)
    try:
        if (
            spec.normalizer == "NFC"
            or spec.matched
            or any(byte_level_bytes(t) != t.encode() for t in spec.special_tokens)
        ):
            encoding = HFEncoding(name, nfc=spec.normalizer == "NFC", matched=spec.matched, **kwargs)
        else:
            encoding = tiktoken.Encoding(name, **kwargs)
        encoding.encode_ordinary("a 1")  # the regex compiles lazily in some tiktoken versions
    except ValueError as e:
        raise TokenizerError(f"{file}: tiktoken cannot use its pre-tokenizer regex: {str(e).splitlines()[0]}") from None
    bos, has_bos = spec.bos_token or spec.eos_token, spec.bos_token is not None
    return Tokenizer(encoding, name=name, path=path, bos=bos, eos=spec.eos_token, has_bos=has_bos)


def build_tokenizer(path: str = "") -> Tokenizer:
    """Tokenizer from a tiktoken BPE file, an HF tokenizer.json or an HF model folder; "" (or "bytes")
    selects the built-in byte tokenizer."""
    path = str(path)
    if path in ("", "bytes"):
        return build_byte_tokenizer()
    file = resolve_tokenizer_file(path)
    if is_hf_tokenizer_file(file):
        return build_hf_tokenizer(path, file)
    return _llama3_tokenizer(load_tiktoken_ranks(file), name=os.path.basename(path) or "tiktoken", path=path)


def token_byte_lengths(tokenizer: Tokenizer, size: int | None = None) -> list[int]:
    """How many bytes of text each id ``0 .. size-1`` stands for (``size``: the vocabulary, or a model's
    larger padded one). Special tokens and ids no token has count 0: bits per byte measure the text only,
    so they are comparable across tokenizers (as nanochat reports them). Added tokens HF matches in text
    (``"special": false``) stand for their text and count its bytes."""
    enc = tokenizer.encoding
    matched = getattr(enc, "matched", {})
    specials = {enc.encode_single_token(s) for s in enc.special_tokens_set if s not in matched}
    lengths = [0] * (size or enc.n_vocab)
    for i in range(min(len(lengths), enc.n_vocab)):
        if i not in specials:
            try:
                lengths[i] = len(enc.decode_single_token_bytes(i))
            except KeyError:  # an id no token has (tiktoken allows gaps)
                pass
    return lengths
