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


def edited(src: Path, dst: Path, edit) -> Path:
    """``src`` (a tokenizer.json) with ``edit`` applied to its parsed JSON, written to ``dst``."""
    data = json.loads(src.read_text())
    edit(data)
    dst.write_text(json.dumps(data))
    return dst


def parity_texts() -> list[str]:
    """1,038 texts: the 1,000 C4 documents, WikiText-2 valid and test in 16 slices each, 3 slices of
    Shakespeare and 3 hand-made texts (added-token and special-token text, NFC cases, digit runs)."""
    c4 = [json.loads(line)["text"] for line in shared_file("text/c4_sample.jsonl").read_text("utf-8").splitlines()]
    slices = []
    for rel, parts in (
        ("text/wikitext2/valid.txt", 16),
        ("text/wikitext2/test.txt", 16),
        ("text/tinyshakespeare.txt", 3),
    ):
        lines = shared_file(rel).read_text(encoding="utf-8")[:400_000].split("\n")
        step = -(-len(lines) // parts)
        slices += ["\n".join(lines[i : i + step]) for i in range(0, len(lines), step)]
    return [*c4, *slices, SPECIAL_TEXT, NFC_TEXT, "digits 1 12 123 1234 12345 2024-01-31 3.14159 1,000,000\n\n  x"]


def with_added_tokens(src: Path, dst: Path, added: list[tuple[str, bool]]) -> Path:
    """``src`` + non-special added tokens (content, normalized), saved by HF ``tokenizers`` itself."""
    tokenizers = pytest.importorskip("tokenizers", reason="HF tokenizers not installed")
    hf = tokenizers.Tokenizer.from_file(str(src))
    hf.decoder = hf.decoder or tokenizers.decoders.ByteLevel()  # a trained file has none: ids back to bytes
    hf.add_tokens([tokenizers.AddedToken(t, special=False, normalized=norm) for t, norm in added])
    dst.mkdir(parents=True, exist_ok=True)
    hf.save(str(dst / "tokenizer.json"))
    return dst / "tokenizer.json"


def sprinkle(texts: list[str], tokens: list[str]) -> list[str]:
    """Each text with added-token text put in at a few places (glued to words, after spaces, repeated)."""
    out = []
    for i, text in enumerate(texts):
        a, b = tokens[i % len(tokens)], tokens[(i + 1) % len(tokens)]
        cut1, cut2 = len(text) // 3, 2 * len(text) // 3
        out.append(f"{a}{text[:cut1]}{b}{a} {text[cut1:cut2]} {b}{b}{text[cut2:]}call <tool_call>")
    return out
