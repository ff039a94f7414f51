"""Muon for the hidden matrices and AdamW for the rest, as one optimizer (``[optimizer] name = "muon"``).

:class:`MuonAdamW` is a ``torch.optim.AdamW`` whose ``param_groups`` also hold a Muon group (``"muon": True``): one
object for the LR schedule (each group's lr follows it, so both optimizers do), the guard's ``lr_scale``, the
checkpoint (its ``state`` holds AdamW's two moments for AdamW's parameters and one ``momentum_buffer`` for Muon's,
each a DTensor placed as its parameter, so DCP reshards them) and the metrics. ``step`` runs AdamW's own step on
the AdamW groups, then Muon's (:mod:`titanlite.optim.muon_math`, with sharded matrices gathered to an owner rank by
:class:`~titanlite.optim.muon_dist.Exchange`). The split: :mod:`titanlite.optim.muon_split`; docs/muon.md.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.optim.muon_dist import Exchange, holds_whole
from titanlite.optim.muon_math import EPS, adjusted_lr, momentum_update, newton_schulz
from titanlite.optim.muon_split import split_params
from titanlite.optim.optimizer import kernel_kwargs, param_groups

NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def ns_dtype(name: str, device: torch.device) -> torch.dtype:
    """The Newton-Schulz dtype of ``[optimizer] ns_dtype``: auto is bf16 on a GPU (as the references), fp32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return NS_DTYPES[name]


class MuonAdamW(torch.optim.AdamW):
    """AdamW over ``adamw_groups`` and Muon over ``muon_group`` (a param group dict with Muon's keys: ``lr``,
    ``weight_decay``, ``momentum``, ``nesterov``, ``ns_coefficients``, ``ns_steps``, ``ns_dtype``,
    ``adjust_lr_fn``); ``adamw`` are AdamW's keyword arguments. See the module docstring."""

    def __init__(self, adamw_groups: list[dict], muon_group: dict, **adamw):
        super().__init__([*adamw_groups, {**muon_group, "muon": True}], **adamw)
        self._step_supports_amp_scaling = False  # a fused kernel's grad_scale would not reach Muon's parameters
        self._exchange: Exchange | None = None

    def __setstate__(self, state: dict) -> None:
        """AdamW's (which reads each state's ``step``) on AdamW's states, Muon's momentum states kept as loaded."""
        muon = {p: s for p, s in state["state"].items() if "momentum_buffer" in s}
        rest = defaultdict(dict, {p: s for p, s in state["state"].items() if p not in muon})
        super().__setstate__({**state, "state": rest})
        self.state.update(muon)

    @torch.no_grad()
    def step(self, closure=None):
        """AdamW's step on its groups, then Muon's on the Muon group."""
        groups = self.param_groups
        self.param_groups = [g for g in groups if not g.get("muon")]
        try:
            loss = super().step(closure)
        finally:
            self.param_groups = groups
        for group in groups:
            if group.get("muon"):
                self._muon_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        """Momentum, Newton-Schulz (gathered where sharded), decoupled weight decay and the scaled update."""
        params = group["params"]
        if not params:
            return
        updates = []
        for p in params:
            if p.grad is None:
                updates.append(None)
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            buf = _local(state["momentum_buffer"])
            updates.append(momentum_update(_local(p.grad), buf, group["momentum"], group["nesterov"]))
        lr, wd = group["lr"], group["weight_decay"]
        for p, o in zip(params, self._orthogonalize(params, updates, group)):
            if o is not None:
                local = _local(p)
                local.mul_(1 - lr * wd)
                local.add_(o.view(local.shape), alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))

    def _orthogonalize(self, params: list, updates: list, group: dict) -> list:
        """Each parameter's orthogonalized update (local piece), None where it has no gradient."""
        dtype = ns_dtype(group["ns_dtype"], _local(params[0]).device)
        coefficients, steps = tuple(group["ns_coefficients"]), group["ns_steps"]

        def ns(x: torch.Tensor) -> torch.Tensor:
            return newton_schulz(x, coefficients, steps, dtype, group.get("eps", EPS))

        out = [None] * len(params)
        single = not dist.is_initialized() or dist.get_world_size() == 1
        sharded = [i for i, p in enumerate(params) if not (single or holds_whole(p))]
        started, whole_skip = None, set(sharded)
        if not single:  # the sharded matrices travel to their owners while this rank works on the whole ones
            if self._exchange is None:
                self._exchange = Exchange([params[i] for i in sharded], steps, _local(params[0]).device)
            flat = [updates[i] if updates[i] is not None else torch.zeros_like(_local(params[i])) for i in sharded]
            started = self._exchange.start([u.to(dtype).reshape(-1) for u in flat], dtype)
        for i, u in enumerate(updates):
            if u is not None and i not in whole_skip:
                out[i] = ns(u)
        if not single:
            for i, piece in zip(sharded, self._exchange.finish(started, ns, dtype)):
                out[i] = piece if updates[i] is not None else None
        return out


def build_muon(model: nn.Module, cfg) -> MuonAdamW:
    """``[optimizer] name = "muon"``: Muon for the split's matrices (:func:`~titanlite.optim.muon_split.split_params`),
    AdamW with ``lr``, betas, eps and weight decay for the rest."""
    muon, adamw = split_params(model, cfg.muon_params, cfg.adamw_params)
    muon_group = {
        "params": [p for _, p in muon],
        "lr": cfg.muon_lr if cfg.muon_lr > 0 else cfg.lr,
        "weight_decay": cfg.weight_decay,
        "momentum": cfg.momentum,
        "nesterov": cfg.nesterov,
        "ns_coefficients": tuple(cfg.ns_coefficients),
        "ns_steps": cfg.ns_steps,
        "ns_dtype": cfg.ns_dtype,
        "adjust_lr_fn": cfg.adjust_lr_fn,
        "eps": EPS,
    }
    groups = param_groups(model, cfg.weight_decay, only=adamw)
    kwargs = kernel_kwargs(model, cfg.implementation)
    return MuonAdamW(groups, muon_group, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kwargs)
