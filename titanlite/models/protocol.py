"""The contract of a model family: what core code reads of a family's args and model, stated once.
:func:`titanlite.models.register_model` checks it (:func:`contract_breach`), so a family lacking a member is refused
by name when it registers, not deep inside a parallelize plan or a conversion; module members are class
annotations, checked without building a model. Optional, and probed where used: ``forward(..., cache=)`` (the
KV-cache protocol, docs/extensions.md), ``args.attn_mask_type`` (without it: causal only).
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import torch
from torch import nn


class ModelArgs(Protocol):
    """The args fields core reads (the family's args dataclass has more)."""

    vocab_size: int  # rows of the embedding and of the output layer
    n_layers: int  # blocks of the whole model (a pipeline stage holds some of them)
    max_seq_len: int  # the longest sequence a forward takes (e.g. its rotary table's length)
    tie_word_embeddings: bool  # output.weight is tok_embeddings.weight (one tensor)


class ModelFamily(Protocol):
    """A family's model: ``model_cls(args)`` built on the meta device, then ``init_weights``.

    The ends may be None on a pipeline stage (:func:`titanlite.parallel.pipeline.pipeline_decoder`): the
    embedding on every stage but the first, ``norm`` and ``output`` on every stage but the last."""

    args: ModelArgs  # the args it was built with
    tok_embeddings: nn.Module | None  # the token embedding
    layers: nn.ModuleDict  # the blocks by name: FSDP, activation checkpointing, compile and the pipeline split
    norm: nn.Module | None  # the final norm, before ``output``
    output: nn.Linear | None  # the output layer, bias-free (the chunked loss multiplies by its weight)

    def forward(
        self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None, return_hidden: bool = False
    ) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]``; ``document_ids`` for ``block_causal`` masking; ``return_hidden``: the
        final norm's output ``[batch, seq, dim]`` instead (the chunked loss applies ``output`` itself). A stage
        without ``output`` returns its hidden states."""
        ...

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialize the parameters in place and compute the buffers on ``buffer_device`` (None: where
        they are)."""
        ...


ARGS_MEMBERS = tuple(ModelArgs.__annotations__)
MODULE_MEMBERS = tuple(ModelFamily.__annotations__)
METHOD_PARAMETERS = {"forward": ("tokens", "document_ids", "return_hidden"), "init_weights": ("buffer_device",)}


def declared(cls: type, name: str) -> bool:
    """Whether ``cls`` (or a base) annotates ``name`` or has it as a class attribute (a dataclass field or a
    property of an args class)."""
    return hasattr(cls, name) or any(name in vars(k).get("__annotations__", {}) for k in cls.__mro__)


def missing_parameter(fn: Any, names: tuple[str, ...]) -> str | None:
    """The first of ``names`` that ``fn`` does not take by that name (``**kwargs`` does not count)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return names[0]
    return next((n for n in names if n not in params or params[n].kind == inspect.Parameter.VAR_KEYWORD), None)


def contract_breach(model_cls: type, args_cls: type) -> str | None:
    """What ``model_cls`` (with ``args_cls``) lacks of :class:`ModelFamily`, in a few words; None if nothing."""
    for name in MODULE_MEMBERS:
        if not declared(model_cls, name):
            return f"{model_cls.__name__} declares no {name!r} (a class annotation, as in ModelFamily)"
    for method, params in METHOD_PARAMETERS.items():
        fn = getattr(model_cls, method, None)
        if not callable(fn):
            return f"{model_cls.__name__} has no {method}()"
        if (param := missing_parameter(fn, params)) is not None:
            return f"{model_cls.__name__}.{method}() takes no {param!r} parameter"
    for name in ARGS_MEMBERS:
        if not declared(args_cls, name):
            return f"its args {args_cls.__name__} have no {name!r} field"
    return None
