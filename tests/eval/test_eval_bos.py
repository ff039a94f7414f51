"""What goes in front of an eval context, against lm-evaluation-harness's HF backend: the tokenizer's own
``encode(context)`` (``add_special_tokens`` left at its default), so BOS for a tokenizer that has one and
nothing for one that has none (Qwen3); an empty context is scored after lm-eval's ``prefix_token_id``
(BOS, else EOS)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.shared_data import shared_file
from titanlite.eval.scoring import build_requests
from titanlite.eval.tasks import Item
from titanlite.tokenizer import build_tokenizer

tokenizers = pytest.importorskip("tokenizers", reason="HF tokenizers (test extra, via transformers) not installed")
converter = pytest.importorskip("transformers.convert_slow_tokenizer", reason="transformers not installed")

ITEMS = [
    Item("Question: Which gas do plants take in?\nAnswer:", (" oxygen", " carbon dioxide"), 1),
    Item("The cat sat on the", (" mat", " moon"), 0),
]


@pytest.fixture(scope="module")
def no_bos_json(tmp_path_factory) -> Path:
    """A tokenizer.json with Qwen3's special tokens: an EOS (<|endoftext|>) and no BOS."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = converter.TikTokenConverter(
        vocab_file=str(shared_file("tokenizers/test_tiktoken.model")), extra_special_tokens=specials
    )
    out = tmp_path_factory.mktemp("nobos") / "tokenizer.json"
    tok.converted().save(str(out))
    return out


def test_a_tokenizer_without_bos_scores_the_context_with_nothing_in_front(no_bos_json):
    tok, hf = build_tokenizer(str(no_bos_json)), tokenizers.Tokenizer.from_file(str(no_bos_json))
    requests = build_requests([ITEMS], tok, max_seq_len=1024)
    expected = [
        hf.encode(item.context).ids + hf.encode(choice, add_special_tokens=False).ids
        for item in ITEMS
        for choice in item.choices
    ]
    assert [r.tokens for r in requests] == expected
    assert all(r.tokens[0] != tok.eos_id for r in requests)
    assert not tok.has_bos and tok.bos_id == tok.eos_id == hf.token_to_id("<|endoftext|>")
    (empty,) = build_requests([[Item("", (" alone",), 0)]], tok, max_seq_len=1024)
    assert empty.tokens == [tok.eos_id, *hf.encode(" alone", add_special_tokens=False).ids]  # prefix_token_id


def test_a_tokenizer_with_bos_still_puts_it_first():
    tok = build_tokenizer(str(shared_file("tokenizers/test_tiktoken.model")))
    requests = build_requests([ITEMS[:1]], tok, max_seq_len=1024)
    assert [r.tokens for r in requests] == [
        [tok.bos_id, *tok.encode(ITEMS[0].context), *tok.encode(choice)] for choice in ITEMS[0].choices
    ]
    assert tok.has_bos
