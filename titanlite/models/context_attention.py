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
softmax over all keys, restricted to the part's keys); rows a part does not see get a zero gradient there. One
autograd function covers all of a rank's query blocks: every part's key/value gradients add into one ``dK, dV``
(slicing the keys under autograd would make a full-size zero gradient per part). The blocks, their key ranges and
document masks are planned once per forward (:attr:`ContextMask.blocks`, one host sync for the document starts)
and shared by every layer.
Memory: the kernels never hold the scores, so a rank's peak grows with ``S x c``'s keys read, not with
``S^2`` (``titanlite bench attention``).
"""

from __future__ import annotations

import dataclasses
import functools

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
        """For ``cp``'s forward; ``document_ids``: the whole sequences' ids ``[B, S]`` (the step leaves them whole,
        :meth:`titanlite.trainer.runtime.Runtime.shard`), or None (causal)."""
        return cls(cp, cp.local_len // 2, document_ids)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequence of ``x [B, S / cp, heads, D]`` (keys or values, before GQA's repeat)."""
        return self.cp.gather(x, dim=1)

    def chunk_indices(self) -> tuple[int, int]:
        """The global chunk index of this rank's first and second local chunk."""
        return self.cp.rank, 2 * self.cp.degree - 1 - self.cp.rank

    @functools.cached_property
    def blocks(self) -> tuple[Block, ...]:
        """This rank's query blocks and the key parts each attends, planned on the first layer's call and reused by
        the others (module docstring): per local chunk, all rows at once (causal) or one block per row
        (documents)."""
        c, blocks = self.chunk, []
        for half, j in enumerate(self.chunk_indices()):
            queries = (half * c, (half + 1) * c)
            if self.document_ids is None:
                blocks.append(Block(slice(None), queries, _causal_parts(j, c)))
            else:
                rows = enumerate(self.document_ids)
                blocks += [Block(slice(b, b + 1), queries, _document_parts(ids, j, c)) for b, ids in rows]
        return tuple(blocks)


@dataclasses.dataclass(frozen=True)
class Part:
    """Keys ``[lo, hi)`` of the whole sequence that a block's queries attend: ``causal`` (square, top-left
    aligned), an additive fp32 ``bias`` (0 / -inf, ``[1, 1, S_q, hi - lo]``), and ``rows`` ``[1, S_q]``: the
    queries that see it at all (None: every one)."""

    keys: tuple[int, int]
    causal: bool = False
    bias: torch.Tensor | None = None
    rows: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class Block:
    """Local queries ``[q0, q1)`` of the batch rows ``rows`` and the parts of the keys they attend."""

    rows: slice
    queries: tuple[int, int]
    parts: tuple[Part, ...]


def _causal_parts(j: int, c: int) -> tuple[Part, ...]:
    """Chunk ``j``'s queries: the prefix ``[0, j c)`` unmasked and the diagonal block causal."""
    diag = Part((j * c, (j + 1) * c), causal=True)
    return (Part((0, j * c)), diag) if j > 0 else (diag,)


def _document_parts(ids: torch.Tensor, j: int, c: int) -> tuple[Part, ...]:
    """Chunk ``j``'s queries of one sequence (``ids [S]``: its document ids): the first query's document's part
    of the prefix for the queries in that document, and the diagonal block under the document mask."""
    lo, hi = j * c, (j + 1) * c
    q_ids = ids[lo:hi]
    allowed = (q_ids[:, None] == q_ids[None, :]) & torch.ones(c, c, dtype=torch.bool, device=ids.device).tril()
    bias = torch.zeros(c, c, device=ids.device).masked_fill(~allowed, float("-inf"))
    parts = (Part((lo, hi), bias=bias[None, None]),)
    start = int(torch.searchsorted(ids[:lo], ids[lo : lo + 1])) if lo > 0 else lo  # that document's first token
    if start < lo:
        parts = (Part((start, lo), rows=(q_ids == ids[lo])[None]), *parts)
    return parts


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: ContextMask) -> torch.Tensor:
    """Attention of this rank's queries ``q [B, H, 2c, D]`` over the whole sequence ``k, v [B, H, S, D]``."""
    return _ContextAttention.apply(q, k, v, mask.blocks)


class _ContextAttention(torch.autograd.Function):
    """Forward: each block's parts through the fused kernel with its log-sum-exp, merged; backward: each part's
    kernel backward at the merged output and log-sum-exp, into one ``dQ, dK, dV`` (module docstring)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: tuple[Block, ...]) -> torch.Tensor:
        out, outs, lses = torch.empty_like(q), [], []
        for b in blocks:
            (q0, q1), rows = b.queries, b.rows
            o, lse = _block_forward(q[rows, :, q0:q1], k[rows], v[rows], b.parts)
            out[rows, :, q0:q1] = o
            outs.append(o)
            lses.append(lse)
        ctx.blocks = blocks
        ctx.save_for_backward(q, k, v, *outs, *lses)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, *saved = ctx.saved_tensors
        n = len(ctx.blocks)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for b, o, lse in zip(ctx.blocks, saved[:n], saved[n:]):
            (q0, q1), rows = b.queries, b.rows
            g = grad[rows, :, q0:q1].contiguous()
            dq[rows, :, q0:q1] = _block_backward(
                g, q[rows, :, q0:q1], k[rows], v[rows], o, lse, b.parts, dk[rows], dv[rows]
            )
        return dq, dk, dv, None


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, parts: tuple[Part, ...]):
    """One block's merged output and log-sum-exp: ``out = sum_i exp(lse_i - lse) out_i``."""
    outs, lses = [], []
    for p in parts:
        (lo, hi), bias = p.keys, None if p.bias is None else p.bias.to(q.dtype)
        out, lse = kernels(q.device).forward(q, k[:, :, lo:hi], v[:, :, lo:hi], p.causal, bias)
        if p.rows is not None:
            lse = lse.masked_fill(~p.rows[:, None, :], float("-inf"))
        outs.append(out)
        lses.append(lse)
    lse = torch.logsumexp(torch.stack(lses), 0)  # the kernels' dtype: fp32 (fp64 for fp64 inputs)
    out = sum((part - lse).exp()[..., None] * o.to(lse.dtype) for part, o in zip(lses, outs)).to(q.dtype)
    return out, lse


def _block_backward(g, q, k, v, out, lse, parts: tuple[Part, ...], dk: torch.Tensor, dv: torch.Tensor):
    """One block's query gradient; its parts' key and value gradients are added into ``dk``, ``dv`` (views)."""
    dq = torch.zeros_like(q, dtype=lse.dtype)
    for p in parts:
        gp, part_lse = g, lse
        if p.rows is not None:  # queries that do not see the part: no gradient through it
            gp = g * p.rows[:, None, :, None].to(g.dtype)
            part_lse = lse.masked_fill(~p.rows[:, None, :], float("inf"))
        (lo, hi), bias = p.keys, None if p.bias is None else p.bias.to(q.dtype)
        dq_i, dk_i, dv_i = kernels(q.device).backward(
            gp, q, k[:, :, lo:hi], v[:, :, lo:hi], out, part_lse, p.causal, bias
        )
        dq += dq_i.to(dq.dtype)
        dk[:, :, lo:hi] += dk_i
        dv[:, :, lo:hi] += dv_i
    return dq.to(q.dtype)


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
