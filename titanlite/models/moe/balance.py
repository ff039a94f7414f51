"""Load balancing of MoE layers: the auxiliary losses and the aux-loss-free bias.

**Auxiliary losses** follow the loss contract (:mod:`titanlite.trainer.step`): each layer's term is a token sum
divided by the step's token count (``MoE.aux_divisor``, set by :class:`~titanlite.models.moe.step.MoEStep`; 0, as
in a foreign loop, means this micro-batch's own tokens), so accumulation and data parallelism equal one big batch.
:class:`AddAuxLoss` on the layer's output gives the term a gradient of 1 in backward, as if added to the loss,
which works in every pipeline stage, under activation checkpointing and compile alike.

- Switch/GShard loss, ``coef x E x sum_i f_i P_i`` (``f_i`` the fraction of routed slots choosing expert ``i``,
  ``P_i`` its mean normalized score): per **sequence** (DeepSeek-V3's, exact under any split of the batch; under
  context parallelism ``f`` sums each sequence's counts over ``MoE.seq_group``) or per **batch**, where ``f``
  counts one forward pass of every data-parallel (and CP) rank together (an all-reduce of E counts over
  ``MoE.load_group``); as a token sum, ``coef x sum_i f_i x sum_t p_ti``.
- Router z-loss (ST-MoE): ``coef x logsumexp(logits_t)^2`` per token.

**Aux-loss-free bias** (DeepSeek-V3): after each optimizer step ``expert_bias`` moves by ``rate x sign(mean load -
load_i)``, the load summed over every data-parallel rank, so the bias is the same on every rank.

**Statistics**: sums per layer in training mode (non-persistent buffers). Activation checkpointing counts a block
twice; every logged figure is a ratio of two such sums and the bias update uses only a sign, so neither changes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

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


def aux_loss_sum(routing: Routing, cfg, batch_shape: tuple[int, int], load_group=None, seq_group=None) -> torch.Tensor:
    """The Switch/GShard balance loss of one micro-batch as a token sum (module docstring), x ``aux_loss_coef``.
    ``seq_group``: the context-parallel ranks holding the other parts of these sequences, whose counts ``f``
    takes too (each rank's share of the sum then adds up to the whole sequences' loss)."""
    e, k = cfg.num_experts, cfg.top_k
    probs = routing.scores / routing.scores.sum(-1, keepdim=True)  # softmax scores already sum to 1
    if cfg.aux_loss_level == "seq":
        bsz, seq = batch_shape
        counts = all_reduce_counts(one_hot_counts(routing.experts.view(bsz, seq * k), e).float(), seq_group)  # [B, E]
        whole = seq if seq_group is None else seq * dist.get_world_size(seq_group)  # the whole sequences' length
        f = counts * (e / (k * whole))
        return cfg.aux_loss_coef * (f * probs.view(bsz, seq, e).sum(1)).sum()
    counts = expert_counts(routing.experts, e).float()
    tokens = torch.tensor([float(routing.experts.shape[0])], device=counts.device)
    totals = all_reduce_counts(torch.cat([counts, tokens]), load_group)
    f = totals[:e] * (e / (k * totals[e]))
    return cfg.aux_loss_coef * (f * probs.sum(0)).sum()
