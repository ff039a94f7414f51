"""A key/value cache for incremental decoding: prefill a batch of prompts once, then one token per step.

Without a cache every generated token recomputes attention keys and values for the whole prefix;
with one, each layer keeps the keys and values it has computed and a step only runs the new token.

Protocol (what a model family implements to accept ``model(tokens, cache=cache)``):

1. The model's ``forward(tokens, ..., cache=None)``: with a cache, it calls
   ``rope, mask = cache.step(rope_table, tokens.shape[1])`` once, instead of using its rotary table
   and causal mask directly. ``rope`` holds each row's own rotary rows ``[B, S, head_dim]`` (a row's
   positions start after its left padding) and ``mask`` is a boolean ``[B, 1, S, T]`` attention mask
   over the ``T`` slots filled so far (causal, padded slots masked out). Each block gets
   ``cache=cache.layer(name)`` as a keyword argument (a keyword, so tensor-parallel input hooks,
   which see positional arguments only, leave it alone).
2. The attention: after rotating q and k with ``rope`` and BEFORE repeating the key/value heads for
   grouped-query attention, ``k, v = cache.update(k, v)`` stores the new ``[B, S, kv_heads, head_dim]``
   keys/values and returns every cached one so far ``[B, T, kv_heads, head_dim]``; attention then
   runs with ``mask``. The buffers are allocated on the first update, from that ``k``: its dtype,
   device and (local) head count, so a tensor-parallel rank caches only its own heads.

The training path (``cache=None``) is untouched. Left padding: row ``b`` of a batch starts with
``pad[b]`` filler tokens so that all prompts end in the same slot; its positions are
``slot - pad[b]`` and its keys in slots ``< pad[b]`` are never attended to. A filler query attends to
itself only (keeping its output finite, so it cannot turn a masked key into NaN). Not for pipeline
stages. The cache is a plain object, not a dataclass or container, so FSDP's input hooks pass it through.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class KVCache:
    """Per-layer key/value buffers for ``batch_size`` rows of at most ``max_len`` slots each."""

    def __init__(self, max_len: int, pad: Sequence[int] | torch.Tensor, device: torch.device | str | None = None):
        self.max_len = max_len
        self.pad = torch.as_tensor(pad, dtype=torch.long, device=device)  # [B] filler slots at each row's start
        self.length = 0  # slots filled, the same for every row
        self.start = 0  # first slot of the current step
        self._layers: dict[str, LayerKV] = {}

    def step(self, rope_table: torch.Tensor, seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Open the next ``seqlen`` slots: each row's rotary rows ``[B, S, D]`` and the mask ``[B, 1, S, T]``."""
        start, end = self.length, self.length + seqlen
        if end > self.max_len or end > rope_table.shape[0]:
            raise ValueError(f"KV cache: {end} slots exceed its {self.max_len} or the model's {rope_table.shape[0]}")
        self.start, self.length = start, end
        pad = self.pad = self.pad.to(rope_table.device)
        slots = torch.arange(start, end, device=pad.device)
        positions = (slots[None, :] - pad[:, None]).clamp(min=0)  # [B, S]; fillers get 0, masked anyway
        keys = torch.arange(end, device=pad.device)
        causal = keys[None, :] <= slots[:, None]  # [S, T]
        real = keys[None, None, :] >= pad[:, None, None]  # [B, 1, T]: not a filler
        mask = causal[None] & (real | (keys[None, :] == slots[:, None])[None])  # fillers see themselves
        return rope_table[positions], mask[:, None]

    def truncate(self, length: int) -> None:
        """Forget the slots from ``length`` on (the next step overwrites them). Lets a caller pad a step
        on the right, e.g. to a sequence length that tensor parallelism's sequence sharding divides:
        causal masking keeps the real tokens blind to the filler after them."""
        if not 0 <= length <= self.length:
            raise ValueError(f"KV cache: cannot truncate {self.length} slots to {length}")
        self.length = length

    def layer(self, name: str) -> LayerKV:
        """The buffers of the block called ``name`` (created empty on first use)."""
        if name not in self._layers:
            self._layers[name] = LayerKV(self)
        return self._layers[name]


class LayerKV:
    """One attention layer's keys and values ``[B, max_len, kv_heads, head_dim]``, filled up to ``length``."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the step's keys/values ``[B, S, H, D]``; return all of them so far ``[B, T, H, D]``."""
        start, end = self.cache.start, self.cache.length
        if self.k is None:
            shape = (k.shape[0], self.cache.max_len, *k.shape[2:])
            self.k = k.new_zeros(shape)
            self.v = v.new_zeros(shape)
        self.k[:, start:end] = k
        self.v[:, start:end] = v
        return self.k[:, :end], self.v[:, :end]
