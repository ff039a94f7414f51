"""Validation: mean token cross-entropy on held-out windows, and its place in the training loop.

Always plain cross-entropy, whatever the training loss adds (z-loss, ...), in high precision for
float8 linears, over the same windows every time (the validation loader restarts from its first
window), summed over the data-parallel ranks, so the figure does not depend on the layout. Bits per byte
(``val_bpb``, docs/evaluation.md) leave out the tokens that stand for no text (special tokens such as EOS), as
nanochat does; labels of -100 count in neither the loss nor the tokens nor the bytes.

Windows with no scored token at all (chat data whose assistant turns are all empty or cut off) have no loss:
the result is ``{"val_tokens": 0}`` and the hook logs "no scored tokens", never a NaN loss or a bpb of 0.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from titanlite.parallel.distributed import all_reduce_sum
from titanlite.parallel.float8 import float8_disabled
from titanlite.parallel.tensor_parallel import to_local_value
from titanlite.trainer.hooks import Hook, LoopState
from titanlite.trainer.loss import cross_entropy_sum
from titanlite.trainer.runtime import Runtime, eval_loss
from titanlite.trainer.step import batch_to_device

logger = logging.getLogger("titanlite")


@torch.no_grad()
def validation_loss(
    model: nn.Module,
    batches: Iterable[dict],
    runtime: Runtime | None = None,
    *,
    max_batches: int | None = None,
    token_bytes: torch.Tensor | None = None,
) -> dict[str, float]:
    """``{"val_loss", "val_perplexity"}`` over ``max_batches`` batches (None: all) of ``batches``, run as the train
    step runs the model (``runtime``, a :class:`~titanlite.trainer.runtime.Runtime`: its device, parallel dims,
    autocast, pipeline schedule in its evaluation mode, and chunking of the output loss; default: one process on
    the model's device, from the logits); with ``token_bytes`` (the bytes of text each token id stands for, see
    :func:`titanlite.tokenizer.token_byte_lengths`) also ``val_bpb``."""
    runtime = runtime or Runtime.of(model)
    device = runtime.device
    model.eval()
    loss_sums = torch.zeros(2, device=device)  # nats over all tokens, and over the tokens that stand for text
    tokens = torch.zeros((), device=device)
    text_bytes = torch.zeros((), device=device, dtype=torch.int64)
    token_bytes = None if token_bytes is None else token_bytes.to(device)
    sums = functools.partial(loss_sums_of, token_bytes=token_bytes)
    # islice stops without pulling one batch too many: every layout consumes the same windows
    for batch in batches if max_batches is None else itertools.islice(batches, max_batches):
        inputs, labels, extra = batch_to_device(batch, device)
        with float8_disabled(model):  # under a pipeline the sums exist on the last stage only (0 elsewhere)
            loss_sums += eval_loss(model, runtime, (inputs, labels, extra), sums)
        tokens += (labels != -100).sum()  # masked labels (chat data's non-assistant tokens) carry no loss
        if token_bytes is not None:
            text_bytes += bytes_of(token_bytes, labels).sum()
    model.train()
    return validation_result(runtime, loss_sums, tokens, text_bytes if token_bytes is not None else None)


def validation_result(
    runtime: Runtime, loss_sums: torch.Tensor, tokens: torch.Tensor, text_bytes: torch.Tensor | None
) -> dict[str, float]:
    """This rank's sums shared over the pipeline stages and the data-parallel ranks, as ``validation_loss``'s
    figures (``text_bytes`` None: no bits per byte)."""
    if runtime.pipeline is not None and runtime.pp_group is not None:
        loss_sums = all_reduce_sum(loss_sums, runtime.pp_group)
    if (cp := runtime.context_parallel) is not None:  # each CP rank scored its share of the (whole) batch's tokens
        loss_sums = all_reduce_sum(loss_sums, cp.group)
    if (dp_group := runtime.dp_group) is not None:
        loss_sums, tokens = all_reduce_sum(loss_sums, dp_group), all_reduce_sum(tokens, dp_group)
        text_bytes = None if text_bytes is None else all_reduce_sum(text_bytes, dp_group)
    if tokens.item() == 0:  # every label masked: no loss (0 / 0) and no bits per byte
        return {"val_tokens": 0}
    val_loss = (loss_sums[0] / tokens).item()
    out = {"val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 80.0))}
    if text_bytes is not None and text_bytes.item() > 0:  # no text scored (only specials): no bits per byte
        out["val_bpb"] = loss_sums[1].item() / math.log(2) / text_bytes.item()
    return out


def loss_sums_of(logits: torch.Tensor, labels: torch.Tensor, token_bytes: torch.Tensor | None) -> torch.Tensor:
    """``[cross-entropy sum over all tokens, sum over the tokens that stand for text]`` (the second is 0
    without ``token_bytes``), as plain local values: the loss of a pipeline's evaluation runs this too."""
    total = to_local_value(cross_entropy_sum(logits, labels))
    if token_bytes is None:
        return torch.stack([total, torch.zeros_like(total)])
    text_labels = labels.masked_fill(bytes_of(token_bytes, labels) == 0, -100)  # -100: cross_entropy's ignore_index
    return torch.stack([total, to_local_value(cross_entropy_sum(logits, text_labels))])


def combine_validation(results: dict[str, tuple[float, dict[str, float]]]) -> dict[str, float]:
    """A mixture's validation from each source's (``name -> (weight, validation_loss result)``): every
    source's figures as ``val_loss/<name>`` (``val_bpb/<name>``), and ``val_loss`` (``val_bpb``) as their
    mean weighted by the mixture weights, the loss the training mixture is expected to have (over the sources
    that scored tokens; none: no ``val_loss``)."""
    scored = [(w, r) for w, r in results.values() if "val_loss" in r]
    total = sum(w for w, _ in scored)
    out: dict[str, float] = {}
    for key in ("val_loss", "val_bpb"):
        if scored and all(key in r for _, r in scored):
            out[key] = sum(w * r[key] for w, r in scored) / total
    if "val_loss" in out:
        out["val_perplexity"] = math.exp(min(out["val_loss"], 80.0))
    for name, (_, r) in results.items():
        out.update({f"{key}/{name}": value for key, value in r.items() if key != "val_perplexity"})
    return out


def bytes_of(token_bytes: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The bytes of text each label stands for, 0 at masked labels (-100 would index from the end)."""
    return torch.where(labels == -100, 0, token_bytes[labels.clamp(min=0)])


class ValidationHook(Hook):
    """``[validation]`` in the loop: ``evaluate()`` every ``freq`` steps and at the last step."""

    def __init__(self, section: Any, evaluate: Callable[[], dict[str, float]]):
        self.freq, self.evaluate = section.freq, evaluate

    def on_step_end(self, state: LoopState, result: Any) -> None:
        if state.step % self.freq == 0 or state.last_step:
            with state.side_work():
                val = {"step": state.step, **self.evaluate()}
            state.log(val)
            if "val_loss" not in val:
                logger.warning(
                    "step %d | validation: no scored tokens (every label of the validation windows is masked, "
                    "e.g. chat data with no assistant token in them)",
                    state.step,
                )
                return
            bpb = f" | bits per byte {val['val_bpb']:.4f}" if "val_bpb" in val else ""
            names = [k.removeprefix("val_loss/") for k in val if k.startswith("val_loss/")]
            per_source = " | " + ", ".join(f"{n} {val['val_loss/' + n]:.4f}" for n in names) if names else ""
            if empty := [k.removeprefix("val_tokens/") for k in val if k.startswith("val_tokens/")]:
                per_source += f" | no scored tokens in {', '.join(empty)}"
            logger.info(
                "step %d | validation loss %.4f | perplexity %.2f%s%s",
                state.step,
                val["val_loss"],
                val["val_perplexity"],
                bpb,
                per_source,
            )
