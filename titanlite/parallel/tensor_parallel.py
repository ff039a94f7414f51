"""Tensor-parallel helpers shared by the model families (their plans: ``models/<family>/parallelize.py``).

Loss parallel: with a vocabulary-sharded ``output`` (``Shard(-1)`` DTensor logits), torch's ``loss_parallel``
computes the cross-entropy from the shards (a max and a sum-exp all-reduced over the TP group, the target logit
from the rank that owns it), never gathering the ``[tokens, vocab]`` logits. Forward *and* backward must run
inside :func:`loss_parallel_context`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)


def loss_parallel_context(enabled: bool):
    """``loss_parallel()`` when ``enabled``, else a no-op context."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def dtensor_supports(op: torch._ops.OpOverload) -> bool:
    """True when DTensor can shard ``op`` (it has a strategy or rule registered for it)."""
    prop = DTensor._op_dispatcher.sharding_propagator
    tables = ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules")
    return any(op in getattr(prop, name, {}) for name in tables)


def to_local_value(t: torch.Tensor) -> torch.Tensor:
    """``t.full_tensor()`` for a DTensor, ``t`` otherwise."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class SyncRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` with a synchronous output redistribution: the stock style's ``async_op=True`` hands the
    next module a tensor whose collective is in flight, and when that module is a compiled block, this torch's
    compiled backward returns a plain-tensor gradient where the redistribution's backward expects a DTensor, and
    fails. The embedding is followed at once by the first block's norm, so waiting costs nothing measurable."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local() if use_local_output else outputs


def parallelize_decoder(
    model: nn.Module, tp_mesh: Any, loss_parallel: bool, block_plan: Callable[[nn.Module], dict]
) -> None:
    """The TP plan of a decoder (Llama 3, Qwen3, their MoE): each block of ``model.layers`` by ``block_plan(block)``
    (submodule name -> style); the embedding row-wise (a vocabulary-sharded table) with its output sharded along
    the sequence, the final norm sequence-parallel, the output column-wise (logits vocabulary-sharded with
    ``loss_parallel``, else gathered). A pipeline stage lacks the embedding or the norm and output (None there,
    see ``titanlite.parallel.pipeline``): only the modules present are planned. A tied output shares the
    embedding's DTensor again (TP replaced both parameters)."""
    ends = {
        "tok_embeddings": SyncRowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    parallelize_module(model, tp_mesh, {k: v for k, v in ends.items() if getattr(model, k) is not None})
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(block))
    if model.args.tie_word_embeddings and model.output is not None:
        model.output.weight = model.tok_embeddings.weight
