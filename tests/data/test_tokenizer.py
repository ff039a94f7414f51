"""Tokenizer files: tiktoken BPE loading, Llama 3 specials, round trips, one-line errors naming file:line."""

import base64
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.shared_data import shared_file
from titanlite.data.shards import dtype_for_vocab
from titanlite.tokenizer import (
    Tokenizer,
    build_byte_tokenizer,
    build_tokenizer,
    llama3_special_tokens,
    load_tiktoken_ranks,
)


@pytest.fixture(scope="module")
def cl100k():
    return build_tokenizer(str(shared_file("tokenizers/cl100k_base.tiktoken")))


def test_byte_tokenizer_default():
    for spec in ("", "bytes"):
        tok = build_tokenizer(spec)
        assert tok.name == "bytes" and tok.vocab_size == 512
        assert (tok.bos_id, tok.eos_id) == (256, 257)
        assert tok.encode("hi", bos=True, eos=True) == [256, 104, 105, 257]


def test_test_tiktoken_model():
    path = shared_file("tokenizers/test_tiktoken.model")
    tok = build_tokenizer(str(path))
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 2000 + 256
    assert (tok.bos_id, tok.eos_id) == (2000, 2001)
    assert tok.encoding.encode_single_token("<|eot_id|>") == 2000 + 9
    text = "Hello world! This is a round-trip test, 1234567.\n\taccents é, CJK 漢字, emoji 🙂"
    assert tok.decode(tok.encode(text)) == text
    assert dtype_for_vocab(tok.vocab_size) == "uint16"


def test_cl100k_ids_and_specials(cl100k):
    assert cl100k.encode("hello world") == [15339, 1917]
    assert cl100k.vocab_size == 100256 + 256
    assert (cl100k.bos_id, cl100k.eos_id) == (100256, 100257)
    assert cl100k.encode("hello", bos=True, eos=True) == [100256, 15339, 100257]
    # Special-token text inside a document is ordinary text, never a control token.
    ids = cl100k.encode("<|end_of_text|>")
    assert cl100k.eos_id not in ids and cl100k.decode(ids) == "<|end_of_text|>"
    assert dtype_for_vocab(cl100k.vocab_size) == "uint32"
    assert len(llama3_special_tokens()) == 256


def test_cl100k_round_trip_shakespeare(cl100k):
    text = shared_file("text/tinyshakespeare.txt").read_text(encoding="utf-8")[:20000]
    ids = cl100k.encode(text)
    assert cl100k.decode(ids) == text
    batch = cl100k.encode_batch([text[:5000], text[5000:]], bos=True, eos=True)
    assert batch[0] == [cl100k.bos_id] + cl100k.encode(text[:5000]) + [cl100k.eos_id]
    assert batch[1][1:-1] == cl100k.encode(text[5000:])


def _write(tmp_path, lines, name="tok.model"):
    p = tmp_path / name
    p.write_bytes(b"".join(line + b"\n" for line in lines))
    return p


def _byte_lines(n=256):
    return [base64.b64encode(bytes([i])) + b" " + str(i).encode() for i in range(n)]


def test_small_valid_file(tmp_path):
    lines = _byte_lines() + [base64.b64encode(b"ab") + b" 256", b""]
    tok = build_tokenizer(str(_write(tmp_path, lines)))
    assert tok.vocab_size == 257 + 256 and tok.bos_id == 257
    assert tok.encode("ab") == [256]


@pytest.mark.parametrize(
    "bad_line, line_no, needle",
    [
        (b"!!notbase64 256", 257, "invalid base64"),
        (base64.b64encode(b"xy") + b" twelve", 257, "not a non-negative integer"),
        (base64.b64encode(b"xy"), 257, "expected '<base64 token> <rank>'"),
        (base64.b64encode(b"xy") + b" 5", 257, "duplicate rank 5 (first on line 6)"),
        (base64.b64encode(b"xy") + b" 300", 257, "not contiguous: expected 256"),
        (base64.b64encode(b"a") + b" 256", 257, "duplicate token"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path, bad_line, line_no, needle):
    p = _write(tmp_path, _byte_lines() + [bad_line])
    with pytest.raises(ValueError) as e:
        build_tokenizer(str(p))
    msg = str(e.value)
    assert msg.startswith(f"{p}:{line_no}: ") and needle in msg and "\n" not in msg


def test_corrupt_line_of_a_real_file_is_named(tmp_path):
    """tiktoken's reader names no line: the file is walked again to find it (blank lines count too)."""
    lines = shared_file("tokenizers/test_tiktoken.model").read_bytes().split(b"\n")
    token, rank = lines[1499].split()
    cases = {
        b"%s %s" % (token[:-1] + b"*", rank): "invalid base64 token",  # tiktoken fails on this line
        lines[1498]: "duplicate rank 1498 (first on line 1500)",  # tiktoken accepts this line
    }
    for bad, needle in cases.items():
        p = _write(tmp_path, [b""] + lines[:1499] + [bad] + lines[1500:])
        with pytest.raises(ValueError, match=rf"^{p}:1501: {re.escape(needle)}"):
            build_tokenizer(str(p))
    p = _write(tmp_path, [b"x"], name="one.model")
    p.chmod(0)
    if not os.access(p, os.R_OK):  # root reads it anyway
        with pytest.raises(ValueError, match=f"^{p}: cannot read tokenizer file: Permission denied$"):
            build_tokenizer(str(p))
    with pytest.raises(ValueError, match=f"^{tmp_path}: tokenizer path is a folder without tokenizer.json or orig"):
        build_tokenizer(str(tmp_path))


def test_tiktoken_cache_is_not_used(tmp_path, monkeypatch):
    """tiktoken would keep a copy keyed by the path and return it after the file changed: not for us."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    p = _write(tmp_path, _byte_lines() + [base64.b64encode(b"ab") + b" 256"])
    assert build_tokenizer(str(p)).encode("ab") == [256]
    _write(tmp_path, _byte_lines() + [base64.b64encode(b"cd") + b" 256"])
    tok = build_tokenizer(str(p))
    assert tok.encode("cd") == [256] and tok.encode("ab") == [97, 98]
    assert not cache.exists() and os.environ["TIKTOKEN_CACHE_DIR"] == str(cache)


def test_missing_empty_and_incomplete_files(tmp_path):
    missing = tmp_path / "nope.model"
    with pytest.raises(ValueError, match=f"^{missing}: tokenizer file not found$"):
        build_tokenizer(str(missing))
    empty = _write(tmp_path, [b""], name="empty.model")
    with pytest.raises(ValueError, match="empty tokenizer file"):
        load_tiktoken_ranks(str(empty))
    few = _write(tmp_path, _byte_lines(100), name="few.model")
    with pytest.raises(ValueError, match="no single-byte token for"):
        build_tokenizer(str(few))
    # a tokenizer.json is read as one (tests/data/test_hf_tokenizer.py); this one is not byte-level BPE
    hf = shared_file("tokenizers/hf_test/tokenizer.json")
    with pytest.raises(ValueError, match=rf"^{hf}: vocab token .* not in the byte-level alphabet"):
        build_tokenizer(str(hf))


def test_byte_tokenizer_unchanged():
    tok = build_byte_tokenizer()
    assert tok.path == "" and tok.decode(tok.encode("héllo")) == "héllo"


def test_layering_tokenizer_imports_no_titanlite_module():
    """Model families register ``build_tokenizer``: it, and model code, must not pull in ``titanlite.data``."""
    code = (
        "import sys, titanlite.tokenizer; print(sorted(m for m in sys.modules if m.startswith('titanlite')))\n"
        "import titanlite.models.llama3; print(sorted(m for m in sys.modules if m.startswith('titanlite.data')))"
    )
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True).stdout
    want = str(
        [
            "titanlite",
            "titanlite.errors",
            "titanlite.tokenizer",
            "titanlite.tokenizer.hf",
            "titanlite.tokenizer.hf_regex",
        ]
        + ["titanlite.utils", "titanlite.utils.nesting"]
    )
    assert out.splitlines() == [want, "[]"]
