"""Muon's arithmetic as pure functions: the momentum update, the Newton-Schulz orthogonalization (of one matrix or a
batch of them), the update-scale rule and the iteration's FLOPs.

Each follows ``torch.optim.Muon`` (torch/optim/_muon.py) operation for operation, so that on the same input and in
the same dtype the result is the same bits (tests/optim/test_muon.py compares them): the momentum is an EMA kept by
``lerp``, Nesterov's look-ahead is ``grad.lerp(buf, momentum)``, the iteration works on the wide orientation (rows <=
columns) after dividing by the Frobenius norm, and the two ``addmm`` per step are torch's. A batch of matrices (a
MoE layer's stacked experts) runs the same steps with ``baddbmm`` and a norm per matrix.
"""

from __future__ import annotations

import math

import torch

DEFAULT_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, torch.optim.Muon's default
EPS = 1e-7  # torch.optim.Muon's eps: the norm's floor
ADJUST_LR_FNS = ("original", "match_rms_adamw")


def momentum_update(grad: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """Move the EMA ``buf`` towards ``grad`` in place and return the matrix to orthogonalize: Nesterov's
    look-ahead ``grad + momentum * (buf - grad)``, or ``buf`` itself."""
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


def newton_schulz(
    g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, dtype: torch.dtype, eps: float = EPS
) -> torch.Tensor:
    """The approximate orthogonalization ``U S' V^T`` of ``g`` (a matrix, or a batch of matrices along dim 0)
    by ``steps`` quintic Newton-Schulz iterations in ``dtype``; a new tensor of ``g``'s shape in ``dtype``."""
    if g.ndim not in (2, 3):
        raise ValueError(f"Newton-Schulz takes a matrix or a batch of matrices, got shape {tuple(g.shape)}")
    a, b, c = coefficients
    tall = g.size(-2) > g.size(-1)
    x = g.to(dtype, copy=True)
    if tall:
        x = x.mT
    if g.ndim == 2:
        x.div_(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        x.div_(x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def adjusted_lr(lr: float, rule: str, shape: tuple[int, ...]) -> float:
    """The learning rate of one matrix of ``shape`` (its last two dims: rows A, columns B) under ``rule``:
    ``original`` (Keller Jordan): ``lr * sqrt(max(1, A / B))``; ``match_rms_adamw`` (Moonshot): ``lr * 0.2 *
    sqrt(max(A, B))``, an update of AdamW's RMS so AdamW's lr and weight decay carry over."""
    rows, cols = shape[-2], shape[-1]
    if rule == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"unknown adjust_lr_fn {rule!r}; expected one of {', '.join(ADJUST_LR_FNS)}")


def newton_schulz_flops(shape: tuple[int, ...], steps: int) -> int:
    """Multiply-add FLOPs (2 per MAC) of ``steps`` iterations on a matrix (or batch) of ``shape``: with m <= n
    the short and long sides, each step is the Gram matrix (m x n x m), its square (m^3) and the product
    with X (m x m x n)."""
    batch = math.prod(shape[:-2])
    m, n = sorted(shape[-2:])
    return batch * steps * (4 * m * m * n + 2 * m**3)
