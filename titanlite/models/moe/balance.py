"""Load balancing of MoE layers: the auxiliary losses, the aux-loss-free bias, and their step bookkeeping.

**Auxiliary losses, in the loss contract.** The training loss is a token *sum* divided once by the
number of tokens in the whole optimizer step (:mod:`titanlite.train_step`), so that accumulation and
data parallelism equal one big batch. The MoE losses follow it: each layer computes its term as a sum
over its tokens and divides it by the step's token count (``MoE.aux_divisor``, which
:class:`MoEStep` sets before each step; 0, a foreign loop that never sets it, means this micro-batch's
own tokens). The term reaches the gradients through :class:`AddAuxLoss` on the layer's output: its
backward hands the term a gradient of 1, as if it had been added to the loss, which works in every
pipeline stage, under activation checkpointing and compile alike. The logged ``loss`` stays the
cross-entropy; the terms are logged as ``moe/aux_loss`` and ``moe/z_loss``.

- Switch/GShard loss, ``coef x E x sum_i f_i P_i`` with ``f_i`` the fraction of routed slots that chose
  expert ``i`` and ``P_i`` the mean (normalized) score of ``i``: per **sequence** (DeepSeek-V3's
  sequence-wise loss, a sum of per-sequence terms: exact under any split of the batch) or per
  **batch**, where ``f`` counts the micro-batch of every data-parallel rank together (one all-reduce of
  E counts over ``MoE.load_group``), so DP ranks train exactly as one process with their union.
  As a token sum a batch's term is ``coef x sum_i f_i x sum_t p_ti``.
- Router z-loss (ST-MoE): ``coef x logsumexp(logits_t)^2`` per token.

**Aux-loss-free bias** (DeepSeek-V3): after each optimizer step every layer's ``expert_bias`` moves by
``rate x sign(mean load - load_i)``, the load being the step's routed slots per expert summed over
every data-parallel rank, so the bias is identical on every rank (:meth:`MoEStep.end_step`).

**Statistics.** Each layer accumulates, in training mode, its routed slots per expert and the sums of
its tokens, router entropy and loss terms (non-persistent buffers, no gradient). Activation
checkpointing recomputes a block's forward and counts it twice; every logged figure is a ratio of
two such sums and the bias update uses only the sign of a difference, so neither changes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from titanlite.models.moe.router import Routing, expert_counts, one_hot_counts

STATS = ("tokens", "entropy", "aux_loss", "z_loss")


class AddAuxLoss(torch.autograd.Function):
    """``out`` unchanged; backward also gives ``aux`` (a scalar) the gradient 1."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), dtype=torch.float32, device=grad.device)


def all_reduce_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """``counts`` summed over ``group`` (None: unchanged), with a traceable functional collective."""
    if group is None:
        return counts
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(counts, "sum", group))


def aux_loss_sum(routing: Routing, cfg, batch_shape: tuple[int, int], load_group=None) -> torch.Tensor:
    """The Switch/GShard balance loss of one micro-batch as a token sum (module docstring), x ``aux_loss_coef``."""
    e, k = cfg.num_experts, cfg.top_k
    probs = routing.scores / routing.scores.sum(-1, keepdim=True)  # softmax scores already sum to 1
    if cfg.aux_loss_level == "seq":
        bsz, seq = batch_shape
        counts = one_hot_counts(routing.experts.view(bsz, seq * k), e).float()  # [B, E]
        f = counts * (e / (k * seq))
        return cfg.aux_loss_coef * (f * probs.view(bsz, seq, e).sum(1)).sum()
    counts = expert_counts(routing.experts, e).float()
    tokens = torch.tensor([float(routing.experts.shape[0])], device=counts.device)
    totals = all_reduce_counts(torch.cat([counts, tokens]), load_group)
    f = totals[:e] * (e / (k * totals[e]))
    return cfg.aux_loss_coef * (f * probs.sum(0)).sum()


class MoEStep:
    """The step bookkeeping of every MoE layer of a model (module docstring): ``begin_step(tokens)`` before
    the first micro-batch, ``end_step(updated)`` after the optimizer step (or after a step that was skipped)."""

    def __init__(self, layers: dict[int, nn.Module], n_blocks: int, group=None):
        self.layers, self.n_blocks, self.group = layers, n_blocks, group

    @classmethod
    def find(cls, model: nn.Module, group=None) -> MoEStep | None:
        """The MoE layers of ``model`` (a decoder whose blocks are ``layers.<i>``, or a rank's pipeline stages),
        or None when it has none; ``group``: the ranks over which loads are summed (the loss group: the
        data-parallel ranks, and the pipeline stages, which hold other blocks)."""
        from titanlite.models.moe.layer import MoE

        layers = {}
        for name, m in model.named_modules():
            if isinstance(m, MoE):
                parts = name.split(".")
                if len(parts) < 2 or parts[0] != "layers" or not parts[1].isdigit():
                    raise ValueError(f"MoE layer {name!r} is not inside a block 'layers.<i>'")
                layers[int(parts[1])] = m
        return cls(layers, model.args.n_layers, group) if layers else None

    def begin_step(self, tokens: int) -> None:
        for layer in self.layers.values():
            layer.aux_divisor.fill_(float(tokens))

    @torch.no_grad()
    def end_step(self, updated: bool = True) -> dict[str, float]:
        """Sum the step's statistics over the ranks, move the biases (when ``updated``), reset; returns the
        metrics: per layer ``moe/layers.<i>/load_max_mean`` (max / mean routed slots per expert) and
        ``moe/layers.<i>/entropy`` (mean router entropy, nats), and over all layers ``moe/load_max_mean`` (the
        worst layer's), ``moe/entropy`` (their mean), ``moe/aux_loss`` and ``moe/z_loss`` (the terms added to
        the loss, summed over the layers). One all-reduce of a ``[n_blocks, E + 4]`` table per step."""
        first = next(iter(self.layers.values()))
        width = first.cfg.num_experts + len(STATS)
        table = torch.zeros(self.n_blocks, width, device=first.stats.device)
        for i, layer in self.layers.items():
            table[i] = torch.cat([layer.tokens_per_expert, layer.stats])
        if self.group is not None:
            dist.all_reduce(table, group=self.group)
        metrics: dict[str, float] = {}
        ratios, entropies, aux, z = [], [], 0.0, 0.0
        for i, row in enumerate(table.tolist()):
            load, (tokens, ent, aux_sum, z_sum) = row[: width - len(STATS)], row[width - len(STATS) :]
            if tokens == 0:  # a dense block
                continue
            ratio = max(load) * len(load) / sum(load)
            metrics[f"moe/layers.{i}/load_max_mean"] = ratio
            metrics[f"moe/layers.{i}/entropy"] = ent / tokens
            ratios.append(ratio)
            entropies.append(ent / tokens)
            aux, z = aux + aux_sum / tokens, z + z_sum / tokens
            layer = self.layers.get(i)
            if layer is not None and updated and layer.cfg.bias_update_rate > 0:
                loads = table[i, : len(load)].to(layer.router.expert_bias.device)
                layer.router.expert_bias.add_(layer.cfg.bias_update_rate * torch.sign(loads.mean() - loads))
        for layer in self.layers.values():
            layer.tokens_per_expert.zero_()
            layer.stats.zero_()
        if ratios:
            metrics.update({"moe/load_max_mean": max(ratios), "moe/entropy": sum(entropies) / len(entropies)})
            metrics.update({"moe/aux_loss": aux, "moe/z_loss": z})
        return metrics
