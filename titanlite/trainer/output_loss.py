"""How a model's outputs become the loss: from its logits, or from its hidden states through the output layer, a
few tokens at a time (``[training] loss_chunks``), so that the ``[tokens, vocab]`` logits, the step's memory peak
at a large vocabulary, exist for one piece of the tokens at a time (:class:`ChunkedLoss`; how, and how it meets
TP, FSDP and pipelines: docs/library.md, "The chunked output loss").

Calls run under the autocast of the model's forward; the loss function itself runs with autocast off, as after
an unchunked forward. **The family's side** (part of :class:`titanlite.models.protocol.ModelFamily`):
``forward(tokens, ..., return_hidden=True)`` returns the final norm's output ``[batch, seq, dim]``, and
``model.output`` is a bias-free ``nn.Linear`` (its weight may be tied to the embedding); :meth:`ChunkedLoss.check`
checks a model handed to :class:`~titanlite.trainer.step.TrainStep` outside the registry.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Replicate

from titanlite import components
from titanlite.errors import ConfigError
from titanlite.trainer.loss import cross_entropy_sum_and_grad

logger = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# a registered [training] loss's name -> fn(logits, labels) -> (its value, its gradient w.r.t. the logits), computed
# together without autograd (fewer passes over a piece's logits); other losses are differentiated by autograd
LOSS_GRADIENTS: dict[str, Callable] = {"cross_entropy": cross_entropy_sum_and_grad}


class ClosedFormLoss:
    """A token-sum loss ``fn(logits, labels)`` with its closed-form ``value_and_grad(logits, labels) -> (loss,
    dloss/dlogits)``, each as the compile policy made it, so that a compiled loss's pieces keep the closed form."""

    def __init__(self, name: str, fn: LossFn, value_and_grad: Callable):
        self.name, self.fn, self.value_and_grad = name, fn, value_and_grad

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.fn(logits, labels)


def registered_loss(name: str, compile: Callable[[Callable], Callable] = lambda fn: fn) -> LossFn | ClosedFormLoss:
    """The ``[training] loss`` registered as ``name`` passed through ``compile`` (the compile policy's
    ``compile_loss``); for a name with a closed-form gradient (:data:`LOSS_GRADIENTS`) a :class:`ClosedFormLoss`
    whose closed form went through ``compile`` too. The closed form is looked up by name, before compiling (a
    compiled function is another object), and the choice is logged."""
    plain = components.get("loss", name)
    fn, closed = compile(plain), LOSS_GRADIENTS.get(name)
    how = "compiled" if fn is not plain else "eager"
    pieces = "by autograd" if closed is None else f"by its closed-form gradient ({how} too)"
    logger.info(f"training.loss = {name!r} ({how}): with loss_chunks, the pieces are differentiated {pieces}")
    return fn if closed is None else ClosedFormLoss(name, fn, compile(closed))


def closed_form_of(loss_fn: LossFn | ClosedFormLoss) -> Callable | None:
    """The closed-form gradient of ``loss_fn``: a :class:`ClosedFormLoss`'s, or, for a registered loss function
    given as registered (uncompiled), the one of its name; None: autograd."""
    if isinstance(loss_fn, ClosedFormLoss):
        return loss_fn.value_and_grad
    return next((grad for name, grad in LOSS_GRADIENTS.items() if components.get("loss", name) is loss_fn), None)


def _autocast_off(t: torch.Tensor):
    """Autocast off on ``t``'s device while the loss function runs (as after an unchunked forward)."""
    device = t.device.type
    return torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext()


class LogitsLoss:
    """``loss_fn(logits, labels)`` on the model's own output, its logits (``loss_chunks = 0``)."""

    model_kwargs: dict[str, Any] = {}

    def __init__(self, loss_fn: LossFn):
        self.loss_fn = loss_fn

    def with_fn(self, loss_fn: LossFn) -> LogitsLoss:
        return LogitsLoss(loss_fn)

    @staticmethod
    def check(model: nn.Module) -> None:
        """Any model's logits will do."""

    def __call__(self, model: nn.Module, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with _autocast_off(logits):
            return self.loss_fn(logits, labels)


class ChunkedLoss:
    """``loss_fn`` over the logits of ``model.output`` applied to the hidden states in ``chunks`` pieces of tokens;
    ``loss_parallel``: keep tensor-parallel logits vocabulary-sharded (else gathered). ``loss_fn`` returns a token
    sum (a scalar when training; any tensor of sums for validation). :attr:`closed_form`: the loss's closed-form
    gradient (:func:`closed_form_of`), or None for autograd. Usage::

        loss = ChunkedLoss(cross_entropy_sum, chunks=8)
        total = loss(model, model(tokens, return_hidden=True), labels)
    """

    model_kwargs: dict[str, Any] = {"return_hidden": True}

    def __init__(self, loss_fn: LossFn, chunks: int, *, loss_parallel: bool = False):
        if chunks < 1:
            raise ValueError(f"ChunkedLoss: chunks must be >= 1, got {chunks} (0 = unchunked: LogitsLoss)")
        self.loss_fn, self.chunks, self.loss_parallel = loss_fn, chunks, loss_parallel
        self.closed_form = closed_form_of(loss_fn)

    def with_fn(self, loss_fn: LossFn) -> ChunkedLoss:
        return ChunkedLoss(loss_fn, self.chunks, loss_parallel=self.loss_parallel)

    @staticmethod
    def check(model: nn.Module) -> None:
        """A one-line ``ValueError`` unless ``model.output`` is a bias-free linear layer computing ``F.linear``."""
        # any module may reach here (TrainStep takes models outside the registry), and a float8 conversion swaps the
        # output layer of a family's model: checked on the module, not on the family
        head = getattr(model, "output", None)
        if not isinstance(head, nn.Linear) or head.bias is not None or type(head).forward is not nn.Linear.forward:
            raise ConfigError(
                f"training.loss_chunks: the chunked loss needs {type(model).__name__}.output to be a bias-free "
                f"nn.Linear computing F.linear (got {type(head).__name__}; a float8 output layer is not one): "
                "set training.loss_chunks = 0 to compute the loss from the model's logits"
            )

    def __call__(self, model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.check(model)
        head = model.output
        if isinstance(head, FSDPModule):  # its own FSDP group: the chunks run as its forward
            return run_as_forward(head, self._loss, head, hidden, labels)
        if isinstance(model, FSDPModule):  # the weight is in the root group (tied): gather it (no-op if gathered)
            model.unshard()
        return self._loss(head, hidden, labels)

    def _loss(self, head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        weight = head.weight
        if isinstance(hidden, DTensor):  # sequence-sharded under TP: every rank needs every token's hidden state
            hidden = hidden.redistribute(hidden.device_mesh, [Replicate()] * hidden.device_mesh.ndim)
        hidden, labels = hidden.flatten(0, -2), labels.flatten()
        sizes = chunk_sizes(labels.numel(), self.chunks)
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            return _LinearLossChunks.apply(hidden, weight, labels, self._value_and_grad, sizes)
        pieces = zip(hidden.split(sizes), labels.split(sizes))
        return sum(self._logits_loss(F.linear(h, weight), y) for h, y in pieces)

    def _logits_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One piece's token-sum loss, its logits shaped ``[1, tokens, vocab]`` as a loss function expects them."""
        if isinstance(logits, DTensor) and not self.loss_parallel:
            logits = logits.full_tensor()
        with _autocast_off(logits):
            return self.loss_fn(logits[None], labels[None])

    def _value_and_grad(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One piece's loss and its gradient with respect to ``logits``: by the loss's closed form
        (:attr:`closed_form`) for plain tensors, else by autograd."""
        if self.closed_form is not None and not isinstance(logits, DTensor):
            with _autocast_off(logits):
                return self.closed_form(logits, labels)
        logits.requires_grad_()  # computed without grad mode: a leaf
        with torch.enable_grad():
            loss = self._logits_loss(logits, labels)
            if loss.dim():
                raise ValueError(f"the loss must return a scalar token sum to train with chunks, got {loss.shape}")
            (grad,) = torch.autograd.grad(loss, [logits], allow_unused=True, materialize_grads=True)
        return loss.detach(), grad


def chunk_sizes(tokens: int, chunks: int) -> list[int]:
    """``tokens`` cut into ``min(chunks, tokens)`` pieces of ``ceil(tokens / chunks)`` (the last one smaller)."""
    size = -(-tokens // max(1, min(chunks, tokens)))
    return [min(size, tokens - start) for start in range(0, tokens, size)] or [0]


class _LinearLossChunks(torch.autograd.Function):
    """``sum_i loss(hidden_i @ weight.T, labels_i)``, whose forward also computes the gradients, per piece in the
    compute dtype as the unchunked backward would (the weight's summed in fp32), and whose backward scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, value_and_grad, sizes):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total, grads_h, grad_w = None, [], None
        for h, y in zip(hidden.split(sizes), labels.split(sizes)):
            loss, dlogits = value_and_grad(F.linear(h, weight), y)  # the piece's logits are freed here
            total = loss if total is None else total + loss
            if need_h:  # matmuls under the caller's autocast, as the unchunked backward's (the weight's cast cached)
                grads_h.append((dlogits @ weight).to(hidden.dtype))
            if need_w:
                if grad_w is None:
                    grad_w = torch.zeros_like(weight, dtype=torch.float32)
                if dlogits.dtype == h.dtype == torch.float32:
                    grad_w.addmm_(dlogits.t(), h)
                else:
                    grad_w.add_(dlogits.t() @ h)
        ctx.grad_h = torch.cat(grads_h) if need_h else None
        ctx.grad_w = grad_w.to(weight.dtype) if need_w else None
        return total

    @staticmethod
    def backward(ctx, grad):
        # out of place: a pipeline's zero-bubble schedules run this node twice (input, then weight gradients)
        grads = [None if g is None else g * grad for g in (ctx.grad_h, ctx.grad_w)]
        return *grads, None, None, None


def run_as_forward(module: nn.Module, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` run as a forward of ``module``'s FSDP group, for code that uses the module's parameters
    without calling it: the group is all-gathered before (and ``args`` cast to its compute dtype), and its
    gradients are reduce-scattered once backward has passed ``args``. Without FSDP on ``module``: ``fn(*args)``."""
    if not isinstance(module, FSDPModule):
        return fn(*args)
    if "_titanlite_forward" not in vars(module):
        module._titanlite_forward = _call  # a method for FSDP to wrap in its pre-/post-forward hooks
        register_fsdp_forward_method(module, "_titanlite_forward")
    return module._titanlite_forward(fn, *args)


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def output_loss(loss_fn: LossFn, chunks: int = 0, *, loss_parallel: bool = False) -> LogitsLoss | ChunkedLoss:
    """``loss_fn`` on the logits (``chunks = 0``) or chunked through the output layer (``[training] loss_chunks``)."""
    return ChunkedLoss(loss_fn, chunks, loss_parallel=loss_parallel) if chunks else LogitsLoss(loss_fn)


def as_output_loss(loss: LossFn | LogitsLoss | ChunkedLoss) -> LogitsLoss | ChunkedLoss:
    """A plain ``loss_fn(logits, labels)`` as a :class:`LogitsLoss`; an output loss as it is."""
    return loss if isinstance(loss, (LogitsLoss, ChunkedLoss)) else LogitsLoss(loss)
