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

import torch
from torch import nn

from titanlite.models.llama3.model import Attention, Transformer, TransformerBlock, precompute_rope
from torchtitan_ext.qwen3.args import Qwen3ModelArgs


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


class Qwen3Attention(Attention):
    """Llama's grouped-query attention with QK-norm before the half-split RoPE."""

    def __init__(self, args: Qwen3ModelArgs):
        super().__init__(args)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None

    def init_weights(self, init_std: float) -> None:
        super().init_weights(init_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()

    def rotate(self, q: torch.Tensor, k: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope_half(q, rope), apply_rope_half(k, rope)


class Qwen3Block(TransformerBlock):
    attention_cls = Qwen3Attention


class Qwen3Model(Transformer):
    """``forward(tokens [B, S], document_ids=None, cache=None, return_hidden=False) -> logits [B, S, vocab]``:
    Llama 3's (:class:`titanlite.models.llama3.model.Transformer`) with Qwen3's blocks and rotary table."""

    block_cls = Qwen3Block

    def _precompute_rope(self) -> torch.Tensor:
        return precompute_rope(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta)  # no 3.1 scaling
