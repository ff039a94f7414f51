"""How a model's outputs become the loss: from its logits, or from its hidden states through the output layer, a
few tokens at a time (``[training] loss_chunks``).

At a large vocabulary the output layer is the step's memory peak: ``[tokens, vocab]`` logits in the compute
dtype, their fp32 copy for the loss, the log-softmax autograd keeps and the logits' gradient (Llama 3's 128,256
entries at 4 x 2048 tokens: about 10 GB). :class:`ChunkedLoss` never holds more than one chunk of them:

1. the model returns the final norm's output instead of the logits (``forward(..., return_hidden=True)``);
2. the tokens are cut into ``chunks`` pieces; for each, the logits ``hidden_piece @ output.weight.T`` are
   computed, reduced to the piece's token-sum loss by the loss function (any registered ``[training] loss``),
   and differentiated at once (the gradients with respect to the piece's hidden states and to the weight);
   then the piece's logits are freed. The loss's gradient with respect to the logits comes from autograd, or,
   for the built-in cross-entropy, from its closed form computed with the loss (:data:`LOSS_GRADIENTS`: two
   passes over the logits instead of four, which pays for the pieces' extra passes over the weight). The closed
   form is found by the loss's registered name (:func:`registered_loss`, which compiles it with the loss where
   ``[compile]`` compiles the loss), so a compiled loss keeps it; :attr:`ChunkedLoss.closed_form` says which;
3. backward multiplies the stored gradients by the incoming one: nothing is recomputed, so the step does the
   same three matmuls as without chunks (the idea of Liger's fused linear cross-entropy; torchtitan runs each
   chunk's backward from inside its loss instead). The weight's gradient is accumulated over the pieces in fp32
   and rounded to the weight's dtype once.

The loss is the unchunked token sum up to fp32 summation order (tested: within 1e-6 for the loss and 1e-5 for
the gradients, with masked labels, under FSDP, TP with and without loss parallel, and on a pipeline's last
stage). Calls run under the autocast of the model's forward (the output matmul in the compute dtype, as
unchunked); the loss function itself runs with autocast off, as after an unchunked forward.

**The family's side** (part of every family's contract, :class:`titanlite.models.protocol.ModelFamily`):
``forward(tokens, ..., return_hidden=False)``, where ``return_hidden=True`` returns the final norm's output
``[batch, seq, dim]``, and the output layer as ``model.output``, a bias-free ``nn.Linear`` (its weight may be tied
to the embedding). A model handed to :class:`~titanlite.trainer.step.TrainStep` directly, outside the registry,
is checked when the loss is built (:meth:`ChunkedLoss.check`).

**Parallelism.** Tensor parallel: the hidden states (sequence-sharded DTensor) are gathered, as the output
layer's own input is, then cut; the vocabulary-sharded weight gives vocabulary-sharded logits, which the loss
takes as they are under loss parallel and gathered otherwise. FSDP: when the output layer is its own FSDP group,
the chunked computation runs as that group's forward (``register_fsdp_forward_method``): all-gathered before,
its gradient reduce-scattered as soon as backward has passed it; when its weight belongs to the root group (a
tied embedding), that group is all-gathered (``unshard``) and reduced at the end of backward as usual. Pipeline
parallel: the last stage returns hidden states and the pipeline's loss applies the output layer
(:class:`titanlite.trainer.pipeline_runner.Pipeline`). Memory: each micro-batch holds its weight gradient (fp32,
``[vocab, dim]`` over the TP ranks) from its loss to its backward, so a pipeline schedule holds one per
microbatch in flight on the last stage (GPipe: all of them), instead of their logits.
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
    """A token-sum loss ``fn(logits, labels)`` (what calling this returns) together with its closed-form
    ``value_and_grad(logits, labels) -> (loss, gradient w.r.t. the logits)``, each as the compile policy made it:
    what :func:`registered_loss` returns, so that the chunked loss's pieces run the closed form whether or not the
    loss is compiled."""

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
    """``loss_fn`` over the logits of ``model.output`` applied to the hidden states in ``chunks`` pieces of tokens
    (the module docstring); ``loss_parallel``: keep tensor-parallel logits vocabulary-sharded (else gathered).

    ``loss_fn`` must return a token sum: the pieces' values are added. With gradients it must be a scalar; without
    (validation) any tensor of sums works. :attr:`closed_form`: what differentiates the pieces, the loss's closed
    form (:func:`closed_form_of`), or None for autograd. Usage (``model.output`` applies it)::

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
    """``sum_i loss(hidden_i @ weight.T, labels_i)``, whose forward also computes the gradients (step 2 of the
    module docstring) and whose backward scales them (step 3).

    Per piece: the logits in the compute dtype (``F.linear`` under the caller's autocast), the loss and its
    gradient with respect to them (``value_and_grad``), then the two gradient matmuls in that dtype, as the
    unchunked backward does them: ``dlogits @ weight`` for the hidden states, ``dlogits.T @ hidden`` added to the
    weight's fp32 gradient (in place, ``addmm_``, when everything is fp32: no temporary)."""

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
