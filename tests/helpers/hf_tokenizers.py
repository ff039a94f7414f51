"""Texts the tokenizer tests encode, and tokenizer.json files made by transformers' own converter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.shared_data import shared_file
from titanlite.tokenizer import llama3_special_tokens

SPECIAL_TEXT = "Hello<|begin_of_text|> x <|end_of_text|>y<|im_end|>\n<|endoftext|>  <|eot_id|>"
NFC_TEXT = "cafe\u0301 vs caf\u00e9, A\u030a, \ufb01 ligature, 한국어 \u1100\u1161"


def corpora() -> list[str]:
    """Slices of every shared corpus (kept small: the suite must stay fast on 2 cores)."""
    c4 = shared_file("text/c4_sample.jsonl").read_text(encoding="utf-8").splitlines()
    return [
        shared_file("text/tinyshakespeare.txt").read_text(encoding="utf-8")[:150_000],
        shared_file("text/wikitext2/valid.txt").read_text(encoding="utf-8")[:150_000],
        shared_file("text/wikitext2/test.txt").read_text(encoding="utf-8")[-60_000:],
        *[json.loads(line)["text"] for line in c4[:150]],
        SPECIAL_TEXT,
        NFC_TEXT,
        "tabs\tand  double  spaces \r\n\r\n digits 1234567 emoji 🙂🙂 accents é",
    ]


def convert(tiktoken_file: Path, out: Path, **kw) -> Path:
    """A tokenizer.json made from a tiktoken file by transformers' own converter (+ Llama 3's specials)."""
    converter = pytest.importorskip("transformers.convert_slow_tokenizer", reason="transformers not installed")
    tok = converter.TikTokenConverter(vocab_file=str(tiktoken_file), extra_special_tokens=llama3_special_tokens(), **kw)
    out.mkdir(parents=True, exist_ok=True)
    tok.converted().save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"
