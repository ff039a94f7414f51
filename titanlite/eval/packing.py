"""What a scoring batch runs: requests grouped by shared context, groups cut into batches, and each batch's padded
tensors built once and sent to the device in one copy.

With the cache protocol, an item's requests that share their context form one group when that saves enough
(``MIN_SAVING``): :func:`cached_batch` fills a KV cache with the left-padded contexts, copies its rows once per
choice (:meth:`~titanlite.models.kv_cache.KVCache.select`) and runs each choice on top, so every token is still
predicted from exactly what precedes it in its own request. Otherwise a group is one request, a right-padded row
of a plain causal forward (:func:`plain_batch`). A batch holds groups of one kind; truncated requests form their own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

# Padded lengths are rounded up to a multiple of this (capped at max_seq_len): fewer distinct shapes
# for GPU kernels and compiled graphs, and lengths a tensor-parallel (sequence-parallel) degree divides.
PAD_MULTIPLE = 8
FILLER = 0  # the token in padded slots (never attended to by a real token, any valid id would do)
MIN_SAVING = 1.5  # share a context only when its requests alone would run this many times the tokens


@dataclasses.dataclass
class Group:
    """Requests (indices) that continue one ``context`` with their ``continuations``."""

    context: list[int]
    requests: list[int] = dataclasses.field(default_factory=list)
    continuations: list[list[int]] = dataclasses.field(default_factory=list)

    @property
    def shared(self) -> bool:
        return len(self.requests) > 1

    @property
    def longest(self) -> int:
        """The longest input of its requests (all their tokens but the last)."""
        return len(self.context) + max(len(c) for c in self.continuations) - 1


def group_requests(requests: Sequence[Any], share_context: bool) -> list[Group]:
    """The groups of ``requests`` (``.task``, ``.item``, ``.tokens``, ``.num_cont``), in request order:
    those of one item with the same context tokens together when ``share_context`` and when that runs at
    most ``1 / MIN_SAVING`` of their tokens (HellaSwag, ARC: yes; PIQA's short goals, LAMBADA's single
    choice: no), else one group per request."""
    groups: dict[Any, Group] = {}
    for index, r in enumerate(requests):
        context = r.tokens[: -r.num_cont]
        group = groups.setdefault((r.task, r.item, tuple(context)) if share_context else index, Group(context))
        group.requests.append(index)
        group.continuations.append(r.tokens[-r.num_cont :])
    out = []
    for g in groups.values():
        alone = sum(len(g.context) + len(c) - 1 for c in g.continuations)
        if len(g.requests) > 1 and alone >= MIN_SAVING * (len(g.context) + sum(len(c) - 1 for c in g.continuations)):
            out.append(g)
        else:
            out += [Group(g.context, [r], [c]) for r, c in zip(g.requests, g.continuations)]
    return out


def canonical_batches(groups: Sequence[Group], batch_size: int) -> list[list[int]]:
    """Group indices cut into batches of at most ``batch_size`` requests (a bigger group alone): the
    single requests first, longest first, then the shared contexts, longest continuation first (then
    longest context: the continuations' pass, over a batch's every request, pads the most), ties in group
    order. A batch is of one kind; the batches are the same whatever the number of ranks."""

    def rank(i: int) -> tuple:
        g = groups[i]
        longest = max(len(c) for c in g.continuations) if g.shared else g.longest
        return g.shared, -longest, -len(g.context), i

    batches: list[list[int]] = []
    size, kind = batch_size, None
    order = sorted(range(len(groups)), key=rank)
    for i in order:
        n = len(groups[i].requests)
        if size + n > batch_size or groups[i].shared != kind:
            batches.append([])
            size, kind = 0, groups[i].shared
        batches[-1].append(i)
        size += n
    return batches


def padded_len(longest: int, max_len: int) -> int:
    return min(-(-longest // PAD_MULTIPLE) * PAD_MULTIPLE, max_len)


class HostBatch:
    """Named int64 arrays of one batch, held as one host tensor; :meth:`to` copies it in one transfer."""

    def __init__(self, requests: list[int], **parts: tuple[list[int], tuple[int, ...]]):
        self.requests = requests  # the batch's request indices; ``owners`` index this list
        self.shapes = {name: shape for name, (_, shape) in parts.items()}
        self.data = torch.tensor([v for values, _ in parts.values() for v in values], dtype=torch.long)

    def to(self, device: torch.device) -> dict[str, torch.Tensor]:
        data = self.data.pin_memory() if device.type == "cuda" else self.data
        data, out, start = data.to(device, non_blocking=True), {}, 0
        for name, shape in self.shapes.items():
            size = 1
            for n in shape:
                size *= n
            out[name] = data[start : start + size].view(shape).clone()  # its own tensor, not a view (compile)
            start += size
        return out


def cached_batch(groups: Sequence[Group], max_len: int) -> HostBatch:
    """Two passes through a KV cache (see the module docstring): ``context [G, C]`` (left-padded, with
    ``pad [G]``), ``continued [R, X]`` (each request's tokens but the last, right-padded; at least one
    ``PAD_MULTIPLE`` of filler, so that every batch runs both passes on every rank),
    ``group_of [R]`` (the context row each request continues), ``first [R]`` (each request's first token,
    scored from its context's last logits), and for its other tokens ``index`` (row * X + column of the
    predicting token in ``continued``), ``targets`` and ``owners`` (the request, 0..R-1)."""
    width = padded_len(max(len(g.context) for g in groups), max_len)
    longest = max(len(c) - 1 for g in groups for c in g.continuations)
    span = max(padded_len(longest, max_len), PAD_MULTIPLE)  # never empty: every batch runs both passes
    context, pad, continued, group_of, first = [], [], [], [], []
    index, targets, owners = [], [], []
    for g, group in enumerate(groups):
        pad.append(width - len(group.context))
        context += [FILLER] * pad[-1] + group.context
        for cont in group.continuations:
            row = len(first)
            group_of.append(g)
            first.append(cont[0])
            continued += cont[:-1] + [FILLER] * (span - len(cont) + 1)
            for j, target in enumerate(cont[1:]):
                index.append(row * span + j)
                targets.append(target)
                owners.append(row)
    return HostBatch(
        [r for group in groups for r in group.requests],
        context=(context, (len(groups), width)),
        pad=(pad, (len(groups),)),
        continued=(continued, (len(first), span)),
        group_of=(group_of, (len(first),)),
        first=(first, (len(first),)),
        index=(index, (len(index),)),
        targets=(targets, (len(index),)),
        owners=(owners, (len(index),)),
    )


def plain_batch(groups: Sequence[Group], max_len: int) -> HostBatch:
    """One right-padded row per request (groups of one): ``tokens [R, L]``; for each continuation token
    ``index`` (row * L + column of the token predicting it), ``targets`` and ``owners`` (its row)."""
    width = padded_len(max(g.longest for g in groups), max_len)
    tokens, index, targets, owners = [], [], [], []
    for row, group in enumerate(groups):
        (cont,) = group.continuations
        ids = group.context + cont[:-1]
        tokens += ids + [FILLER] * (width - len(ids))
        for j, target in enumerate(cont):
            index.append(row * width + len(group.context) - 1 + j)
            targets.append(target)
            owners.append(row)
    return HostBatch(
        [group.requests[0] for group in groups],
        tokens=(tokens, (len(groups), width)),
        index=(index, (len(index),)),
        targets=(targets, (len(index),)),
        owners=(owners, (len(index),)),
    )
