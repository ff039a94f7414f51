"""Text generation from a titanlite decoder: greedy or sampled, with a KV cache, on one process or on every rank of
a sharded model (docs/evaluation.md, "Generation"; the command line's arguments: :mod:`titanlite.generate.cli`).

No host read per token: finished rows run on with the batch until the host reads the stop state every
``STOP_CHECK_EVERY`` tokens. On a sharded model every rank of ``sync_group`` runs every forward and the first rank
broadcasts the next tokens; under tensor parallelism each forward is right-padded with filler to a multiple of the
TP degree. Eager steps run under ``force_eager``: per-block compiled models do not recompile per sequence length.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.errors import UsageError
from titanlite.generate.sampling import check_sampling, sample_next
from titanlite.models.kv_cache import KVCache, supports_cache

logger = logging.getLogger(__name__)

FILLER = 0  # the token in a left-padded row's empty slots (masked out, any valid id would do)
STOP_CHECK_EVERY = 16  # decode steps between the host's reads of the stop state (the only reads until the end)
CACHE_BUCKET = 64  # a compiled request's cache length is rounded up to a multiple of this


# ----------------------------------------------------------------------------- generation


def generate(
    model: nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    sync_group: dist.ProcessGroup | None = None,
    use_cache: bool = True,
    compile: bool = False,
    context_window: int | None = None,
    trained_seq_len: int | None = None,
) -> list[list[int]]:
    """Each prompt's completion ids (at most ``max_new_tokens``; ending with the EOS id that stopped it, if one did).
    ``device`` defaults to the model's, ``sync_group`` to the world when torch.distributed is initialized; sampling
    without a ``generator`` uses a fresh one seeded by the operating system (never the global RNG)."""
    check_sampling(temperature, top_k, top_p)
    check_request(model, prompts, max_new_tokens, sequence_multiple(model), context_window)
    if not prompts or max_new_tokens == 0:
        return [[] for _ in prompts]
    if context_window is not None:
        prompts = [p[-context_window:] for p in prompts]
    _warn_past_trained_length(prompts, max_new_tokens, context_window, trained_seq_len)
    if use_cache and not supports_cache(model):
        logger.warning("%s; generating without a KV cache", no_cache_reason(model))
        use_cache = False
    if compile and (reason := compile_refusal(model, use_cache)):
        logger.warning("compile ignored: %s; decoding eagerly", reason)
        compile = False
    device = torch.device(device) if device is not None else next(model.parameters()).device
    group = _default_group() if sync_group is None else sync_group
    if temperature > 0 and generator is None:
        generator = torch.Generator(device=device)
        generator.seed()
    steps = _steps(model, prompts, device, max_new_tokens, use_cache, compile, context_window)
    rows = len(prompts)
    out = torch.zeros(rows, max_new_tokens, dtype=torch.long, device=device)
    count = torch.zeros(rows, dtype=torch.long, device=device)  # tokens kept per row: up to its first stop id
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    stop = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=device)
    with torch.no_grad(), contextlib.ExitStack() as stack:
        if not compile:  # per-block compiled models run eagerly (no graph per sequence length)
            stack.enter_context(torch.compiler.set_stance("force_eager"))
        logits = steps.prefill()
        for step in range(max_new_tokens):
            ids = _agreed_next(logits, group, temperature, top_k, top_p, generator)
            out[:, step] = ids
            count += ~done
            done |= (ids[:, None] == stop[None, :]).any(dim=-1)
            if step == max_new_tokens - 1 or (step % STOP_CHECK_EVERY == 0 and done.all().item()):
                break
            logits = steps(ids)
    kept = torch.cat([count[:, None], out], dim=1).tolist()  # the one device-to-host copy of the tokens
    return [row[1 : 1 + row[0]] for row in kept]


def check_window(context_window: int | None) -> None:
    """One-line :class:`~titanlite.errors.UsageError` (a ValueError) unless ``context_window`` is None (no window)
    or an integer >= 1."""
    if context_window is not None and (
        isinstance(context_window, bool) or not isinstance(context_window, int) or context_window < 1
    ):
        raise UsageError(f"context_window must be an integer >= 1 (or None: no window), got {context_window!r}")


def check_request(
    model: nn.Module, prompts: list[list[int]], max_new_tokens: int, multiple: int, window: int | None = None
) -> None:
    """One-line :class:`~titanlite.errors.UsageError` (a ValueError) for a request the model cannot run (before any
    forward). ``multiple``: see :func:`sequence_multiple`; a forward may carry up to ``multiple - 1`` filler tokens
    after the real ones. ``window``: the context window, which bounds the longest forward."""
    check_window(window)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise UsageError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    # any module may be handed to generate, not only a registered family's: each member is checked if it has it
    if getattr(model, "tok_embeddings", True) is None or getattr(model, "output", True) is None:
        raise ValueError("generate needs a whole model, not a pipeline stage")
    check_prompt_types(prompts)
    args = getattr(model, "args", None)
    vocab, max_len = getattr(args, "vocab_size", None), getattr(args, "max_seq_len", None)
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise UsageError(f"prompt {i} is empty: a prompt needs at least one token (e.g. BOS)")
        if vocab is not None and not all(0 <= t < vocab for t in prompt):
            raise UsageError(f"prompt {i} has a token id outside the model's vocabulary [0, {vocab})")
        longest = len(prompt) + max_new_tokens if window is None else min(window, len(prompt) + max_new_tokens)
        if max_len is not None and longest + multiple - 1 > max_len:
            filler = f" + {multiple - 1} filler (tensor parallel)" if multiple > 1 else ""
            what = (
                f"context_window {window}"
                if window is not None and longest == window
                else (f"{len(prompt)} tokens + max_new_tokens {max_new_tokens}")
            )
            raise UsageError(f"prompt {i}: {what}{filler} exceed the model's max_seq_len {max_len}")


def _warn_past_trained_length(
    prompts: list[list[int]], max_new_tokens: int, window: int | None, trained_seq_len: int | None
) -> None:
    """One warning when the context of the last token predicted (a prompt plus the tokens before it, at most
    ``window``) is longer than the sequences the model was trained on."""
    longest = max(len(p) for p in prompts) + max_new_tokens - 1
    longest = longest if window is None else min(window, longest)
    if trained_seq_len is not None and longest > trained_seq_len:
        logger.warning(
            "the context reaches %d tokens, past the %d the model was trained on: samples beyond it degrade; "
            "slide a window no longer than that (context_window=%d, --context-window %d)",
            longest,
            trained_seq_len,
            trained_seq_len,
            trained_seq_len,
        )


def check_prompt_types(prompts: object) -> None:
    """TypeError naming the argument unless ``prompts`` is a list (or tuple) of lists of int token ids: a tensor of
    prompts, or float ids, would fail deep in the model."""
    if not isinstance(prompts, (list, tuple)):
        hint = " (a tensor of prompts: pass prompts.tolist())" if isinstance(prompts, torch.Tensor) else ""
        raise TypeError(f"generate: prompts must be a list of token-id lists, got {type(prompts).__name__}{hint}")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, list):
            raise TypeError(f"generate: prompts[{i}] must be a list of int token ids, got {type(prompt).__name__}")
        if bad := [t for t in prompt if not isinstance(t, int) or isinstance(t, bool)]:
            raise TypeError(f"generate: prompts[{i}] holds {bad[0]!r} ({type(bad[0]).__name__}); token ids are ints")


def no_cache_reason(model: nn.Module) -> str:
    """Why ``model`` generates without a KV cache (it lacks the protocol of :mod:`titanlite.models.kv_cache`)."""
    return (
        f"{type(model).__name__}.forward takes no cache argument (the protocol of titanlite.models.kv_cache), so "
        "every step recomputes the whole prefix"
    )


def compile_refusal(model: nn.Module, use_cache: bool = True) -> str | None:
    """Why ``generate(..., compile=True)`` decodes eagerly after all, or None when it compiles: the compiled
    step is the one-token step of a single-process model's KV cache (fixed shapes, captured once)."""
    if not use_cache or not supports_cache(model):
        return "without a KV cache every step runs a longer sequence (no fixed shape to compile once)"
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return "the model is sharded (FSDP / tensor parallel); the compiled decode step is for one process"
    return None


def _default_group() -> dist.ProcessGroup | None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def _last_logits(logits: torch.Tensor, index: int) -> torch.Tensor:
    """Position ``index``'s logits ``[B, V]`` in fp32, whole (tensor parallel may shard the vocabulary)."""
    last = logits[:, index]
    return (last.full_tensor() if isinstance(last, DTensor) else last).float()


def sequence_multiple(model: nn.Module) -> int:
    """What every forward's sequence length must be a multiple of: the tensor-parallel degree (titanlite's
    TP plan shards activations along the sequence, evenly: a 1-token step would leave a rank none), else 1.
    Found from the parameters' mesh dimension named ``tp`` (titanlite's ``ParallelDims`` names it so)."""
    for p in model.parameters():
        names = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
        if "tp" in names:
            return p.device_mesh.size(names.index("tp"))
    return 1


def _right_padded(tokens: torch.Tensor, multiple: int) -> torch.Tensor:
    """``tokens [B, S]`` with filler appended up to a multiple of ``multiple`` (causal: the real ones never see it)."""
    extra = -tokens.shape[1] % multiple
    return tokens if extra == 0 else torch.cat([tokens, tokens.new_full((tokens.shape[0], extra), FILLER)], dim=1)


def _agreed_next(logits, group, temperature, top_k, top_p, generator) -> torch.Tensor:
    """The next ids, chosen on the group's first rank and broadcast to the others (no host read)."""
    if group is None or dist.get_rank(group) == 0:
        ids = sample_next(logits, temperature, top_k, top_p, generator)
    else:
        ids = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    if group is not None:
        dist.broadcast(ids, src=dist.get_global_rank(group, 0), group=group)
    return ids


def _decode_step(model: nn.Module, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """One token per row through the cache: its fp32 logits ``[B, V]`` (what :func:`compiled_decode_step` compiles)."""
    return model(tokens, cache=cache)[:, -1].float()


@functools.cache
def compiled_decode_step(device_type: str) -> Callable[[nn.Module, torch.Tensor, KVCache], torch.Tensor]:
    """:func:`_decode_step` under ``torch.compile``: with CUDA graphs on CUDA (``reduce-overhead``). Its
    shapes are fixed for a request (static cache), so it is captured once and replayed. On CPU, inductor's
    pass that turns a one-row matmul into a fused multiply-and-sum is switched on: a batch of one reads
    the weights faster that way than through the BLAS call, and reading them bounds the step
    (docs/benchmarks.md, "Generation")."""
    if device_type == "cuda":
        return torch.compile(_decode_step, mode="reduce-overhead", dynamic=False)
    return torch.compile(_decode_step, dynamic=False, options={"post_grad_fusion_options": {"decompose_mm_pass": {}}})


class _CachedSteps:
    """Model forwards through a static KV cache: the left-padded prompts (eager), then one token per row."""

    def __init__(self, model: nn.Module, prompts: list[list[int]], device: torch.device, new: int, compile: bool):
        longest = max(len(p) for p in prompts)
        pad = [longest - len(p) for p in prompts]
        self.model, self.multiple, self.cuda = model, sequence_multiple(model), device.type == "cuda"
        self.prompts = torch.tensor([[FILLER] * n + p for n, p in zip(pad, prompts)], device=device)
        slots = longest + new + self.multiple - 1
        if compile:  # lengths in buckets: a request of a similar length reuses the compiled step
            slots = -(-slots // CACHE_BUCKET) * CACHE_BUCKET
        self.cache = KVCache(slots, pad, device=device, static_addresses=compile and self.cuda)
        self.compiled = compiled_decode_step(device.type) if compile else None

    def prefill(self) -> torch.Tensor:
        with torch.compiler.set_stance("force_eager"):
            logits = self.model(_right_padded(self.prompts, self.multiple), cache=self.cache)
        if not any(layer.k is not None for layer in self.cache._layers.values()):
            raise ValueError(
                f"{type(self.model).__name__}.forward takes a cache argument but stored no keys/values in it: "
                "implement the protocol of titanlite.models.kv_cache, or generate with use_cache=False"
            )
        self.cache.advance(self.prompts.shape[1])
        return _last_logits(logits, self.prompts.shape[1] - 1)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.compiled is not None:
            if self.cuda:
                torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are consumed
            with self._steady() if self.cache.length > self.prompts.shape[1] else contextlib.nullcontext():
                logits = self.compiled(self.model, ids[:, None], self.cache)
        else:
            logits = _last_logits(self.model(_right_padded(ids[:, None], self.multiple), cache=self.cache), 0)
        self.cache.advance(1)
        return logits

    @staticmethod
    def _steady():
        """After a request's first compiled step (its guards checked in full), the next ones skip the guards
        that cannot change within the request (same model, cache and shapes): a fraction of a millisecond
        per token on the host. Only guards that tell compiled graphs apart are still checked."""
        try:
            return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        except TypeError:  # a torch without the option
            return contextlib.nullcontext()


def _steps(model, prompts, device, new: int, use_cache: bool, compile: bool, window: int | None):
    """What runs the forwards of a request: a KV cache, a plain forward per step, or a window over a cache."""
    if not use_cache:
        return _RecomputedSteps(model, prompts, device, new, window)
    if window is None:
        return _CachedSteps(model, prompts, device, new, compile)
    fits = window - max(len(p) for p in prompts)  # tokens generated before the longest row's context overflows
    cached = _CachedSteps(model, prompts, device, min(new, fits), compile)
    return _WindowedSteps(cached, _RecomputedSteps(model, prompts, device, new, window), fits)


class _WindowedSteps:
    """A sliding context window over a KV cache: ``cached`` serves the steps while every row's context fits the
    window; past it, ``recomputed`` (which records every token) runs each row's last ``window`` tokens afresh."""

    def __init__(self, cached: _CachedSteps, recomputed: _RecomputedSteps, fits: int):
        self.cached, self.recomputed, self.fits = cached, recomputed, fits  # fits: steps the cache serves

    def prefill(self) -> torch.Tensor:
        return self.cached.prefill()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        self.recomputed.record(ids)
        if self.recomputed.generated <= self.fits:
            return self.cached(ids)
        return self.recomputed.logits()


class _RecomputedSteps:
    """Plain (training-path) forwards over each whole sequence so far (its last ``window`` tokens when given),
    the prompts of one length together. The sequences live on the device (each step's tokens are written there,
    never read back)."""

    def __init__(
        self, model: nn.Module, prompts: list[list[int]], device: torch.device, new: int, window: int | None = None
    ):
        self.model, self.multiple, self.generated, self.window = model, sequence_multiple(model), 0, window
        width = max(len(p) for p in prompts) + new
        self.sequences = torch.tensor([p + [FILLER] * (width - len(p)) for p in prompts], device=device)
        self.lengths = torch.tensor([len(p) for p in prompts], device=device)
        self.rows = torch.arange(len(prompts), device=device)
        groups: dict[int, list[int]] = {}
        for row, prompt in enumerate(prompts):
            groups.setdefault(len(prompt), []).append(row)
        self.groups = {n: torch.tensor(rows, device=device) for n, rows in groups.items()}

    def prefill(self) -> torch.Tensor:
        return self.logits()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        self.record(ids)
        return self.logits()

    def record(self, ids: torch.Tensor) -> None:
        """Append each row's next token."""
        self.sequences[self.rows, self.lengths + self.generated] = ids
        self.generated += 1

    def logits(self) -> torch.Tensor:
        """The next-token logits ``[B, V]`` of each row's sequence so far (its last ``window`` tokens)."""
        logits = None
        for length, rows in self.groups.items():
            end = length + self.generated
            tokens = self.sequences[rows, (0 if self.window is None else max(0, end - self.window)) : end]
            last = _last_logits(self.model(_right_padded(tokens, self.multiple)), tokens.shape[1] - 1)
            logits = last.new_empty(len(self.rows), last.shape[-1]) if logits is None else logits
            logits.index_copy_(0, rows, last)
        return logits
