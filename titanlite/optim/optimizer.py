"""AdamW with weight decay on matrices only.

Weight-decay groups: parameters with two or more dimensions that are not embeddings get
``weight_decay`` (the linear weights, which hold almost all parameters); norms, biases and the token
embedding get none. Decaying norm gains pulls them towards zero for no benefit, and decaying the
embedding shrinks rare tokens' rows that receive few gradient updates. A tied output shares the
embedding tensor and so follows the embedding (no decay).

Kernel: ``fused`` on CUDA (one kernel for all parameters), ``foreach`` elsewhere; both also work on
DTensor parameters (FSDP2 / TP).
"""

from __future__ import annotations

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float, only: list[nn.Parameter] | None = None) -> list[dict]:
    """The weight-decay groups of ``model``'s parameters (see the module docstring), or of ``only`` those."""
    decay, no_decay = [], []
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for p in model.parameters() if only is None else only:  # a shared (tied) tensor comes once
        if p.requires_grad:
            (decay if p.ndim >= 2 and id(p) not in embeddings else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [part for g in groups for part in _split_plain_from_dtensors(g)]


def _split_plain_from_dtensors(group: dict) -> list[dict]:
    """``group``, or two groups when it mixes DTensor and plain parameters (MoE layers replicated over
    tensor-parallel ranks without FSDP): one foreach kernel cannot take both kinds."""
    from torch.distributed.tensor import DTensor

    kinds = [[p for p in group["params"] if isinstance(p, DTensor) == dt] for dt in (True, False)]
    if not all(kinds):
        return [group]
    return [{**group, "params": params} for params in kinds]


def kernel_kwargs(model: nn.Module, implementation: str) -> dict:
    """AdamW's ``fused`` / ``foreach`` flags for ``[optimizer] implementation`` (auto: fused on CUDA)."""
    impl = implementation
    if impl == "auto":
        impl = "fused" if any(p.device.type == "cuda" for p in model.parameters()) else "foreach"
    return {"fused": impl == "fused", "foreach": impl == "foreach"}


def build_optimizer(model: nn.Module, cfg) -> torch.optim.Optimizer:
    """The optimizer of the ``[optimizer]`` section for ``model``'s parameters (after parallelize)."""
    kwargs = kernel_kwargs(model, cfg.implementation)
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[cfg.name]
    wd = cfg.weight_decay if cfg.name == "AdamW" else 0.0
    return cls(param_groups(model, wd), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kwargs)
