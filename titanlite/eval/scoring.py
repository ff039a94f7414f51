"""Log-likelihood scoring of benchmark tasks, batched and spread over data-parallel ranks (what it computes, and how
a request longer than ``max_seq_len + 1`` is cut: docs/evaluation.md, "Downstream evaluation").

A *request* is one (context, choice) pair: its score is the summed log-probability of the choice's tokens after the
context's (``loglik``), and whether each was the argmax (``greedy``). Batches (:mod:`titanlite.eval.packing`) come in
an order that does not depend on the number of ranks and go round-robin to the ranks, so a request's result is
bitwise the same on any number of ranks; a rank with fewer batches of a kind runs dummy ones (a sharded model needs
every rank in every forward), and the results are gathered to every rank of ``dp_group``. A batch goes to the
device in one copy and its results come back in one, read after the next batch is queued. ``compile=True``: dynamic
shapes, one graph for every padded length.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.errors import CheckpointError, DataError, UsageError
from titanlite.eval.packing import PAD_MULTIPLE, Group, cached_batch, canonical_batches, group_requests, plain_batch
from titanlite.eval.tasks import Item, Task, get_task
from titanlite.models.kv_cache import KVCache, supports_cache
from titanlite.utils import torch_compat

if TYPE_CHECKING:  # imported when called: titanlite.trainer imports this package
    from titanlite.trainer.runtime import Runtime

logger = logging.getLogger(__name__)

__all__ = ["PAD_MULTIPLE", "Request", "build_requests", "evaluate", "score_requests"]


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
    runtime: Runtime | None = None,
    compile: bool = False,
) -> dict[str, dict]:
    """Score ``tasks`` (registered names) on the first ``limit`` items of each (all when None).

    Returns ``{task: {metric: value, ..., "num_items", "num_truncated", "items": [record, ...]}}``
    on every rank. Each record (see :mod:`titanlite.eval.tasks`) is ``{"index": item index in the
    file, "label": the right choice, "loglik": [summed log-prob of each choice's tokens],
    "num_tokens": [number of tokens of each choice], "pred": argmax of loglik, "pred_norm": argmax of
    loglik / num_tokens}``; for LAMBADA there is one choice, ``label`` is 1 and ``pred`` is 1 when
    greedy decoding reproduces the target. ``max_seq_len`` (the longest input the model takes) defaults
    to the model's ``args.max_seq_len``; a model without one needs it given. ``batch_size``: requests
    per batch (at most that many sequences per forward pass). ``runtime``
    (:class:`~titanlite.trainer.runtime.Runtime`): the device, the compute dtype (autocast) and the data-parallel
    ranks that share the items (its parallel dims; default: one process on the model's device, no autocast).
    ``compile``: see the module docstring. Collective when there are several data-parallel ranks or the model is
    sharded: every rank calls it with the same arguments."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be at least 0, got {limit}")
    if repeated := sorted({name for name in tasks if list(tasks).count(name) > 1}):
        raise UsageError(f"eval task {repeated[0]!r} is given more than once")
    if max_seq_len is None:
        max_seq_len = getattr(getattr(model, "args", None), "max_seq_len", None)
    if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len < 1:
        raise UsageError(
            f"evaluate: the longest input {type(model).__name__} takes is unknown (it has no args.max_seq_len): "
            "pass max_seq_len=N (longer requests are cut from the left)"
        )
    chosen = [get_task(name) for name in tasks]
    loaded = [task.items(data_dir)[:limit] for task in chosen]
    requests = build_requests(loaded, tokenizer, max_seq_len, [task.name for task in chosen])
    from titanlite.trainer.runtime import Runtime

    scorer = _Scorer(model, runtime or Runtime.of(model), max_seq_len, compile)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            scores = score_requests(scorer, requests, batch_size)
    finally:
        model.train(was_training)
    return _results(chosen, loaded, requests, scores, max_seq_len)


def build_requests(
    loaded: Sequence[Sequence[Item]], tokenizer: Any, max_seq_len: int, task_names: Sequence[str] = ()
) -> list[Request]:
    """One request per (task, item, choice), in that order, each fitting ``max_seq_len`` input tokens
    (:func:`_fit`). ``task_names``: the tasks' names, for messages. A choice that encodes to no token is a
    one-line ValueError naming its task, item and choice."""
    requests = []
    for t, items in enumerate(loaded):
        for i, item in enumerate(items):
            context = tokenizer.encode(item.context, bos=_context_prefix(tokenizer, item.context))
            for c, choice in enumerate(item.choices):
                cont = tokenizer.encode(choice)
                if not cont:
                    task = task_names[t] if t < len(task_names) else f"task {t}"
                    raise DataError(f"{task}: item {i} choice {c} ({choice!r:.40}) encodes to no token to score")
                requests.append(_fit(Request(t, i, c, context + cont, len(cont), False), max_seq_len))
    return requests


def _context_prefix(tokenizer: Any, context: str) -> bool:
    """Whether the context gets the tokenizer's ``bos_id`` in front, as in lm-evaluation-harness's HF backend: a
    tokenizer with a BOS adds it; one without (``has_bos`` False, Qwen3) adds nothing, except that an empty
    context is scored after its ``bos_id`` (then the EOS id, lm-eval's ``prefix_token_id``)."""
    return getattr(tokenizer, "has_bos", True) or not context


def _fit(request: Request, max_seq_len: int) -> Request:
    """``request`` cut from the left as lm-evaluation-harness cuts it (the module docstring): its last
    ``max_seq_len + 1`` tokens, of which the choice's are scored (at most ``max_seq_len``: a window's first token
    is read, never predicted)."""
    if len(request.tokens) <= max_seq_len + 1:
        return request
    window = request.tokens[-(max_seq_len + 1) :]
    return dataclasses.replace(request, tokens=window, num_cont=min(request.num_cont, max_seq_len), truncated=True)


def score_requests(scorer: _Scorer, requests: Sequence[Request], batch_size: int) -> dict[int, tuple[float, bool]]:
    """``{request index: (summed log-prob of its continuation, every continuation token greedy)}`` for
    every request, on every rank; data-parallel rank ``r`` of ``n`` (the scorer's runtime) computes batches
    ``r, r + n, ...`` of each kind (single requests: one forward pass each; shared contexts: two), so that every
    rank runs the same forward passes. Each batch's results are read after the next batch is queued (the device
    never waits for the host)."""
    dp_rank, dp_world, dp_group = scorer.runtime.dp_rank, scorer.runtime.dp_degree, scorer.runtime.dp_group
    groups = group_requests(requests, share_context=scorer.cached)
    batches = canonical_batches(groups, batch_size)
    local: dict[int, tuple[float, bool]] = {}
    pending: _Pending | None = None
    for shared in (False, True):  # a sharded model needs every rank in every forward: one kind at a time
        of_kind = [b for b in batches if groups[b[0]].shared == shared]
        mine = of_kind[dp_rank::dp_world]
        for batch in mine:
            queued = scorer.launch([groups[i] for i in batch])
            if pending is not None:
                local.update(pending.read())
            pending = queued
        for _ in range(math.ceil(len(of_kind) / dp_world) - len(mine)):  # so that every rank runs as many
            scorer.launch([groups[i] for i in of_kind[-1]])
    if pending is not None:
        local.update(pending.read())
    if dp_world == 1:
        return local
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"dp_world={dp_world} needs torch.distributed to be initialized")
    gathered: list[Any] = [None] * dp_world
    dist.all_gather_object(gathered, local, group=dp_group)
    return {k: v for part in gathered for k, v in part.items()}


def _forward(model: nn.Module, tokens: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    return model(tokens, **kwargs)


@functools.cache
def compiled_forward() -> Callable[..., torch.Tensor]:
    """``model(tokens, **kwargs)`` under ``torch.compile`` with dynamic shapes: one graph for every batch shape.
    Sizes are not "duck-typed" (a batch of 2 rows would otherwise be tied to the model's 2 key/value heads, and
    specialized to it) nor specialized at 1, where this torch has those switches."""
    compiled = torch.compile(_forward, dynamic=True)
    config = torch_compat.fx_config()
    switches = {k: v for k, v in (("use_duck_shape", False), ("backed_size_oblivious", True)) if hasattr(config, k)}

    @functools.wraps(_forward)
    def generic_shapes(*args, **kwargs):
        with config.patch(**switches):
            return compiled(*args, **kwargs)

    return generic_shapes


class _Pending:
    """A batch's results on their way to the host: ``[2, R]`` (summed log-probs, greedy misses) per request."""

    def __init__(self, result: torch.Tensor, requests: list[int]):
        self.requests = requests
        if result.device.type == "cuda":  # copied as soon as computed, read later
            self.host = torch.empty(result.shape, dtype=result.dtype, pin_memory=True)
            self.host.copy_(result, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host, self.ready = result, None

    def read(self) -> dict[int, tuple[float, bool]]:
        if self.ready is not None:
            self.ready.synchronize()
        sums, misses = self.host.tolist()  # the batch's one device-to-host read
        return {r: (s, m == 0) for r, s, m in zip(self.requests, sums, misses)}


class _Scorer:
    """Runs batches of request groups through the model and gathers their tokens' log-probs on the device:
    through a KV cache, contexts once (:func:`~titanlite.eval.packing.cached_batch`), when the model
    speaks the cache protocol, else one plain row per request (:func:`~titanlite.eval.packing.plain_batch`)."""

    def __init__(self, model: nn.Module, runtime: Runtime, max_len: int, compile: bool):
        self.model, self.runtime, self.device, self.max_len = model, runtime, runtime.device, max_len
        args = getattr(model, "args", None)  # any module can be scored; attn_mask_type is optional for a family too
        self.document_ids = getattr(args, "attn_mask_type", "causal") == "block_causal"
        self.cached = supports_cache(model)
        if compile and any(isinstance(p, DTensor) for p in model.parameters()):
            logger.warning("eval: compile ignored: the model is sharded (FSDP / tensor parallel); scoring eagerly")
            compile = False
        self.forward = compiled_forward() if compile else _forward
        self.layout: dict = {}  # the cache buffers' shapes and dtypes, known after the first batch

    def logits(self, tokens: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        """Whole (not vocabulary-sharded) logits ``[B, S, V]``, in the forward's dtype: through ``cache``, or
        plainly (causal) without one (the first batch's first pass eagerly: it allocates the cache buffers whose
        layout the others reuse)."""
        from titanlite.trainer.runtime import forward_logits  # see the TYPE_CHECKING import

        eager = cache is not None and not self.layout
        kwargs = {"cache": cache} if cache is not None else self.plain_kwargs(tokens)
        forward = functools.partial(_forward if eager else self.forward, self.model)
        return forward_logits(self.model, self.runtime, tokens, forward, **kwargs)

    def plain_kwargs(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """A plain causal row's forward arguments: one document per row for a block-causal model."""
        return {"document_ids": torch.zeros_like(tokens)} if self.document_ids else {}

    def launch(self, groups: Sequence[Group]) -> _Pending:
        """Queue one batch: its forward passes and the gather of its requests' summed log-probs."""
        cached = groups[0].shared  # a batch is of one kind (canonical_batches)
        host = cached_batch(groups, self.max_len) if cached else plain_batch(groups, self.max_len)
        b = host.to(self.device)
        if cached:
            context, continued = b["context"], b["continued"]
            cache = KVCache(context.shape[1] + continued.shape[1], b["pad"], device=self.device)
            cache.allocate(self.layout)  # the first batch's layout: later batches' compiled graphs never allocate
            picked = self.logits(context, cache)[:, -1][b["group_of"]]  # scores each request's first token
            self.layout = self.layout or cache.layout()
            cache.advance(context.shape[1])
            later = self.logits(continued, cache.select(b["group_of"])).flatten(0, 1)[b["index"]]
            picked, targets = torch.cat([picked, later]), torch.cat([b["first"], b["targets"]])
            owners = torch.cat([torch.arange(len(b["first"]), device=picked.device), b["owners"]])
        else:
            picked = self.logits(b["tokens"], None).flatten(0, 1)[b["index"]]
            targets, owners = b["targets"], b["owners"]
        picked = picked.float()  # [N, V]: only the scored positions in fp32
        logprobs = torch.log_softmax(picked, dim=-1).gather(1, targets[:, None]).squeeze(1)
        missed = picked.argmax(dim=-1) != targets
        result = torch.zeros(2, len(host.requests), dtype=torch.float64, device=picked.device)
        result[0].index_add_(0, owners, logprobs.double())
        result[1].index_add_(0, owners, missed.double())
        return _Pending(result, host.requests)


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
            if not all(math.isfinite(x) for x in loglik):
                raise CheckpointError(
                    f"{task.name}: item {i} has a non-finite log-likelihood ({loglik}); expected finite scores: "
                    "the model's outputs are not finite (check its weights)"
                )
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
