"""Qwen3-style dense decoder: Llama's block with QK-norm, a free ``head_dim`` and half-split RoPE.

    tokens [B, S]
      -> tok_embeddings                                      [B, S, dim]
      -> N x Qwen3Block:
             q, k, v = wq x, wk x, wv x                      heads of head_dim (q: n_heads, k/v: n_kv_heads)
             q, k = q_norm(q), k_norm(k)                     RMSNorm over head_dim, per head (QK-norm)
             q, k = rope(q), rope(k)                         rotate-half layout, pairs (j, j + head_dim/2)
             h = x + wo(attention(q, k, v))                  causal (or document-masked) GQA
             h = h + w2(silu(w1 ffn_norm(h)) * w3 ffn_norm(h))
      -> norm (RMSNorm) -> output (Linear)                   [B, S, vocab]

Parameter names follow torchtitan's Qwen3 (and titanlite's Llama 3): ``tok_embeddings``,
``layers.<i>.attention.{wq,wk,wv,wo,q_norm,k_norm}``, ``layers.<i>.feed_forward.{w1,w2,w3}``,
``layers.<i>.{attention_norm,ffn_norm}``, ``norm``, ``output``; ``layers`` is an ``nn.ModuleDict``
so titanlite's per-block FSDP / activation checkpointing / compile apply unchanged.

RoPE layout: the half-split ("rotate half") layout that Hugging Face's Qwen3 uses natively, so a
Hugging Face checkpoint maps onto this model by renaming alone (no q/k row permutation, unlike
titanlite's Llama 3, which keeps Meta's interleaved layout). Attention kernels (causal SDPA, or
the block-causal document mask) are titanlite's shared ones (:mod:`titanlite.models.attention`).

Attention reads the number of local heads from the projection outputs, so the same code runs on
tensor-parallel shards (each rank holding a subset of the heads).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from titanlite.models.attention import AttentionMask, attention, build_attention_mask, grouped_query_attention
from titanlite.models.kv_cache import KVCache, LayerKV
from titanlite.models.llama3.model import FeedForward, repeat_kv, trunc_normal_  # same MLP, GQA repeat, init
from torchtitan_ext.qwen3.args import Qwen3ModelArgs


def rope_table(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """``[max_seq_len, head_dim]`` fp32 table ``cat([cos, sin], -1)``; row ``p`` holds the angles
    ``p * theta^(-2j / head_dim)`` of the ``head_dim // 2`` rotated pairs."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def apply_rope_half(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, S, H, head_dim]`` in the half-split layout: feature ``j`` pairs with feature
    ``j + head_dim / 2``. Computed in fp32, returned in ``x``'s dtype. ``table``: rows ``[:S]`` are used,
    or it holds each row's own rows ``[B, S, head_dim]`` (from a KV cache)."""
    seqlen, half = x.shape[1], x.shape[-1] // 2
    rows = table[:seqlen] if table.dim() == 2 else table
    cos, sin = rows.view(-1, seqlen, 1, 2, half).unbind(dim=3)
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class Qwen3Attention(nn.Module):
    def __init__(self, args: Qwen3ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.kv_heads  # unchanged when TP shards the heads
        self.wq = nn.Linear(args.dim, args.q_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_dim, bias=False)
        self.wo = nn.Linear(args.q_dim, args.dim, bias=False)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_(linear.weight, 0.02)
        trunc_normal_(self.wo.weight, init_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, attn_mask: AttentionMask = None, cache: LayerKV | None = None
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1: the (local) head count comes from the projection (tensor parallel shards the heads)
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope_half(q, rope), apply_rope_half(k, rope)
        if cache is not None:  # generation / packed scoring: GQA's few heads, unrepeated (titanlite.models.kv_cache)
            k, v = cache.update(k, v)
            return self.wo(grouped_query_attention(q, k, v, attn_mask).reshape(bsz, seqlen, -1))
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class Qwen3Block(nn.Module):
    def __init__(self, layer_id: int, args: Qwen3ModelArgs):
        super().__init__()
        self.attention = Qwen3Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        depth = (layer_id + 1) if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / math.sqrt(2 * depth)

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, attn_mask: AttentionMask = None, cache: LayerKV | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, attn_mask, cache=cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Qwen3Model(nn.Module):
    """``forward(tokens [B, S], document_ids=None, cache=None, return_hidden=False) -> logits [B, S, vocab]``."""

    def __init__(self, args: Qwen3ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Qwen3Block(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer(
            "rope_cache", rope_table(args.head_dim, args.max_seq_len, args.rope_theta), persistent=False
        )

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialize parameters and the rotary table in place (works on DTensor shards)."""
        a = self.args
        with torch.device(buffer_device or self.rope_cache.device):
            self.rope_cache = rope_table(a.head_dim, a.max_seq_len, a.rope_theta)
        if a.tie_word_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight  # re-tie after a conversion split them
        if self.tok_embeddings is not None:  # None: a later pipeline stage (titanlite.parallel.pipeline)
            nn.init.normal_(self.tok_embeddings.weight, std=a.dim**-0.5 if a.tie_word_embeddings else 1.0)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if not a.tie_word_embeddings and self.output is not None:
            trunc_normal_(self.output.weight, a.dim**-0.5)

    def forward(
        self,
        tokens: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """``return_hidden``: the final norm's output ``[B, S, dim]`` instead of the logits (titanlite.output_loss)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # None: a later stage
        if tokens.shape[1] > self.rope_cache.shape[0]:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len {self.rope_cache.shape[0]}")
        if cache is None:
            mask = build_attention_mask(self.args.attn_mask_type, document_ids, self.args.attn_backend)
            rope = self.rope_cache
        else:  # generation: each row's rotary rows, a mask over the cached slots (titanlite.models.kv_cache)
            rope, mask = cache.step(self.rope_cache, tokens.shape[1])
        for name, layer in self.layers.items():
            h = layer(h, rope, mask, cache=None if cache is None else cache.layer(name))
        if self.output is None:  # a pipeline stage before the last
            return h
        h = self.norm(h)
        return h if return_hidden else self.output(h)
