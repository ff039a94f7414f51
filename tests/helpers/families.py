"""A model family of the tests' own, without the KV-cache protocol (generation and scoring recompute)."""

from __future__ import annotations

import torch


class NoCacheLM(torch.nn.Module):
    """A family of one's own without the cache protocol (a learned position table, no ``args``)."""

    def __init__(self, vocab: int = 64, dim: int = 16, positions: int = 48):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.pos = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(positions, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.emb(tokens) + self.pos(torch.arange(tokens.shape[1]))
        return self.head(torch.cumsum(h, dim=1))  # causal: position t sees tokens up to t
