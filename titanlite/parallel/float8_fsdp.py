"""Float8 all-gather for FSDP2 (``[quantize.linear.float8] enable_fsdp_float8_all_gather``, tensorwise only):
each rank casts its *shard* of a :class:`~titanlite.parallel.float8.Float8Linear` weight to float8 before FSDP's
all-gather, which then moves one byte per element instead of two, and the gathered weight takes half the memory.
The cast uses the *global* tensorwise scale, so the matmuls see bit for bit the operands of the plain float8 path.

:class:`Float8ShardedWeight` wraps the sharded high-precision weight (its ``fsdp_pre_all_gather`` casts the shard
with the scale :func:`precompute_float8_scales` computed after the optimizer step, or computes one itself when an
in-place change dropped it); :class:`~titanlite.parallel.float8.Float8GatheredWeight` is the unsharded parameter.
Design notes: docs/library.md, "Float8 linears". Rowwise scaling and tensor parallelism are refused by the config.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.parallel.float8 import AMAX_EPS, E4M3, Float8GatheredWeight, float8_modules, wrapper_like

aten = torch.ops.aten
# ops whose result is the same weight (a view: it shares the scale) or a copy of it (its own scale); either
# stays wrapped, as FSDP shards, pads, moves and materializes (to_empty) the weight through them
_VIEWS = {
    aten.detach.default,
    aten.alias.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.as_strided.default,
    aten.slice.Tensor,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.copy_.default,  # returns the tensor it wrote into
}
_COPIES = {
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.empty_like.default,
    aten.clone.default,
    aten._to_copy.default,
    aten._pin_memory.default,
}


class _ScaleBox:
    """The scale of one weight's current values, shared by every view of it (None: stale or not computed)."""

    __slots__ = ("scale",)

    def __init__(self) -> None:
        self.scale: torch.Tensor | None = None


def _cast(hp: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float8 cast of :func:`titanlite.parallel.float8.to_float8`, with a given scale."""
    fp8_max = torch.finfo(E4M3).max
    return (hp.float() * scale).clamp(-fp8_max, fp8_max).to(E4M3)


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    return torch.finfo(E4M3).max / amax.clamp(min=AMAX_EPS)


class Float8ShardedWeight(torch.Tensor):
    """A sharded high-precision Float8Linear weight whose FSDP all-gather moves float8 (module docstring).
    ``param_dtype`` is FSDP's parameter dtype (the dtype the plain path would gather and cast from)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, param_dtype: torch.dtype | None = None, box: _ScaleBox | None = None):
        return wrapper_like(cls, data, data.dtype, data.requires_grad)

    def __init__(self, data: torch.Tensor, param_dtype: torch.dtype | None = None, box: _ScaleBox | None = None):
        self._data = data
        self.param_dtype = param_dtype or data.dtype
        self._box = box or _ScaleBox()

    @property
    def scale(self) -> torch.Tensor | None:
        """The global tensorwise scale of the current values (every view of the weight sees the same)."""
        return self._box.scale

    @scale.setter
    def scale(self, value: torch.Tensor | None) -> None:
        self._box.scale = value

    def __repr__(self) -> str:
        return f"Float8ShardedWeight({self._data!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        mine = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, cls)]
        if func._schema.is_mutable:  # the values change (through any view): the scale is stale
            for t in mine:
                t.scale = None
        first = mine[0]
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._data, (args, kwargs))
        out = func(*args, **kwargs)
        if func not in _VIEWS and func not in _COPIES:
            return out
        box = first._box if func in _VIEWS else None
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, first.param_dtype, box), out)

    def __tensor_flatten__(self):
        return ["_data"], self.param_dtype

    @staticmethod
    def __tensor_unflatten__(inner: dict, param_dtype, outer_size, outer_stride):
        return Float8ShardedWeight(inner["_data"], param_dtype)

    # -- FSDP2's all-gather extension
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        hp = self._data.to(self.param_dtype)
        scale = self.scale
        if scale is None:  # not precomputed for these values: this weight's own all-reduce
            amax = hp.abs().max().float() if hp.numel() else torch.zeros((), device=hp.device)
            _all_reduce_max(amax, [mesh.get_group(i) for i in range(mesh.ndim)])
            scale = self.scale = _scale_from_amax(amax)
        data = _cast(hp, scale)
        rows = math.ceil(outer_size[0] / mesh.size())  # FSDP pads the last shards to this many rows
        if data.size(0) != rows:
            padded = torch.zeros((rows, *data.shape[1:]), dtype=data.dtype, device=data.device)
            padded[: data.size(0)].copy_(data)
            data = padded
        return (data,), (scale.reciprocal(),)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (data,), (inverse,) = outputs, metadata
        if out is not None:  # FSDP refilled the same buffer: only the scale is new
            out._inverse = inverse
            return None
        return Float8GatheredWeight(data, inverse, param_dtype), (data,)


def _all_reduce_max(t: torch.Tensor, groups: Iterable[dist.ProcessGroup]) -> None:
    for group in groups:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)


def _sharded(weight: torch.Tensor) -> Float8ShardedWeight | None:
    local = weight._local_tensor if isinstance(weight, DTensor) else weight  # the object itself, not an alias
    return local if isinstance(local, Float8ShardedWeight) else None


def wrap_float8_weights(modules: nn.Module | Iterable[nn.Module], param_dtype: torch.dtype) -> int:
    """Make the weight of every Float8Linear in ``modules`` a :class:`Float8ShardedWeight` (before ``fully_shard``,
    on any device, meta included); returns how many. Their state dicts keep showing plain tensors."""
    n = 0
    for root in [modules] if isinstance(modules, nn.Module) else modules:
        for m in float8_modules(root):
            if not isinstance(m.weight, (DTensor, Float8ShardedWeight)):  # DTensor: already sharded (or TP)
                m.weight = nn.Parameter(Float8ShardedWeight(m.weight.data, param_dtype), m.weight.requires_grad)
                m._register_state_dict_hook(_plain_state_dict)
                m.register_load_state_dict_post_hook(_forget_scale)
                n += 1
    return n


def _plain_state_dict(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata) -> None:
    """The state dict holds the wrapped tensor itself (same storage), so checkpoints see a plain tensor."""
    key = prefix + "weight"
    value = state.get(key)
    if isinstance(value, DTensor) and isinstance(value.to_local(), Float8ShardedWeight):
        state[key] = DTensor.from_local(
            value.to_local()._data, value.device_mesh, value.placements, shape=value.shape, stride=value.stride()
        )
    elif isinstance(value, Float8ShardedWeight):
        state[key] = value._data


def _forget_scale(module: nn.Module, incompatible_keys) -> None:
    """After a state-dict load (which may have written the storage directly, e.g. a checkpoint read in place)."""
    if (local := _sharded(module.weight)) is not None:
        local.scale = None


@torch.no_grad()
def precompute_float8_scales(model: nn.Module) -> int:
    """The global tensorwise scale of every float8-all-gather weight of ``model``, for its next all-gathers: one
    multi-tensor amax over the local shards and one MAX all-reduce per sharding mesh. The amax is taken as the
    plain path takes it (of the weight in FSDP's parameter dtype). Returns how many weights."""
    by_mesh: dict[Any, list[tuple[DTensor, Float8ShardedWeight]]] = {}
    for m in float8_modules(model):
        if (local := _sharded(m.weight)) is not None and isinstance(m.weight, DTensor):
            key = (id(m.weight.device_mesh), tuple(m.weight.placements), local.param_dtype)
            by_mesh.setdefault(key, []).append((m.weight, local))
    for members in by_mesh.values():
        weight, first = members[0]
        # max |w| in the parameter dtype: rounding is monotonic, so it is the rounded fp32 max
        norms = torch._foreach_norm([local._data for _, local in members], math.inf)
        amax = torch.stack(norms).float().to(first.param_dtype).float()
        mesh = weight.device_mesh
        _all_reduce_max(amax, [mesh.get_group(i) for i, p in enumerate(weight.placements) if not p.is_replicate()])
        for (_, local), scale in zip(members, _scale_from_amax(amax).unbind()):
            local.scale = scale
    return sum(len(m) for m in by_mesh.values())


def register_float8_scale_precompute(optimizer: torch.optim.Optimizer, model: nn.Module) -> bool:
    """After every ``optimizer.step()``, :func:`precompute_float8_scales` (when ``model`` has float8-all-gather
    weights); returns whether it was registered."""
    if not any(_sharded(m.weight) is not None for m in float8_modules(model)):
        return False
    optimizer.register_step_post_hook(lambda *_: precompute_float8_scales(model))
    return True


__all__ = [
    "Float8ShardedWeight",
    "precompute_float8_scales",
    "register_float8_scale_precompute",
    "wrap_float8_weights",
]
