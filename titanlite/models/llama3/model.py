"""Llama 3 decoder-only transformer.

    tokens [B, S]
      -> tok_embeddings                                   [B, S, dim]
      -> N x TransformerBlock:
             h = x + attention(attention_norm(x), rope)   grouped-query, causal, rotary q/k
             h = h + feed_forward(ffn_norm(h))            SwiGLU: w2(silu(w1 h) * w3 h)
      -> norm (RMSNorm) -> output (Linear)                [B, S, vocab]

Details that matter for checkpoints and parallelism:

* Parameter names follow Meta's / torchtitan's Llama 3 code (``tok_embeddings``,
  ``layers.<i>.attention.wq`` ...), and ``layers`` is an ``nn.ModuleDict`` keyed "0".."N-1" so
  each block can be wrapped separately (FSDP, activation checkpointing, compile).
* RoPE uses Meta's *interleaved* layout: features (2i, 2i+1) of each head form one rotated pair.
  (Hugging Face checkpoints use a half-split layout; their wq/wk rows are permuted on conversion.)
  Llama 3.1 frequency scaling is applied when ``rope_scaling_factor > 0``. The cos/sin table is a
  non-persistent buffer computed by :func:`precompute_rope` with real arithmetic (no complex
  tensors, friendlier to compile and DTensor).
* Attention infers the number of local heads from the projection outputs, so the same code runs
  with tensor-parallel sharded ``wq/wk/wv`` (each rank holds a subset of heads).
* The model can be built on the meta device; ``to_empty`` + ``init_weights()`` then materialize it.
  ``init_weights`` only uses in-place ops so it also works on FSDP2-sharded (DTensor) parameters.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.attention import AttentionMask, attention, build_attention_mask, grouped_query_attention
from titanlite.models.context_attention import ContextMask
from titanlite.models.kv_cache import KVCache, LayerKV
from titanlite.models.llama3.args import Llama3ModelArgs
from titanlite.parallel.context_parallel import ContextParallel

# ----------------------------------------------------------------------------- rotary embeddings


def rope_frequencies(
    head_dim: int,
    theta: float = 500000.0,
    scaling_factor: float = 0.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position: int = 8192,
) -> torch.Tensor:
    """Rotation frequency of each of the ``head_dim // 2`` feature pairs (fp32), optionally with
    Llama 3.1 scaling: wavelengths shorter than ``original_max_position / high_freq_factor`` are
    kept, those longer than ``original_max_position / low_freq_factor`` are slowed down by
    ``scaling_factor``, and the band in between interpolates smoothly between the two."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling_factor <= 0:
        return freqs
    wavelen = 2 * math.pi / freqs
    # smooth = 1 keeps the frequency, smooth = 0 divides it by the factor; clamped to [0, 1] it
    # reproduces the three bands (high: wavelen < high_freq_wavelen, low: > low_freq_wavelen).
    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smooth = smooth.clamp(0.0, 1.0)
    return (1 - smooth) * freqs / scaling_factor + smooth * freqs


def precompute_rope(head_dim: int, max_seq_len: int, *args: float, **kwargs: float) -> torch.Tensor:
    """Rotary table ``[max_seq_len, head_dim]`` (fp32): ``cat([cos, sin], -1)`` where row ``p``
    holds the angles ``p * freq_i`` of the ``head_dim // 2`` pairs (``args``: :func:`rope_frequencies`'s)."""
    freqs = rope_frequencies(head_dim, *args, **kwargs)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, S, H, head_dim]`` in the interleaved layout, using rows ``[:S]`` of the table
    (or, from a KV cache, each row's own rows ``[B, S, head_dim]``)."""
    bsz, seqlen, n_heads, head_dim = x.shape
    table = rope_cache[:seqlen] if rope_cache.dim() == 2 else rope_cache
    cos, sin = table.view(-1, seqlen, 1, 2, head_dim // 2).unbind(dim=3)
    pairs = x.float().view(bsz, seqlen, n_heads, head_dim // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(3).type_as(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[B, S, n_kv, D] -> [B, S, n_kv * n_rep, D]``; kv head ``j`` serves query heads ``j*n_rep ...``."""
    if n_rep == 1:
        return x
    bsz, seqlen, n_kv, head_dim = x.shape
    return x.unsqueeze(3).expand(bsz, seqlen, n_kv, n_rep, head_dim).reshape(bsz, seqlen, n_kv * n_rep, head_dim)


@torch.compiler.disable
def context_parallel_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: ContextMask, n_rep: int
) -> torch.Tensor:
    """Attention of this rank's queries ``q [B, S / cp, H, D]`` over the whole sequence's keys and values, gathered
    from every CP rank's ``k, v [B, S / cp, KV, D]`` (GQA's few heads, repeated after the gather):
    ``[B, S / cp, H, D]`` (:mod:`titanlite.models.context_attention`). Under ``torch.compile`` it runs eagerly, a
    graph break: its collectives and autograd functions (with process groups) stay out of the compiled blocks."""
    k, v = repeat_kv(mask.gather(k), n_rep), repeat_kv(mask.gather(v), n_rep)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
    return attention(q, k, v, mask).transpose(1, 2)


# ----------------------------------------------------------------------------- modules


class Attention(nn.Module):
    """Grouped-query self-attention with rotary position embeddings."""

    def __init__(self, args: Llama3ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.kv_heads  # stays the same when TP shards the heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_(linear.weight, 0.02)
        trunc_normal_(self.wo.weight, init_std)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, rope_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on the query and key heads (a family with another layout or QK-norm overrides it)."""
        return apply_rope(q, rope_cache), apply_rope(k, rope_cache)

    def forward(
        self, x: torch.Tensor, rope_cache: torch.Tensor, attn_mask: AttentionMask = None, cache: LayerKV | None = None
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1: the number of (local) heads comes from the projection, not from args (TP shards it)
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = self.rotate(q, k, rope_cache)
        if cache is not None:  # generation / packed scoring: the cached keys/values, GQA's few heads unrepeated
            k, v = cache.update(k, v)  # (models/kv_cache.py)
            return self.wo(grouped_query_attention(q, k, v, attn_mask).reshape(bsz, seqlen, -1))
        if isinstance(attn_mask, ContextMask):  # context parallelism: the whole sequence's keys, eagerly
            out = context_parallel_attention(q, k, v, attn_mask, self.n_rep)
            return self.wo(out.reshape(bsz, seqlen, -1))
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
        out = attention(q, k, v, attn_mask)  # causal, the document mask, or context-parallel (models/attention.py)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        trunc_normal_(self.w1.weight, 0.02)
        for linear in (self.w2, self.w3):
            trunc_normal_(linear.weight, init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: attention then SwiGLU, each with a residual connection."""

    attention_cls: type[Attention] = Attention

    def __init__(self, layer_id: int, args: Llama3ModelArgs):
        super().__init__()
        self.attention = self.attention_cls(args)
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
        self, x: torch.Tensor, rope_cache: torch.Tensor, attn_mask: AttentionMask = None, cache: LayerKV | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache, attn_mask, cache=cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The Llama 3 language model: ``forward(tokens [B, S]) -> logits [B, S, vocab]``. A family with other blocks
    or another rotary table subclasses it (``block_cls``, :meth:`_precompute_rope`)."""

    block_cls: type[TransformerBlock] = TransformerBlock
    # the members of titanlite.models.protocol.ModelFamily (the ends are None on some pipeline stages)
    args: Llama3ModelArgs
    tok_embeddings: nn.Embedding | None
    layers: nn.ModuleDict
    norm: nn.RMSNorm | None
    output: nn.Linear | None

    def __init__(self, args: Llama3ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.block_cls(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cache", self._precompute_rope(), persistent=False)

    def _precompute_rope(self) -> torch.Tensor:
        a = self.args
        scaling = (a.rope_scaling_factor, a.rope_low_freq_factor, a.rope_high_freq_factor, a.rope_original_max_position)
        return precompute_rope(a.head_dim, a.max_seq_len, a.rope_theta, *scaling)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialize every parameter and the rotary table; deterministic given torch's seed."""
        with torch.device(buffer_device or self.rope_cache.device):
            self.rope_cache = self._precompute_rope()
        tied = self.args.tie_word_embeddings
        if tied and self.output.weight is not self.tok_embeddings.weight:  # re-tie if a conversion split them
            self.output.weight = self.tok_embeddings.weight
        if self.tok_embeddings is not None:  # None: a later pipeline stage (titanlite.parallel.pipeline)
            nn.init.normal_(self.tok_embeddings.weight, std=self.args.dim**-0.5 if tied else 1.0)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if not tied and self.output is not None:
            trunc_normal_(self.output.weight, self.args.dim**-0.5)

    def forward(
        self,
        tokens: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        return_hidden: bool = False,
        context_parallel: ContextParallel | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, S, vocab]``; ``document_ids [B, S]`` is needed for ``block_causal`` masking.
        With a ``cache`` (generation, :mod:`titanlite.models.kv_cache`) ``tokens`` continue the cached ones.
        ``return_hidden``: the final norm's output ``[B, S, dim]`` instead, for a caller that applies ``output``
        itself (the chunked loss, :mod:`titanlite.trainer.output_loss`). ``context_parallel``: ``tokens`` are this
        rank's load-balanced share of the sequences (:mod:`titanlite.parallel.context_parallel`), ``document_ids``
        the whole sequences' ids: global rotary positions, attention over gathered keys.

        A pipeline stage (see :func:`titanlite.parallel.pipeline.pipeline_decoder`) lacks the modules other
        stages hold: without ``tok_embeddings`` it takes hidden states, without ``output`` it returns them."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        seqlen = h.shape[1] if context_parallel is None else context_parallel.seq_len
        if seqlen > self.rope_cache.shape[0]:
            raise ValueError(f"sequence length {seqlen} exceeds max_seq_len {self.rope_cache.shape[0]}")
        if context_parallel is not None:  # this rank's rotary rows, the whole sequences' document ids
            rope = self.rope_cache[context_parallel.positions(self.rope_cache.device)][None]
            ids = document_ids if self.args.attn_mask_type == "block_causal" else None
            if ids is None and self.args.attn_mask_type == "block_causal":
                raise ValueError("attn_mask_type 'block_causal' needs document_ids (from the data loader)")
            attn_mask = ContextMask.build(context_parallel, ids)
        elif cache is None:
            attn_mask = build_attention_mask(self.args.attn_mask_type, document_ids, self.args.attn_backend)
            rope = self.rope_cache
        else:  # generation: each row's rotary rows, a mask over the cached slots (models/kv_cache.py)
            rope, attn_mask = cache.step(self.rope_cache, tokens.shape[1])
        for name, layer in self.layers.items():
            h = layer(h, rope, attn_mask, cache=None if cache is None else cache.layer(name))
        if self.output is None:  # a pipeline stage before the last
            return h
        h = self.norm(h)
        return h if return_hidden else self.output(h)


# ----------------------------------------------------------------------------- helpers


def trunc_normal_(weight: torch.Tensor, std: float, cutoff: float = 3.0) -> None:
    """In-place truncated normal (mean 0) cut at ``cutoff`` standard deviations."""
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-cutoff * std, b=cutoff * std)
