"""Activation checkpointing (AC): keep fewer activations in forward, recompute them in backward.

``[activation_checkpoint] mode``:

- ``none``: keep everything (fastest, most memory);
- ``full``: every transformer block keeps only its input; backward re-runs the whole block
  forward first (about one extra forward: ~+33% compute), activation memory ~ one block;
- ``selective`` with ``selective_ac_option``:

  - ``"op"`` (per-op): inside every block, the outputs of the expensive ops are saved (matmuls,
    float8 matmuls, MoE experts' grouped matmuls, attention, and the tensor-parallel reduce-scatters
    and amax reductions whose recomputation would repeat communication); the cheap element-wise ops (norms, SiLU, RoPE,
    casts) are recomputed. Most of full AC's memory saving at a fraction of its recompute cost;
  - ``"N"`` (an integer): full AC on every N-th block (blocks N-1, 2N-1, ... counting from 0), a
    knob between none (large N) and full (N = 1).

How it is applied: the block's ``forward`` is replaced, on the instance, by a closure that runs the
original forward under non-reentrant ``torch.utils.checkpoint``. Unlike wrapper modules this keeps
every parameter name (checkpoints are unaffected), composes with ``torch.compile`` of the same
forward (compile traces the checkpoint as one higher-order op) and with FSDP2, whose hooks stay on
the block and run outside the checkpointed region. Blocks have no randomness (no dropout), so the
RNG state is not stashed for the recomputation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from titanlite.errors import ConfigError

aten = torch.ops.aten
MODES = ("none", "full", "selective")


_SDPA = ("flash_attention", "efficient_attention", "flash_attention_for_cpu", "cudnn_attention", "attention_math")
_SAVE = {
    *(
        getattr(aten, name).default
        for name in ("mm", "addmm", "bmm", "_scaled_mm", "max", "_grouped_mm")
        if hasattr(aten, name)
    ),
    *(getattr(aten, f"_scaled_dot_product_{k}").default for k in _SDPA if hasattr(aten, f"_scaled_dot_product_{k}")),
    getattr(torch.ops.higher_order, "flex_attention", None),  # block-causal attention on CUDA
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
} - {None}


def _save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_module(module: nn.Module, context_fn: Callable | None = None) -> None:
    """Make ``module``'s forward recompute its activations in backward (see the module docstring); ``context_fn``:
    the per-op policy (None: recompute everything). Without one, ``checkpoint`` is called without the argument:
    torch.compile does not trace a ``context_fn`` that is a plain function (``noop_context_fn``)."""
    inner = module.forward
    options = {} if context_fn is None else {"context_fn": context_fn}

    def forward(*args, **kw):
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=False, **options, **kw)

    module.forward = forward


class ActivationCheckpoint:
    """AC policy from ``[activation_checkpoint]``; :meth:`apply` to a model with ``model.layers``."""

    def __init__(self, mode: str = "none", selective_ac_option: str = "op"):
        if mode not in MODES:
            raise ConfigError(f"activation_checkpoint.mode={mode!r} must be one of {', '.join(MODES)}")
        self.mode = mode
        self.every = None  # checkpoint every N-th block (selective, integer option)
        self.per_op = False
        if mode == "selective":
            option = str(selective_ac_option).strip()
            if option == "op":
                self.per_op = True
            elif option.isdigit() and int(option) >= 1:
                self.every = int(option)
            else:
                raise ConfigError(
                    f"activation_checkpoint.selective_ac_option={selective_ac_option!r} must be "
                    "'op' or a positive integer N (checkpoint every N-th block)"
                )

    @classmethod
    def from_config(cls, section) -> ActivationCheckpoint:
        return cls(section.mode, section.selective_ac_option)

    def __repr__(self) -> str:
        detail = " op" if self.per_op else (f" every {self.every}" if self.every else "")
        return f"ActivationCheckpoint({self.mode}{detail})"

    def apply(self, model: nn.Module) -> list[str]:
        """Checkpoint the selected blocks of ``model.layers`` in place; returns their names."""
        if self.mode == "none":
            return []
        context_fn = functools.partial(create_selective_checkpoint_contexts, _save_matmuls_policy)
        done = [name for i, name in enumerate(model.layers) if self.every is None or (i + 1) % self.every == 0]
        for name in done:
            checkpoint_module(model.layers[name], context_fn if self.per_op else None)
        return done
