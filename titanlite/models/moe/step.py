"""Each optimizer step's bookkeeping of a model's MoE layers (:class:`MoEStep`, used by ``TrainStep``): before the
first micro-batch every layer learns the step's token count (its aux / z loss divisor); after the optimizer step
the loads summed over the loss group (data-parallel ranks and pipeline stages) move each layer's aux-loss-free
bias, identically on every rank, and give the step's ``moe/*`` metrics.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from titanlite.models.moe.balance import STATS
from titanlite.models.moe.layer import MoE


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
        layers = {}
        for name, m in model.named_modules():
            if isinstance(m, MoE):
                parts = name.split(".")
                if len(parts) < 2 or parts[0] != "layers" or not parts[1].isdigit():
                    raise ValueError(f"MoE layer {name!r} is not inside a block 'layers.<i>'")
                layers[int(parts[1])] = m
        if not layers:
            return None
        n_blocks = getattr(getattr(model, "args", None), "n_layers", None) or max(layers) + 1  # the whole model's
        return cls(layers, n_blocks, group)

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
