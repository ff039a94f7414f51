"""The routed experts: SwiGLU MLPs whose weights are stacked ``[E, ...]`` tensors.

``w1`` and ``w3`` are ``[E, hidden, dim]``, ``w2`` is ``[E, dim, hidden]``: expert ``e``'s slices are laid out as
``nn.Linear`` weights (Hugging Face's per-expert projections), so a checkpoint converts by (un)stacking. Under
expert parallelism they are DTensors sharded on dimension 0 (global shapes in checkpoints; each rank computes
with its local experts). Input: the tokens sorted by expert and the count per local expert; two implementations
give the same result:

- ``grouped_mm``: one ``torch._grouped_mm`` per weight over the whole sorted batch (no host sync, one compiled
  graph; outside bf16, whose tracing kernel torch lacks, through the custom op :func:`grouped_mm`);
- the loop: one matmul per expert (the reference, and the fallback where ``_grouped_mm`` is missing).

Under autocast both compute in the autocast dtype, like ``nn.Linear``; on CUDA an fp32 model takes the loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def local(w: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a (possibly expert-parallel) stacked weight."""
    return w.to_local() if isinstance(w, DTensor) else w


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class GroupedExperts(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, num_experts: int, grouped_mm: bool = True):
        super().__init__()
        self.num_experts = num_experts
        self.grouped_mm = grouped_mm and HAS_GROUPED_MM
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def init_weights(self, init_std: float) -> None:
        for w, std in ((self.w1, 0.02), (self.w2, init_std), (self.w3, init_std)):
            nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x [M, dim]`` sorted by local expert, ``counts [E_local]`` tokens per local expert -> ``[M, dim]``."""
        dtype = _compute_dtype(x)
        w1, w2, w3 = (local(w).to(dtype) for w in (self.w1, self.w2, self.w3))
        x = x.to(dtype)
        if self.grouped_mm and (dtype == torch.bfloat16 or not x.is_cuda):  # CUDA's kernel: bf16 (torch 2.11)
            return grouped_swiglu(x, w1, w2, w3, counts)
        return looped_swiglu(x, w1, w2, w3, counts)


def grouped_swiglu(x, w1, w2, w3, counts: torch.Tensor) -> torch.Tensor:
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    mm = (lambda a, b: torch._grouped_mm(a, b, offs=offs)) if x.dtype == torch.bfloat16 else _grouped_mm_op(offs)
    h = F.silu(mm(x, w1.transpose(-2, -1))) * mm(x, w3.transpose(-2, -1))
    return mm(h, w2.transpose(-2, -1))


# torch's fake (tracing) kernel of _grouped_mm accepts bf16 only, so torch.compile cannot trace it in fp32;
# in other dtypes the same kernel runs as this custom op, whose shapes and backward are given here.
@torch.library.custom_op("titanlite::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``[M, K] x [G, K, N] -> [M, N]``: rows ``offs[g-1]:offs[g]`` of ``a`` times ``b[g]``."""
    return torch._grouped_mm(a, b, offs=offs)


@torch.library.custom_op("titanlite::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``[M, K], [M, N] -> [G, K, N]``: group ``g``'s ``a^T grad`` (the gradient of :func:`grouped_mm`'s ``b``)."""
    return torch._grouped_mm(a.t(), grad, offs=offs)


@grouped_mm.register_fake
def _(a, b, offs):
    return a.new_empty((a.shape[0], b.shape[-1]))


@grouped_mm_weight_grad.register_fake
def _(a, grad, offs):
    return a.new_empty((offs.shape[0], a.shape[1], grad.shape[1]))


def _grouped_mm_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _grouped_mm_backward(ctx, grad):
    a, b, offs = ctx.saved_tensors
    grad = grad.contiguous()
    return grouped_mm(grad, b.transpose(-2, -1), offs), grouped_mm_weight_grad(a, grad, offs), None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def _grouped_mm_op(offs: torch.Tensor):
    return lambda a, b: grouped_mm(a, b, offs)


def looped_swiglu(x, w1, w2, w3, counts: torch.Tensor) -> torch.Tensor:
    outs = []
    for e, chunk in enumerate(torch.split(x, counts.tolist())):
        outs.append(F.linear(F.silu(F.linear(chunk, w1[e])) * F.linear(chunk, w3[e]), w2[e]))
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])
