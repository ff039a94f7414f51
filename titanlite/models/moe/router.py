"""The token router of an MoE layer: scores, top-k choice (optionally group-limited), weights.

``TopKRouter(x [N, dim])`` returns a :class:`Routing`. The choice uses the scores plus ``expert_bias``
(DeepSeek-V3's aux-loss-free balancing, a persistent buffer the loop updates after each optimizer step:
:mod:`titanlite.models.moe.balance`; zero when not updated), which only moves the choice: the weights come from
the scores alone.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.moe.args import MoEConfig


class Routing(NamedTuple):
    weights: torch.Tensor  # [N, k] the chosen experts' weights (fp32)
    experts: torch.Tensor  # [N, k] the chosen expert ids
    scores: torch.Tensor  # [N, E] the scores (fp32): softmax or sigmoid of the logits
    logits: torch.Tensor  # [N, E] the router logits (fp32)


class TopKRouter(nn.Module):
    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(dim, cfg.num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32), persistent=True)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)
        self.expert_bias.zero_()

    def forward(self, x: torch.Tensor) -> Routing:
        cfg = self.cfg
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if cfg.score_func == "softmax" else logits.sigmoid()
        biased = scores + self.expert_bias
        if cfg.n_groups > 1 and cfg.topk_groups < cfg.n_groups:
            biased = limit_to_groups(biased, cfg.n_groups, cfg.topk_groups)
        experts = biased.topk(cfg.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        if cfg.route_scale != 1.0:
            weights = weights * cfg.route_scale
        return Routing(weights, experts, scores, logits)


def limit_to_groups(scores: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
    """``scores [N, E]`` with every expert outside the ``topk_groups`` best of ``n_groups`` contiguous groups
    set to -inf; a group's score is the sum of its two best (one, for groups of one) expert scores."""
    n, e = scores.shape
    grouped = scores.view(n, n_groups, e // n_groups)
    group_scores = grouped.topk(min(2, e // n_groups), dim=-1).values.sum(-1)  # [N, G]
    keep = group_scores.topk(topk_groups, dim=-1).indices
    mask = torch.ones(n, n_groups, dtype=torch.bool, device=scores.device).scatter_(1, keep, False)
    return grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).view(n, e)


def router_entropy(scores: torch.Tensor) -> torch.Tensor:
    """Summed entropy (nats) of each token's routing distribution (scores normalized to sum to 1)."""
    p = scores / scores.sum(-1, keepdim=True)
    return -(p * p.clamp_min(1e-20).log()).sum()


def z_loss_sum(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss (ST-MoE) summed over tokens: ``sum_t logsumexp(logits_t)^2``."""
    return torch.logsumexp(logits, dim=-1).square().sum()


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens (token-slot pairs) routed to each expert: ``[E]`` int64 (static shape, unlike bincount)."""
    flat = experts.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def one_hot_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Per-row counts ``[B, E]`` of expert ids ``[B, ...]`` (a sequence's routed slots per expert)."""
    flat = experts.reshape(experts.shape[0], -1)
    return F.one_hot(flat, num_experts).sum(1)
