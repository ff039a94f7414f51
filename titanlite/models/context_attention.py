"""Attention of a context-parallel rank's queries over the whole sequence's keys and values, with no ``S x S`` mask.

A rank holds two query chunks (:mod:`titanlite.parallel.context_parallel`); chunk ``j`` covers the global
positions ``[j c, (j + 1) c)``. Under the causal mask it sees the keys ``[0, j c)`` entirely (the *prefix*, no
mask at all) and the keys ``[j c, (j + 1) c)`` causally (the *diagonal* block, ``is_causal``); later keys not at
all. Each part runs through a fused kernel that also returns the rows' log-sum-exp, and the parts are merged by
it: ``out = sum_i exp(lse_i - lse) out_i`` with ``lse = logsumexp_i lse_i``, the softmax over both parts.

Documents (block-causal): document ids grow along a window (:func:`titanlite.data.windows.document_ids`), so
the prefix keys a chunk's queries may see start at the first query's document start ``s0``, and all of
``[s0, j c)`` belong to that one document: a query sees the whole restricted prefix when it is in that document
and none of it otherwise (a per-row flag, never a mask over keys). Only the diagonal block takes a mask,
``c x c`` per sequence, built from the true (gathered) document ids.

The backward of each part is its kernel's backward given the *merged* output and log-sum-exp (the gradient of a
softmax over all keys, restricted to the part's keys); rows a part does not see get a zero gradient there.
Memory: the kernels never hold the scores, so a rank's peak grows with ``S x c``'s keys read, not with
``S^2`` (``titanlite bench attention``).
"""

from __future__ import annotations

import dataclasses

import torch

from titanlite.parallel.context_parallel import ContextParallel


@dataclasses.dataclass(frozen=True)
class ContextMask:
    """What every layer of one context-parallel forward needs: the group, the chunk size and, for block-causal
    attention, the whole sequences' document ids ``[B, S]`` (None: causal)."""

    cp: ContextParallel
    chunk: int
    document_ids: torch.Tensor | None = None

    @classmethod
    def build(cls, cp: ContextParallel, document_ids: torch.Tensor | None) -> ContextMask:
        """For ``cp``'s forward; ``document_ids``: this rank's share ``[B, S / cp]``, or None (causal)."""
        full = None if document_ids is None else cp.gather_ids(document_ids)
        return cls(cp, cp.local_len // 2, full)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequence of ``x [B, S / cp, heads, D]`` (keys or values, before GQA's repeat)."""
        return self.cp.gather(x, dim=1)

    def chunk_indices(self) -> tuple[int, int]:
        """The global chunk index of this rank's first and second local chunk."""
        return self.cp.rank, 2 * self.cp.degree - 1 - self.cp.rank


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: ContextMask) -> torch.Tensor:
    """Attention of this rank's queries ``q [B, H, 2c, D]`` over the whole sequence ``k, v [B, H, S, D]``."""
    c = mask.chunk
    outs = []
    for half, j in enumerate(mask.chunk_indices()):
        q_j = q[:, :, half * c : (half + 1) * c]
        if mask.document_ids is None:
            outs.append(_causal_chunk(q_j, k, v, j, c))
        else:
            ids = mask.document_ids
            rows = [_document_chunk(q_j[b : b + 1], k[b : b + 1], v[b : b + 1], ids[b], j, c) for b in range(len(ids))]
            outs.append(torch.cat(rows, 0))
    return torch.cat(outs, 2)


def _causal_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, j: int, c: int) -> torch.Tensor:
    """Chunk ``j``'s queries: the prefix ``[0, j c)`` unmasked and the diagonal block causal, merged."""
    diag = Part(k[:, :, j * c : (j + 1) * c], v[:, :, j * c : (j + 1) * c], causal=True)
    parts = [Part(k[:, :, : j * c], v[:, :, : j * c])] if j > 0 else []
    return merged_attention(q, [*parts, diag])


def _document_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor, j: int, c: int):
    """Chunk ``j``'s queries of one sequence (``ids [S]``: its document ids): the first query's document's part
    of the prefix for the queries in that document, and the diagonal block under the document mask."""
    lo, hi = j * c, (j + 1) * c
    q_ids, k_ids = ids[lo:hi], ids[lo:hi]
    same = q_ids[:, None] == k_ids[None, :]
    allowed = same & torch.ones(c, c, dtype=torch.bool, device=ids.device).tril()
    bias = torch.zeros(c, c, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
    parts = [Part(k[:, :, lo:hi], v[:, :, lo:hi], bias=bias[None, None])]
    start = int(torch.searchsorted(ids[:lo], ids[lo : lo + 1])) if lo > 0 else lo  # that document's first token
    if start < lo:
        parts.insert(0, Part(k[:, :, start:lo], v[:, :, start:lo], rows=(q_ids == ids[lo])[None]))
    return merged_attention(q, parts)


@dataclasses.dataclass(frozen=True)
class Part:
    """A block of keys/values ``[B, H, T, D]`` some queries attend: ``causal`` (square, top-left aligned), an
    additive ``bias`` (0 / -inf), and ``rows`` ``[B, S_q]``: the queries that see it at all (None: every one)."""

    k: torch.Tensor
    v: torch.Tensor
    causal: bool = False
    bias: torch.Tensor | None = None
    rows: torch.Tensor | None = None


def merged_attention(q: torch.Tensor, parts: list[Part]) -> torch.Tensor:
    """Softmax attention of ``q [B, H, S_q, D]`` over the union of ``parts``' keys (module docstring)."""
    tensors = [t for p in parts for t in (p.k, p.v)]
    specs = [dataclasses.replace(p, k=None, v=None) for p in parts]
    return _MergedAttention.apply(q, specs, *tensors)


class _MergedAttention(torch.autograd.Function):
    """Forward: each part's fused kernel with its log-sum-exp, merged; backward: each part's kernel backward at
    the merged output and log-sum-exp (module docstring)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, specs: list[Part], *kv: torch.Tensor) -> torch.Tensor:
        outs, lses = [], []
        for i, spec in enumerate(specs):
            out, lse = kernels(q.device).forward(q, kv[2 * i], kv[2 * i + 1], spec.causal, spec.bias)
            if spec.rows is not None:
                lse = lse.masked_fill(~spec.rows[:, None, :], float("-inf"))
            outs.append(out)
            lses.append(lse)
        lse = torch.logsumexp(torch.stack(lses), 0)  # the kernels' dtype: fp32 (fp64 for fp64 inputs)
        out = sum((part - lse).exp()[..., None] * o.to(lse.dtype) for part, o in zip(lses, outs)).to(q.dtype)
        ctx.specs = specs
        ctx.save_for_backward(q, out, lse, *kv)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, out, lse, *kv = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dkv = torch.zeros_like(q, dtype=lse.dtype), []
        for i, spec in enumerate(ctx.specs):
            g, part_lse = grad, lse
            if spec.rows is not None:  # queries that do not see the part: no gradient through it
                g = grad * spec.rows[:, None, :, None].to(grad.dtype)
                part_lse = lse.masked_fill(~spec.rows[:, None, :], float("inf"))
            k, v = kv[2 * i], kv[2 * i + 1]
            dq_i, dk, dv = kernels(q.device).backward(g, q, k, v, out, part_lse, spec.causal, spec.bias)
            dq += dq_i.to(dq.dtype)
            dkv += [dk, dv]
        return dq.to(q.dtype), None, *dkv


@dataclasses.dataclass(frozen=True)
class _Kernels:
    """A device's fused attention with log-sum-exp, and its backward given an output and log-sum-exp."""

    forward: object
    backward: object


def _cpu_forward(q, k, v, causal, bias):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias)


def _cpu_backward(g, q, k, v, out, lse, causal, bias):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g, q, k, v, out, lse, 0.0, causal, attn_mask=bias
    )


def _cuda_forward(q, k, v, causal, bias):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal)
    return out, lse[..., : q.shape[2]]


def _cuda_backward(g, q, k, v, out, lse, causal, bias):
    padded = -(-q.shape[2] // 32) * 32  # the kernel's log-sum-exp rows are padded to a multiple of 32
    lse = torch.nn.functional.pad(lse, (0, padded - lse.shape[-1])).contiguous()
    seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)
    masks = [True, True, True, False]
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        g, q, k, v, bias, out, lse, seed, offset, 0.0, masks, causal
    )
    return dq, dk, dv


def kernels(device: torch.device) -> _Kernels:
    """The fused kernels for ``device``: flash attention on CPU, memory-efficient attention (which takes a bias)
    on CUDA."""
    if device.type == "cuda":
        return _Kernels(_cuda_forward, _cuda_backward)
    return _Kernels(_cpu_forward, _cpu_backward)
