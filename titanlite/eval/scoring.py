"""Log-likelihood scoring of benchmark tasks, batched and spread over data-parallel ranks.

Every (context, choice) pair of every item is one *request*: the context's tokens with BOS first
(``tokenizer.encode(context, bos=True)``) followed by the choice's (``tokenizer.encode(choice)``),
encoded separately, which are the ids a Hugging Face model gets in the tests. One forward pass on
the request gives the log-probability of each choice token given everything before it; the
request's score is their sum (``loglik``), plus whether each one was the argmax (``greedy``,
LAMBADA's accuracy).

Batches: the requests of all tasks are sorted longest first (ties in request order) and cut into
fixed batches of ``batch_size``, right-padded (causal attention never lets a real position see
the padding). This order does not depend on the number of ranks, and batch ``i`` goes to rank
``i % dp_world``, so every request is computed in exactly the same batch, hence with bitwise the
same result, on any number of ranks. Tensor-parallel ranks of one data-parallel rank pass the same
``dp_rank`` and compute the same batches. A sharded model (FSDP, TP) needs every rank in every
forward pass, so a rank with fewer batches than the others runs a dummy one. The results are
gathered to every rank (``all_gather_object`` over ``dp_group``).

Requests longer than ``max_seq_len + 1`` tokens (the model reads all but the last token) lose
tokens from the left of their context, as lm-evaluation-harness does; their number is logged and
reported per task as ``num_truncated`` (items with at least one truncated choice).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite import dtypes
from titanlite.eval.tasks import Item, Task, get_task

logger = logging.getLogger(__name__)

# Padded batch lengths are rounded up to a multiple of this (capped at max_seq_len): fewer distinct
# shapes for GPU kernels, and sequence lengths a tensor-parallel (sequence-parallel) degree divides.
PAD_MULTIPLE = 8


@dataclasses.dataclass
class Request:
    """One (context, choice) pair: ``tokens`` (context + choice, left-truncated to fit) of which the
    last ``num_cont`` are the choice's."""

    task: int
    item: int
    choice: int
    tokens: list[int]
    num_cont: int
    truncated: bool


def evaluate(
    model: nn.Module,
    tokenizer: Any,
    tasks: Sequence[str],
    data_dir: str | os.PathLike,
    *,
    limit: int | None = None,
    batch_size: int = 16,
    max_seq_len: int | None = None,
    device: str | torch.device | None = None,
    dp_rank: int = 0,
    dp_world: int = 1,
    dp_group: dist.ProcessGroup | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, dict]:
    """Score ``tasks`` (registered names) on the first ``limit`` items of each (all when None).

    Returns ``{task: {metric: value, ..., "num_items", "num_truncated", "items": [record, ...]}}``
    on every rank. Each record (see :mod:`titanlite.eval.tasks`) is ``{"index": item index in the
    file, "label": the right choice, "loglik": [summed log-prob of each choice's tokens],
    "num_tokens": [number of tokens of each choice], "pred": argmax of loglik, "pred_norm": argmax of
    loglik / num_tokens}``; for LAMBADA there is one choice, ``label`` is 1 and ``pred`` is 1 when
    greedy decoding reproduces the target. ``max_seq_len`` defaults to the model's
    ``args.max_seq_len`` (no limit for a model without one). ``device`` defaults to the model's.
    Collective when ``dp_world > 1`` or the model is sharded: every rank calls it with the same arguments
    but its own ``dp_rank``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be at least 0, got {limit}")
    if not 0 <= dp_rank < dp_world:
        raise ValueError(f"dp_rank {dp_rank} is not in range for dp_world {dp_world}")
    if repeated := sorted({name for name in tasks if list(tasks).count(name) > 1}):
        raise ValueError(f"eval task {repeated[0]!r} is given more than once")
    chosen = [get_task(name) for name in tasks]
    loaded = [task.items(data_dir)[:limit] for task in chosen]
    if max_seq_len is None:
        max_seq_len = getattr(getattr(model, "args", None), "max_seq_len", None)
    requests = build_requests(loaded, tokenizer, max_seq_len)
    device = torch.device(device) if device is not None else _model_device(model)
    scorer = _Scorer(model, device, autocast_dtype, max_seq_len)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            scores = score_requests(scorer, requests, batch_size, dp_rank, dp_world, dp_group)
    finally:
        model.train(was_training)
    return _results(chosen, loaded, requests, scores, max_seq_len)


def build_requests(loaded: Sequence[Sequence[Item]], tokenizer: Any, max_seq_len: int | None) -> list[Request]:
    """One request per (task, item, choice), in that order, each fitting ``max_seq_len`` input tokens."""
    requests = []
    for t, items in enumerate(loaded):
        for i, item in enumerate(items):
            context = tokenizer.encode(item.context, bos=True)
            for c, choice in enumerate(item.choices):
                cont = tokenizer.encode(choice)
                requests.append(_fit(Request(t, i, c, context + cont, len(cont), False), max_seq_len))
    return requests


def _fit(request: Request, max_seq_len: int | None) -> Request:
    """``request`` with its context cut from the left so that its input (all tokens but the last) has at
    most ``max_seq_len`` tokens; at least one context token stays, to predict the first choice token."""
    if max_seq_len is None or len(request.tokens) <= max_seq_len + 1:
        return request
    if request.num_cont > max_seq_len:
        raise ValueError(
            f"item {request.item} choice {request.choice}: its {request.num_cont} tokens do not fit "
            f"max_seq_len {max_seq_len} with any context"
        )
    return dataclasses.replace(request, tokens=request.tokens[-(max_seq_len + 1) :], truncated=True)


def canonical_batches(requests: Sequence[Request], batch_size: int) -> list[list[int]]:
    """Request indices, longest first (ties in request order), cut into batches of ``batch_size``:
    the same batches whatever the number of ranks."""
    order = sorted(range(len(requests)), key=lambda i: (-len(requests[i].tokens), i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def score_requests(
    scorer: _Scorer,
    requests: Sequence[Request],
    batch_size: int,
    dp_rank: int = 0,
    dp_world: int = 1,
    dp_group: dist.ProcessGroup | None = None,
) -> dict[int, tuple[float, bool]]:
    """``{request index: (summed log-prob of its continuation, every continuation token greedy)}`` for
    every request, on every rank; this rank computes batches ``dp_rank, dp_rank + dp_world, ...``."""
    batches = canonical_batches(requests, batch_size)
    mine = batches[dp_rank::dp_world]
    local: dict[int, tuple[float, bool]] = {}
    for batch in mine:
        local.update(zip(batch, scorer.score([requests[i] for i in batch])))
    for _ in range(math.ceil(len(batches) / dp_world) - len(mine)):
        scorer.dummy([requests[i] for i in batches[-1]])  # a sharded model needs every rank in every forward
    if dp_world == 1:
        return local
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"dp_world={dp_world} needs torch.distributed to be initialized")
    gathered: list[Any] = [None] * dp_world
    dist.all_gather_object(gathered, local, group=dp_group)
    return {k: v for part in gathered for k, v in part.items()}


class _Scorer:
    """Runs padded batches of requests through the model and reads off the continuation log-probs."""

    def __init__(self, model: nn.Module, device: torch.device, autocast_dtype: torch.dtype | None, max_len: int | None):
        self.model, self.device, self.autocast_dtype, self.max_len = model, device, autocast_dtype, max_len
        args = getattr(model, "args", None)
        self.document_ids = getattr(args, "attn_mask_type", "causal") == "block_causal"

    def _padded_len(self, longest: int) -> int:
        padded = -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE
        return min(padded, self.max_len) if self.max_len is not None else padded

    def _forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Full (not vocabulary-sharded) logits; fp32 comes later, on the few positions that are scored."""
        kwargs = {"document_ids": torch.zeros_like(inputs)} if self.document_ids else {}
        with dtypes.autocast(self.device.type, self.autocast_dtype):
            logits = self.model(inputs, **kwargs)
        return logits.full_tensor() if isinstance(logits, DTensor) else logits

    def _inputs(self, requests: Sequence[Request]) -> torch.Tensor:
        length = self._padded_len(max(len(r.tokens) - 1 for r in requests))
        inputs = torch.zeros(len(requests), length, dtype=torch.long)
        for row, r in enumerate(requests):
            inputs[row, : len(r.tokens) - 1] = torch.tensor(r.tokens[:-1])
        return inputs.to(self.device)

    def score(self, requests: Sequence[Request]) -> list[tuple[float, bool]]:
        logits = self._forward(self._inputs(requests))
        rows, cols, targets = [], [], []
        for row, r in enumerate(requests):
            n, end = r.num_cont, len(r.tokens) - 1  # input position p predicts token p + 1
            rows += [row] * n
            cols += range(end - n, end)
            targets += r.tokens[-n:]
        picked = logits[torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device)].float()
        target = torch.tensor(targets, device=self.device)
        logprobs = torch.log_softmax(picked, dim=-1).gather(1, target[:, None]).squeeze(1)
        greedy = picked.argmax(dim=-1) == target
        sizes = [r.num_cont for r in requests]
        sums = [float(s.sum()) for s in logprobs.double().cpu().split(sizes)]
        alls = [bool(g.all()) for g in greedy.cpu().split(sizes)]
        return list(zip(sums, alls))

    def dummy(self, requests: Sequence[Request]) -> None:
        self._forward(self._inputs(requests))


def _model_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    if param is None:
        return torch.device("cpu")
    return param.to_local().device if isinstance(param, DTensor) else param.device


def _results(
    chosen: Sequence[Task],
    loaded: Sequence[Sequence[Item]],
    requests: Sequence[Request],
    scores: dict[int, tuple[float, bool]],
    max_seq_len: int | None,
) -> dict[str, dict]:
    """Per task: the records of its items (in file order) and the metrics computed from them."""
    per_item: dict[tuple[int, int], list[int]] = {}
    for k, r in enumerate(requests):
        per_item.setdefault((r.task, r.item), []).append(k)
    out = {}
    for t, (task, items) in enumerate(zip(chosen, loaded)):
        records, truncated = [], 0
        for i, item in enumerate(items):
            ks = per_item[(t, i)]
            truncated += any(requests[k].truncated for k in ks)
            loglik, greedy = [scores[k][0] for k in ks], [scores[k][1] for k in ks]
            records.append(task.record(i, item, loglik, [requests[k].num_cont for k in ks], greedy))
        if truncated:
            logger.warning(
                "%s: %d of %d items truncated from the left to max_seq_len %s",
                task.name,
                truncated,
                len(items),
                max_seq_len,
            )
        else:
            logger.info("%s: %d items, none truncated", task.name, len(items))
        out[task.name] = {**task.metrics(records), "num_truncated": truncated, "items": records}
    return out
