"""A key/value cache for incremental decoding: prefill a batch of prompts once, then a few tokens per step
(generation: one; eval scoring: each choice after its shared context), each layer keeping the keys and values it
computed. The protocol a family implements to take ``model(tokens, cache=cache)``: docs/extensions.md, "The
KV-cache protocol". The objects are plain ones, not dataclasses or containers, so FSDP's input hooks pass them
through.

:class:`KVCache` is static: its buffers ``[B, max_len, kv_heads, head_dim]`` are allocated on the first update
(from that ``k``'s dtype, device and local head count: a tensor-parallel rank caches its own heads) and never
grow; the next token's slot is a device tensor (:attr:`KVCache.pos`) and the rotary rows and the mask are built
from it on the device, so a decode step has fixed shapes and no host read. Compiled, attention spans the whole
buffer (later slots masked); eager steps attend over the slots filled so far. Left padding: row ``b`` starts
with ``pad[b]`` filler slots, never attended to (its positions are ``slot - pad[b]``); a filler query attends to
itself only, which keeps its output finite.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from titanlite.models.protocol import missing_parameter
from titanlite.utils import torch_compat


def supports_cache(model: nn.Module) -> bool:
    """Whether ``model.forward`` declares a ``cache`` parameter (``**kwargs`` alone does not count: such a forward
    would take a cache and silently ignore it)."""
    return missing_parameter(model.forward, ("cache",)) is None


class KVCache:
    """Per-layer key/value buffers for ``len(pad)`` rows of ``max_len`` slots each. ``static_addresses``: mark
    the buffers and the position as static inputs for CUDA graphs (``reduce-overhead``), written in place instead
    of copied at every replay."""

    def __init__(
        self,
        max_len: int,
        pad: Sequence[int] | torch.Tensor,
        device: torch.device | str | None = None,
        static_addresses: bool = False,
    ):
        self.max_len = max_len
        self.pad = torch.as_tensor(pad, dtype=torch.long, device=device)  # [B] filler slots at each row's start
        self.pos = torch.zeros((), dtype=torch.long, device=self.pad.device)  # slot of the next token
        self.length = 0  # the host's count of the slots filled (the same as pos, never read from the device)
        self.slots = torch.arange(max_len, device=self.pad.device)  # a tensor: its size is a shape, not a constant
        self.static_addresses = static_addresses
        if static_addresses:
            _mark_static(self.pos)
        self._layers: dict[str, LayerKV] = {}

    def step(self, rope_table: torch.Tensor, seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``seqlen`` slots' rotary rows ``[B, S, D]`` and the mask ``[B, 1, S, T]`` over the slots
        :meth:`LayerKV.update` returns (compiled: all ``max_len``; eager: those filled so far)."""
        if not torch.compiler.is_compiling() and self.length + seqlen > self.max_len:
            raise ValueError(f"KV cache: {self.length + seqlen} slots exceed its {self.max_len}")
        device = rope_table.device
        slots = self.pos.to(device) + torch.arange(seqlen, device=device)  # [S]
        pad = self.pad.to(device)
        # [B, S]; filler slots (left padding, or right padding past the table) get a valid row, unseen anyway
        positions = (slots[None, :] - pad[:, None]).clamp(0, rope_table.shape[0] - 1)
        keys = self.slots[: self._attended(seqlen)].to(device)
        causal = keys[None, :] <= slots[:, None]  # [S, T]
        real = keys[None, None, :] >= pad[:, None, None]  # [B, 1, T]: not a filler
        mask = causal[None] & (real | (keys[None, :] == slots[:, None])[None])  # fillers see themselves
        return rope_table[positions], mask[:, None]

    def _attended(self, seqlen: int) -> int | None:
        """The key slots a step attends over: all of them when compiled (None: fixed shapes, and no host
        count in the graph's guards), else only those filled so far (eager steps skip the empty ones)."""
        return None if torch.compiler.is_compiling() else self.length + seqlen

    def advance(self, n: int) -> None:
        """Keep the first ``n`` slots of the step just run (the caller's count of its real tokens; slots
        after them, e.g. filler that pads a step to a tensor-parallel multiple, are overwritten next)."""
        if not 0 <= self.length + n <= self.max_len:
            raise ValueError(f"KV cache: cannot advance {self.length} slots by {n} (it has {self.max_len})")
        self.length += n
        self.pos.add_(n)

    def select(self, rows: torch.Tensor) -> KVCache:
        """A cache whose row ``i`` continues row ``rows[i]`` of this one, its keys and values copied: several
        continuations of one prefix (eval scoring runs every choice after its shared context this way)."""
        out = KVCache(self.max_len, self.pad[rows], static_addresses=self.static_addresses)
        out.pos.copy_(self.pos)
        out.length = self.length
        for name, layer in self._layers.items():
            copy = out.layer(name)
            copy.k, copy.v = layer.k[rows], layer.v[rows]
        return out

    def layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{layer name: (a key's shape after [B, T], dtype)}`` of the buffers allocated so far."""
        return {
            name: (tuple(layer.k.shape[2:]), layer.k.dtype)
            for name, layer in self._layers.items()
            if layer.k is not None
        }

    def allocate(self, layout: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Allocate the buffers another cache of the model has (its :meth:`layout`) now, before the first
        update: a compiled forward then finds them, so allocating is never part of its graph."""
        rows = (self.pad.shape[0], self.max_len)
        for name, (shape, dtype) in layout.items():
            layer = self.layer(name)
            layer.k, layer.v = (torch.zeros(*rows, *shape, dtype=dtype, device=self.pad.device) for _ in range(2))

    def layer(self, name: str) -> LayerKV:
        """The buffers of the block called ``name`` (created empty on first use)."""
        if name not in self._layers:
            self._layers[name] = LayerKV(self)
        return self._layers[name]


class LayerKV:
    """One attention layer's keys and values ``[B, max_len, kv_heads, head_dim]``."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the step's keys/values ``[B, S, H, D]`` at their slots; return the buffers' first ``T``
        slots (compiled: the whole buffers)."""
        if self.k is None:
            shape = (k.shape[0], self.cache.slots.shape[0], *k.shape[2:])
            self.k, self.v = k.new_zeros(shape), v.new_zeros(shape)
            if self.cache.static_addresses:
                _mark_static(self.k, self.v)
        slots = self.cache.pos.to(k.device) + torch.arange(k.shape[1], device=k.device)
        self.k.index_copy_(1, slots, k.to(self.k.dtype))
        self.v.index_copy_(1, slots, v.to(self.v.dtype))
        end = self.cache._attended(k.shape[1])
        return self.k[:, :end], self.v[:, :end]


def _mark_static(*tensors: torch.Tensor) -> None:
    for t in tensors:
        torch_compat.mark_static_address(t)
