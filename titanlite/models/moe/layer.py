"""The dropless mixture-of-experts feed-forward layer, for any decoder family.

    x [B, S, dim] -> N = B S tokens
      router:    scores, top-k experts and weights per token             (router.py)
      permute:   the N k (token, slot) pairs sorted by expert (stable), counts per expert
      experts:   SwiGLU per expert on its contiguous tokens: one grouped GEMM per weight,
                 or across the expert-parallel ranks (experts.py, expert_parallel.py)
      combine:   back in (token, slot) order, weighted sum over the k slots
      + shared:  an always-active SwiGLU of num_shared_experts x hidden_dim (optional)
      balance:   aux / z losses into the gradients, load statistics (balance.py)

Dropless: every (token, slot) pair is computed, whatever the imbalance (no capacity factor).
The layer holds no process group until a parallelize plan sets ``ep_group`` (expert parallelism:
the experts' weights are then sharded over it), ``load_group`` (the data-parallel ranks whose
batches a batch-level aux loss counts together) and ``seq_group`` (context-parallel ranks, which hold parts of
the same sequences, counted together by a sequence-level aux loss).
"""

from __future__ import annotations

import torch
from torch import nn

from titanlite.models.moe.args import MoEConfig
from titanlite.models.moe.balance import STATS, AddAuxLoss, aux_loss_sum
from titanlite.models.moe.expert_parallel import expert_parallel_swiglu
from titanlite.models.moe.experts import GroupedExperts
from titanlite.models.moe.router import TopKRouter, expert_counts, router_entropy, z_loss_sum


class MoE(nn.Module):
    """``forward(x [B, S, dim]) -> [B, S, dim]``; ``shared`` is ``shared_cls(dim, hidden)`` (the family's SwiGLU,
    e.g. Llama's ``FeedForward``) or None."""

    def __init__(self, dim: int, cfg: MoEConfig, shared_cls: type | None = None):
        super().__init__()
        self.cfg = cfg
        self.router = TopKRouter(dim, cfg)
        self.experts = GroupedExperts(dim, cfg.hidden_dim, cfg.num_experts, cfg.grouped_mm)
        self.shared_experts = None
        if cfg.num_shared_experts:
            if shared_cls is None:
                raise ValueError("model.moe_num_shared_experts > 0 needs the family's SwiGLU class (shared_cls)")
            self.shared_experts = shared_cls(dim, cfg.shared_hidden_dim)
        self.ep_group = None  # expert-parallel ranks (parallelize sets them)
        self.load_group = None  # data-parallel (and CP) ranks counted together by the batch-level aux loss
        self.seq_group = None  # CP ranks holding parts of the same sequences (the sequence-level aux loss)
        self.track_stats = True  # off: a forward that is not training (a pipeline's shape inference)
        # statistics of the current step (balance.MoEStep), and the step's token count for the loss terms
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.num_experts), persistent=False)
        self.register_buffer("stats", torch.zeros(len(STATS)), persistent=False)
        self.register_buffer("aux_divisor", torch.zeros(()), persistent=False)

    def init_weights(self, init_std: float) -> None:
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        for buf in (self.tokens_per_expert, self.stats, self.aux_divisor):
            buf.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        routing = self.router(tokens)
        k = self.cfg.top_k
        order = torch.argsort(routing.experts.reshape(-1), stable=True)  # (token, slot) pairs sorted by expert
        counts = expert_counts(routing.experts, self.cfg.num_experts)
        routed = tokens[order // k]
        if self.ep_group is not None:
            y = expert_parallel_swiglu(self.experts, routed, counts, self.ep_group)
        else:
            y = self.experts(routed, counts)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        slots = y[inverse].view(-1, k, dim)  # back in (token, slot) order
        out = (slots * routing.weights.unsqueeze(-1).to(slots.dtype)).sum(1)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        out = out.view(bsz, seq, dim).to(x.dtype)
        if self.training and self.track_stats:
            out = self._balance(out, routing, counts, (bsz, seq))
        return out

    def _balance(self, out: torch.Tensor, routing, counts: torch.Tensor, batch_shape: tuple[int, int]) -> torch.Tensor:
        """Record the statistics and add the aux / z loss terms (token sums / the step's tokens) to the gradients."""
        cfg, n = self.cfg, routing.experts.shape[0]
        aux = (
            aux_loss_sum(routing, cfg, batch_shape, self.load_group, self.seq_group) if cfg.aux_loss_coef > 0 else None
        )
        z = cfg.z_loss_coef * z_loss_sum(routing.logits) if cfg.z_loss_coef > 0 else None
        with torch.no_grad():
            self.tokens_per_expert.add_(counts.to(self.tokens_per_expert.dtype))
            zero = torch.zeros((), device=out.device)
            entries = [torch.full((), float(n), device=out.device), router_entropy(routing.scores)]
            entries += [zero if t is None else t.detach() for t in (aux, z)]
            self.stats.add_(torch.stack(entries).to(self.stats.dtype))
        terms = [t for t in (aux, z) if t is not None]
        if not terms or not torch.is_grad_enabled():
            return out
        divisor = torch.where(self.aux_divisor > 0, self.aux_divisor, torch.full_like(self.aux_divisor, n))
        return AddAuxLoss.apply(out, sum(terms) / divisor)
