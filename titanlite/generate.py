"""Text generation from a titanlite decoder: greedy or sampled, with a KV cache, on one process or on
every rank of a sharded model.

Library: :func:`generate` continues a batch of token-id prompts and returns each one's completion ids;
:func:`sample_next` picks next tokens from logits (temperature, top-k, top-p). The training loop's
in-loop samples, the evaluation watcher and the command line below all call these.

- The batch is one left-padded prefill (every prompt ends in the same slot), then one token per step
  through the model's KV cache (:mod:`titanlite.models.kv_cache`). ``use_cache=False`` instead runs the
  plain training forward over each whole prefix at every step (prompts of one length together): the
  reference the cache is tested against, and the benchmark's baseline.
- Sampling draws only from the ``generator`` it is given, never from torch's global RNG, so a training
  run's random stream is the same with or without samples.
- Distributed (FSDP and/or tensor parallel): every rank of ``sync_group`` calls :func:`generate` with
  the same prompts and runs every forward (they hold shards); the group's first rank picks the next
  tokens and broadcasts them, so all ranks continue and stop together. Under tensor parallelism every
  forward is padded on the right with filler up to a multiple of the TP degree (titanlite's plan shards
  the sequence evenly over the TP ranks); causal attention keeps the real tokens blind to it.
- Under ``torch.no_grad`` and ``torch.compiler.set_stance("force_eager")``: per-block compiled
  models run eagerly, instead of recompiling for every new sequence length.

Command line (one ``error: ...`` line on stderr and exit status 2 for bad input)::

    python -m titanlite.generate --checkpoint DIR --prompt TEXT [--prompt TEXT ...] [--prompt-file F]
        [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S] [--json]
        [--tokenizer PATH|bytes] [--device cpu|cuda] [--dtype float32|bfloat16] [--extensions M]
        [--no-bos] [--no-cache]

``DIR`` is a titanlite checkpoint step folder or a Hugging Face folder
(:func:`titanlite.checkpoint.load_model.load_model`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.checkpoint.load_model import load_model
from titanlite.data.chat import chat_prompt_ids, special_id
from titanlite.dtypes import DTYPES
from titanlite.models.kv_cache import KVCache

logger = logging.getLogger(__name__)

FILLER = 0  # the token in a left-padded row's empty slots (masked out, any valid id would do)


# ----------------------------------------------------------------------------- sampling


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """One-line ``ValueError`` for a setting :func:`sample_next` cannot use (NaN included)."""
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0: off), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1: off), got {top_p}")


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token ids ``[B]`` from ``logits [B, V]``.

    ``temperature == 0``: the argmax (greedy, as transformers' ``do_sample=False``). Otherwise a draw from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` largest logits (ties with the k-th kept;
    0: all) and then to the smallest set of most likely tokens whose probability reaches ``top_p`` (1: all),
    renormalized. The draw uses ``generator`` only, which sampling therefore needs."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    if generator is None:
        raise ValueError("sampling (temperature > 0) needs a torch.Generator: it never draws from the global RNG")
    scores = logits.float() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = scores.softmax(dim=-1)
    if top_p < 1:
        probs = _nucleus(probs, top_p)
    if probs.device.type != generator.device.type:  # e.g. a CPU generator for CUDA logits
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` kept on the most likely tokens until their total first reaches ``top_p``, renormalized."""
    ranked, order = probs.sort(dim=-1, descending=True)
    above = ranked.cumsum(dim=-1) - ranked  # the probability of the tokens ranked above each one
    ranked = ranked.masked_fill(above >= top_p, 0.0)  # the most likely token is always kept (above = 0)
    kept = torch.zeros_like(probs).scatter(-1, order, ranked)
    return kept / kept.sum(dim=-1, keepdim=True)


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
) -> list[list[int]]:
    """Each prompt's completion ids (at most ``max_new_tokens``; ending with the EOS id that stopped it,
    if one did). See the module docstring; ``device`` defaults to the model's, ``sync_group`` to the
    world when torch.distributed is initialized. Sampling without a ``generator`` uses a fresh one
    seeded by the operating system (still not the global RNG)."""
    check_sampling(temperature, top_k, top_p)
    check_request(model, prompts, max_new_tokens, sequence_multiple(model))
    if not prompts or max_new_tokens == 0:
        return [[] for _ in prompts]
    device = torch.device(device) if device is not None else next(model.parameters()).device
    group = _default_group() if sync_group is None else sync_group
    if temperature > 0 and generator is None:
        generator = torch.Generator(device=device)
        generator.seed()
    steps = _CachedSteps if use_cache else _RecomputedSteps
    forward = steps(model, prompts, device, max_new_tokens)
    stop, completions, done = set(eos_ids), [[] for _ in prompts], [False] * len(prompts)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        logits = forward(None)
        for step in range(max_new_tokens):
            ids = _agreed_next(logits, group, temperature, top_k, top_p, generator)
            for row, token in enumerate(ids.tolist()):
                if not done[row]:
                    completions[row].append(token)
                    done[row] = token in stop
            if all(done) or step == max_new_tokens - 1:
                break
            logits = forward(ids)
    return completions


def check_request(model: nn.Module, prompts: list[list[int]], max_new_tokens: int, multiple: int) -> None:
    """One-line ``ValueError`` for a request the model cannot run (before any forward). ``multiple``: see
    :func:`sequence_multiple`; a forward may carry up to ``multiple - 1`` filler tokens after the real ones."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if getattr(model, "tok_embeddings", True) is None or getattr(model, "output", True) is None:
        raise ValueError("generate needs a whole model, not a pipeline stage")
    args = getattr(model, "args", None)
    vocab, max_len = getattr(args, "vocab_size", None), getattr(args, "max_seq_len", None)
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty: a prompt needs at least one token (e.g. BOS)")
        if vocab is not None and not all(0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt {i} has a token id outside the model's vocabulary [0, {vocab})")
        if max_len is not None and len(prompt) + max_new_tokens + multiple - 1 > max_len:
            filler = f" + {multiple - 1} filler (tensor parallel)" if multiple > 1 else ""
            raise ValueError(
                f"prompt {i}: {len(prompt)} tokens + max_new_tokens {max_new_tokens}{filler} exceed the model's "
                f"max_seq_len {max_len}"
            )


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
    """The next ids, chosen on the group's first rank and broadcast to the others."""
    if group is None or dist.get_rank(group) == 0:
        ids = sample_next(logits, temperature, top_k, top_p, generator)
    else:
        ids = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    if group is not None:
        dist.broadcast(ids, src=dist.get_global_rank(group, 0), group=group)
    return ids


class _CachedSteps:
    """Model forwards through a KV cache: first the left-padded prompts, then each step's new tokens."""

    def __init__(self, model: nn.Module, prompts: list[list[int]], device: torch.device, max_new_tokens: int):
        longest = max(len(p) for p in prompts)
        pad = [longest - len(p) for p in prompts]
        self.model, self.multiple = model, sequence_multiple(model)
        self.prompts = torch.tensor([[FILLER] * n + p for n, p in zip(pad, prompts)], device=device)
        self.cache = KVCache(longest + max_new_tokens + self.multiple - 1, pad, device=device)

    def __call__(self, ids: torch.Tensor | None) -> torch.Tensor:
        tokens = self.prompts if ids is None else ids[:, None]
        real = self.cache.length + tokens.shape[1]
        logits = self.model(_right_padded(tokens, self.multiple), cache=self.cache)
        self.cache.truncate(real)  # drop the filler slots, if any
        return _last_logits(logits, tokens.shape[1] - 1)


class _RecomputedSteps:
    """Plain (training-path) forwards over each whole sequence so far, the prompts of one length together."""

    def __init__(self, model: nn.Module, prompts: list[list[int]], device: torch.device, max_new_tokens: int):
        self.model, self.device, self.multiple = model, device, sequence_multiple(model)
        self.sequences = [list(p) for p in prompts]
        self.groups: dict[int, list[int]] = {}
        for row, prompt in enumerate(prompts):
            self.groups.setdefault(len(prompt), []).append(row)

    def __call__(self, ids: torch.Tensor | None) -> torch.Tensor:
        if ids is not None:
            for sequence, token in zip(self.sequences, ids.tolist()):
                sequence.append(token)
        rows: list[torch.Tensor] = [torch.empty(0)] * len(self.sequences)
        for members in self.groups.values():
            tokens = torch.tensor([self.sequences[r] for r in members], device=self.device)
            last = _last_logits(self.model(_right_padded(tokens, self.multiple)), tokens.shape[1] - 1)
            for r, logits in zip(members, last):
                rows[r] = logits
        return torch.stack(rows)


# ----------------------------------------------------------------------------- command line


class _UsageError(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line instead of the usage text
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m titanlite.generate", description="Continue prompts with a trained model.")
    p.add_argument("--checkpoint", required=True, help="a titanlite checkpoint step folder or a Hugging Face folder")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    p.add_argument("--prompt-file", help="a UTF-8 file with one prompt per line (empty lines skipped)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0: off (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="1: off (default)")
    p.add_argument("--seed", type=int, default=0, help="the sampling generator's seed")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt and line")
    p.add_argument("--tokenizer", help="tokenizer path, or bytes for the built-in byte-level tokenizer")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--extensions", default="", metavar="MODULES", help="comma-separated modules registering a family")
    p.add_argument("--no-bos", action="store_true", help="do not start the prompts with BOS")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole prefix each step")
    p.add_argument(
        "--chat", action="store_true", help="prompts are user turns of the Llama 3 chat template; stop at <|eot_id|>"
    )
    return p


def _read_prompts(a: argparse.Namespace) -> list[str]:
    prompts = list(a.prompt)
    if a.prompt_file is not None:
        try:
            with open(a.prompt_file, encoding="utf-8") as f:
                prompts += [line for line in f.read().splitlines() if line]
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--prompt-file {a.prompt_file}: cannot be read ({type(e).__name__}: {e})") from None
    if not prompts:
        raise ValueError("no prompt: pass --prompt TEXT or --prompt-file FILE")
    return prompts


def _check_numbers(a: argparse.Namespace) -> None:
    for flag, value in (("--max-new-tokens", a.max_new_tokens), ("--top-k", a.top_k)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    if not a.temperature >= 0:
        raise ValueError(f"--temperature must be >= 0 (0: greedy), got {a.temperature}")
    if not 0 < a.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {a.top_p}")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available")


def _run(a: argparse.Namespace) -> list[dict]:
    prompts = _read_prompts(a)
    _check_numbers(a)
    extensions = [m.strip() for m in a.extensions.split(",") if m.strip()]
    loaded = load_model(
        a.checkpoint, device=a.device, dtype=DTYPES[a.dtype], tokenizer_path=a.tokenizer, extensions=extensions
    )
    tok = loaded.tokenizer
    eos_ids = tuple(loaded.eos_ids)
    if a.chat:  # the rendering starts with <|begin_of_text|> itself; a reply ends with <|eot_id|>
        prompt_ids = [chat_prompt_ids(tok, p) for p in prompts]
        eos_ids += (special_id(tok, "<|eot_id|>"),)
    else:
        prompt_ids = [tok.encode(p, bos=not a.no_bos) for p in prompts]
    completions = generate(
        loaded.model,
        prompt_ids,
        max_new_tokens=a.max_new_tokens,
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        eos_ids=eos_ids,
        generator=torch.Generator(device=a.device).manual_seed(a.seed),
        use_cache=not a.no_cache,
    )
    records = []
    for text, ids, out in zip(prompts, prompt_ids, completions):
        body = out[:-1] if out and out[-1] in eos_ids else out
        records.append({"prompt": text, "completion": tok.decode(body), "prompt_ids": ids, "completion_ids": out})
    return records


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status (2: bad input, with one ``error:`` line on stderr)."""
    try:
        a = _parser().parse_args(argv)
        records = _run(a)
    except (ValueError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    for i, r in enumerate(records):
        if a.json:
            print(json.dumps(r))
        else:
            print(("\n" if i else "") + r["prompt"] + r["completion"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
