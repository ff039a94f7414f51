"""The next token from a model's logits: greedy, or a draw with temperature, top-k and top-p, from a given
generator only (never torch's global RNG, so a training run's random stream is the same with or without samples),
with no host read (:func:`draw`). :func:`titanlite.generate.generate` calls it once per decode step."""

from __future__ import annotations

import torch


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
    """Next token ids ``[B]`` from ``logits [B, V]``: the argmax when ``temperature == 0`` (greedy), else a draw
    from ``generator`` of ``softmax(logits / temperature)`` restricted to the ``top_k`` largest logits (ties with
    the k-th kept; 0: all), then to the smallest most likely set reaching ``top_p`` (1: all), renormalized."""
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
    if probs.device.type != generator.device.type:  # e.g. a CPU generator for CUDA logits (a copy per step)
        probs = probs.to(generator.device)
    return draw(probs, generator).to(logits.device)


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row of ``probs [B, V]``: the draw of ``torch.multinomial(probs, 1, generator=generator)``,
    the same numbers from the same generator (its one-sample path: the argmax of ``probs / q``, ``q`` drawn
    from Exp(1)), without the validity checks that read the device (a host sync per token on a GPU)."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    return probs.div(q).argmax(dim=-1)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` kept on the most likely tokens until their total first reaches ``top_p``, renormalized."""
    ranked, order = probs.sort(dim=-1, descending=True)
    above = ranked.cumsum(dim=-1) - ranked  # the probability of the tokens ranked above each one
    ranked = ranked.masked_fill(above >= top_p, 0.0)  # the most likely token is always kept (above = 0)
    kept = torch.zeros_like(probs).scatter(-1, order, ranked)
    return kept / kept.sum(dim=-1, keepdim=True)
