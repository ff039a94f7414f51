"""Bits per byte: the bytes each token stands for, and ``val_bpb`` against a hand computation."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tests.helpers.shared_data import shared_file
from titanlite.models import build_model
from titanlite.tokenizer import build_byte_tokenizer, build_tokenizer, token_byte_lengths
from titanlite.trainer.validation import validation_loss

TEXT = "Ünïcödé text, 中文 and emoji 🙂 — the bytes must add up.\nSecond line\tand tabs."


def test_byte_tokenizer_ids_are_one_byte_and_specials_none():
    tok = build_byte_tokenizer()
    lengths = token_byte_lengths(tok, size=600)  # a model vocabulary padded past the tokenizer's
    assert lengths[:256] == [1] * 256
    assert lengths[256:] == [0] * (600 - 256)  # Llama 3's specials (BOS, EOS ...) and the padding


def test_bpe_token_lengths_add_up_to_the_text_bytes():
    tok = build_tokenizer(str(shared_file("tokenizers/test_tiktoken.model")))
    lengths = token_byte_lengths(tok)
    ids = tok.encode(TEXT, bos=True, eos=True)
    assert len(ids) < len(TEXT.encode())  # merges happened: tokens of several bytes
    assert sum(lengths[i] for i in ids) == len(TEXT.encode("utf-8"))  # BOS and EOS count 0


def test_val_bpb_is_the_text_tokens_loss_in_bits_per_byte():
    tok = build_tokenizer(str(shared_file("tokenizers/test_tiktoken.model")))
    torch.manual_seed(0)
    tiny = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=tok.vocab_size)
    model = build_model("llama3", "debugmodel", device="cpu", **tiny)
    docs = [TEXT, "A second document, shorter.", "Third: 12345 numbers and ünïcödé."]
    ids = [i for d in docs for i in tok.encode(d, bos=True, eos=True)]
    seq = 16
    n = (len(ids) - 1) // seq
    x = torch.tensor(ids[: n * seq]).view(n, seq)
    y = torch.tensor(ids[1 : n * seq + 1]).view(n, seq)
    batches = [{"input_ids": x[:2], "labels": y[:2]}, {"input_ids": x[2:], "labels": y[2:]}]
    lengths = torch.tensor(token_byte_lengths(tok, tok.vocab_size))
    got = validation_loss(model, batches, token_bytes=lengths)

    with torch.no_grad():
        losses = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none")
    text = lengths[y.flatten()] > 0
    assert (~text).any()  # the windows do predict BOS/EOS tokens, which bits per byte leave out
    expected = losses[text].sum().item() / math.log(2) / lengths[y.flatten()].sum().item()
    assert math.isclose(got["val_bpb"], expected, rel_tol=1e-5)
    assert math.isclose(got["val_loss"], losses.mean().item(), rel_tol=1e-5)
    assert "val_bpb" not in validation_loss(model, batches)  # no byte table: no bits per byte
