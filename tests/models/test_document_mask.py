"""Block-causal (document) attention: mask semantics, SDPA vs flex forward, document independence."""

import pytest
import torch

from titanlite.data.windows import document_ids
from titanlite.models import build_model
from titanlite.models.attention import attention, block_causal_block_mask, block_causal_bool_mask

EOS = 257  # byte tokenizer


def test_mask_allows_only_earlier_tokens_of_same_document():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    m = block_causal_bool_mask(docs)[0, 0]
    for i in range(8):
        for j in range(8):
            assert bool(m[i, j]) == (j <= i and docs[0, i] == docs[0, j]), (i, j)


def test_flex_and_sdpa_paths_agree_on_cpu_forward():
    torch.manual_seed(0)
    b, h, s, d = 2, 4, 128, 16
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    tokens = torch.randint(0, 256, (b, s))
    tokens[0, [20, 70]] = EOS
    tokens[1, [5, 100, 101]] = EOS
    docs = document_ids(tokens, EOS)
    dense = attention(q, k, v, block_causal_bool_mask(docs))
    sparse = attention(q, k, v, block_causal_block_mask(docs))
    torch.testing.assert_close(dense, sparse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@torch.no_grad()  # flex attention has no backward on CPU (torch 2.13)
def test_document_logits_do_not_depend_on_preceding_document(backend):
    torch.manual_seed(0)
    model = build_model(
        "llama3",
        "debugmodel",
        device="cpu",
        n_layers=2,
        dim=64,
        n_heads=4,
        n_kv_heads=2,
        attn_mask_type="block_causal",
        attn_backend=backend,
    )
    model.eval()
    doc = torch.randint(0, 256, (1, 24))
    other = torch.randint(0, 256, (1, 40))
    other[0, -1] = EOS
    alone = model(doc, document_ids(doc, EOS))
    packed_tokens = torch.cat([other, doc], dim=1)
    packed = model(packed_tokens, document_ids(packed_tokens, EOS))
    # RoPE is relative, so shifting the document by 40 positions changes nothing but rounding
    torch.testing.assert_close(packed[:, 40:], alone, atol=1e-4, rtol=1e-4)
    # while plain causal attention does let the earlier document leak in
    causal = build_model("llama3", "debugmodel", device="cpu", n_layers=2, dim=64, n_heads=4, n_kv_heads=2)
    causal.load_state_dict(model.state_dict())
    assert not torch.allclose(causal(packed_tokens)[:, 40:], causal(doc), atol=1e-3)


def test_block_causal_needs_document_ids():
    model = build_model("llama3", "debugmodel", device="cpu", n_layers=1, attn_mask_type="block_causal")
    with pytest.raises(ValueError, match="document_ids"):
        model(torch.zeros(1, 4, dtype=torch.long))
