"""Attention kernels shared by model families: causal SDPA and document (block-causal) masking.

``attn_mask_type = "causal"`` uses ``F.scaled_dot_product_attention(is_causal=True)``: the fast
path, no mask tensor at all.

``attn_mask_type = "block_causal"`` restricts every token to earlier tokens of its own document
inside the packed window (documents are told apart by ``document_ids``, see
:func:`titanlite.data.windows.document_ids`). Two implementations give the same result:

* ``flex``: flex attention with a block mask built from the document ids. Sparse (skips blocks
  that cross documents) and the choice on CUDA, where it is compiled.
* ``sdpa``: SDPA with an explicit boolean ``[B, 1, S, S]`` mask. Dense, but has a backward pass on
  CPU, where flex attention has none in torch 2.13. The choice on CPU.

``backend = "auto"`` picks flex on CUDA and sdpa elsewhere. The mask is built once per forward by
:func:`build_attention_mask` and handed to every layer.

Which of SDPA's kernels runs (cuDNN, flash, memory-efficient, math) is torch's choice, in its priority order among
those that support the inputs; :func:`sdpa_priority` puts one first for a region (``[training] sdpa_kernel``), so
that the faster one on a given GPU can be chosen by measurement (``titanlite bench train``), with no model code
changed. The choice is made when an SDPA call is dispatched, or traced by ``torch.compile``: the region covers both.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from titanlite.errors import ConfigError
from titanlite.models.context_attention import ContextMask, context_attention

AttentionMask = None | torch.Tensor | BlockMask | ContextMask


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if backend not in ("sdpa", "flex"):
        raise ConfigError(f"attention backend must be auto, sdpa or flex, got {backend!r}")
    return backend


SDPA_KERNELS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


# each backend's "enabled" flag in torch._C, as torch.backends.cuda's *_sdp_enabled() read them (OVERRIDEABLE too)
_FLAG_NAMES = {**{b: n for n, b in SDPA_KERNELS.items()}, SDPBackend.EFFICIENT_ATTENTION: "mem_efficient"}
_FLAG_NAMES[SDPBackend.OVERRIDEABLE] = "overrideable"


def sdpa_priority(first: str = "auto") -> contextlib.AbstractContextManager:
    """A context in which SDPA tries the kernel ``first`` (a key of :data:`SDPA_KERNELS`) before the others, which
    keep their order and their enabled/disabled state, so inputs the kernel does not support still run; ``auto``:
    nothing changed. CUDA follows the order; torch's CPU dispatch has its own rule (flash where it applies, else
    math) and ignores it. On exit the previous flags are back, and the order of the enabled kernels."""
    if first == "auto":
        return contextlib.nullcontext()
    if first not in SDPA_KERNELS:
        raise ConfigError(f"training.sdpa_kernel must be auto or one of {', '.join(SDPA_KERNELS)}, got {first!r}")
    chosen = SDPA_KERNELS[first]
    current = [SDPBackend(i) for i in torch._C._get_sdp_priority_order()]
    enabled = [b for b in current if b != chosen and getattr(torch._C, f"_get_{_FLAG_NAMES[b]}_sdp_enabled")()]
    return sdpa_kernel([chosen, *enabled], set_priority=True)


def block_causal_bool_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """``[B, 1, S, S]`` boolean mask, True where query i may attend key j (j <= i, same document)."""
    seq = document_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    same_doc = document_ids[:, :, None] == document_ids[:, None, :]
    return (same_doc & causal)[:, None]


def block_causal_block_mask(document_ids: torch.Tensor) -> BlockMask:
    """Flex-attention block mask equivalent to :func:`block_causal_bool_mask`."""
    bsz, seq = document_ids.shape

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (document_ids[b, q_idx] == document_ids[b, kv_idx])

    # eager create_block_mask materializes a dense [B, S, S] mask first; compiled it works block by block
    make = _compiled_block_mask() if document_ids.device.type == "cuda" else create_block_mask
    return make(mask_mod, bsz, None, seq, seq, device=document_ids.device)


def build_attention_mask(
    attn_mask_type: str, document_ids: torch.Tensor | None, backend: str = "auto"
) -> AttentionMask:
    """The mask object every layer receives for one forward pass (None for plain causal)."""
    if attn_mask_type == "causal":
        return None
    if attn_mask_type != "block_causal":
        raise ValueError(f"unknown attn_mask_type {attn_mask_type!r}")
    if document_ids is None:
        raise ValueError("attn_mask_type 'block_causal' needs document_ids (from the data loader)")
    if resolve_backend(backend, document_ids.device) == "flex":
        return block_causal_block_mask(document_ids)
    return block_causal_bool_mask(document_ids)


@functools.cache
def _compiled_block_mask():
    return torch.compile(create_block_mask)


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask = None) -> torch.Tensor:
    """Attention over ``[B, H, S, D]`` q/k/v (k/v already repeated to H heads; under context parallelism ``q``
    holds this rank's share of the sequence, ``k`` and ``v`` all of it)."""
    if isinstance(mask, ContextMask):
        return context_attention(q, k, v, mask)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if isinstance(mask, BlockMask):
        fn = _compiled_flex() if q.device.type == "cuda" else flex_attention
        return fn(q, k, v, block_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def grouped_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of ``q [B, S, H, D]`` over ``k, v [B, T, KV, D]`` (``H`` a multiple of ``KV``) with a
    boolean ``mask [B, 1, S, T]``; returns ``[B, S, H, D]``. The key/value heads are not repeated: the
    ``H // KV`` query heads that share a kv head (heads ``j * n_rep ...``, as ``repeat_kv`` pairs them)
    become extra query rows of that head, so a cache is read once per step whatever the kernel.

    Compiled, a one-token step (``S == 1``, generation's decode) runs as two matmuls around an fp32
    softmax, which ``torch.compile`` fuses into a few kernels (SDPA's kernels are built for many query
    rows); otherwise SDPA runs it (eager: one call instead of several), never holding the ``[S, T]`` scores."""
    bsz, seqlen, n_heads, head_dim = q.shape
    n_kv = k.shape[2]
    n_rep = n_heads // n_kv
    rows = q.view(bsz, seqlen, n_kv, n_rep, head_dim).permute(0, 2, 3, 1, 4).reshape(bsz, n_kv, n_rep * seqlen, -1)
    row_mask = mask[:, :, None].expand(bsz, 1, n_rep, seqlen, mask.shape[-1]).reshape(bsz, 1, n_rep * seqlen, -1)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, KV, T, D]
    if seqlen == 1 and torch.compiler.is_compiling():
        scores = (rows * head_dim**-0.5) @ k.transpose(2, 3)  # [B, KV, n_rep, T]
        weights = scores.float().masked_fill(~row_mask, float("-inf")).softmax(dim=-1)
        out = weights.to(v.dtype) @ v
    else:
        out = F.scaled_dot_product_attention(rows, k, v, attn_mask=row_mask)
    return out.view(bsz, n_kv, n_rep, seqlen, head_dim).permute(0, 3, 1, 2, 4).reshape(bsz, seqlen, n_heads, head_dim)
