"""What :class:`~titanlite.checkpoint.manager.CheckpointManager` saves, and how it is read back:
:class:`CheckpointStates` sorts the objects given by how each is stored; :class:`ModelState` (sharded model state
dicts), :class:`OptimizerState` (keyed by parameter name) and :class:`RNGState` (one per rank: python ``random``,
torch's CPU generator and, on CUDA, the device's; OLMo-core's habit) are the ``Stateful`` wrappers DCP saves."""

from __future__ import annotations

import logging
import random
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlite.checkpoint import codec
from titanlite.errors import CheckpointError

logger = logging.getLogger("titanlite.checkpoint")


class ModelState:
    """A model as a DCP ``Stateful`` (sharded state dicts); cast to ``dtype`` when saving, if given."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None = None):
        self.model, self.dtype = model, dtype

    def state_dict(self) -> dict[str, Any]:
        sd = get_model_state_dict(self.model)
        if self.dtype is None:
            return sd
        return {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in sd.items()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_model_state_dict(self.model, sd)


class OptimizerState:
    """An optimizer as a DCP ``Stateful``: its state keyed by the model's parameter names."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, group: Any = None):
        self.model, self.optimizer, self.group = model, optimizer, group

    def state_dict(self) -> dict[str, Any]:
        sd = get_optimizer_state_dict(self.model, self.optimizer)
        groups = sd["param_groups"]
        if hasattr(self.model, "stages"):  # pipeline stages: each rank's groups name other parameters
            groups = all_ranks_param_groups(groups, self.group)
        return {**sd, "param_groups": codec.encode(groups, "param_groups")}  # JSON, not pickles

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, sd)


def all_ranks_param_groups(groups: list[dict[str, Any]], group: Any = None) -> list[dict[str, Any]]:
    """``groups`` with every rank's parameter names in each group's ``params``. DCP stores one copy of a value
    every rank holds, so under pipeline parallelism (where each rank's groups list its own stages' parameters)
    the stored groups must be the same on all ranks; a load keeps the names of the parameters it has."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, groups, group=group)
    merged = [dict(g, params=list(g["params"])) for g in everyone[0]]
    for other in everyone[1:]:
        for mine, theirs in zip(merged, other):
            seen = set(mine["params"])
            mine["params"] += [p for p in theirs["params"] if p not in seen]
    return merged


class RNGState:
    def __init__(self, device: torch.device | None = None):
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"python": random.getstate(), "torch_cpu": torch.get_rng_state()}
        if self.device is not None and self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch_cpu"])
        if self.device is not None and self.device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device)


def missing_optimizer_entry(key: str, template: dict[str, Any], entries: dict[str, Any]) -> str | None:
    """The first state entry of the optimizer's ``template`` that the checkpoint's ``entries`` lack (the folder
    was written by another optimizer: AdamW's moments against Muon's momentum buffer), else None."""
    for fqn, values in template["state"].items():
        for name in values:
            if f"{key}.state.{fqn}.{name}" not in entries:
                return f"{key}.state.{fqn}.{name}"
    return None


def rebase_schedule(scheduler: Any) -> None:
    """A ``LambdaLR`` loaded from a run with another optimizer's param groups: its step kept, its base learning rates
    and the groups' current ones recomputed from this optimizer's groups."""
    groups = scheduler.optimizer.param_groups
    scheduler.base_lrs = [g["initial_lr"] for g in groups]
    fns = scheduler.lr_lambdas
    fns = fns if len(fns) == len(groups) else [fns[0]] * len(groups)  # one schedule function for every group
    scheduler.lr_lambdas = fns
    for g, base, fn in zip(groups, scheduler.base_lrs, fns):
        g["lr"] = base * fn(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in groups]


class CheckpointStates:
    """The objects to save by name, sorted: the one ``nn.Module`` (``model_key``), the ``optimizers``, ``per_rank``
    (``{name: (object, key)}``: a data loader, or an object with ``per_rank_state``, under ``dp_rank_<r>``; the RNG
    under ``rank_<r>`` when ``rng``) and ``shared`` (any other ``Stateful``, the same on every rank)."""

    def __init__(self, states: dict[str, Any], *, dp_rank: int, rank: int, device: Any, rng: bool | None):
        modules = [(k, v) for k, v in states.items() if isinstance(v, nn.Module)]
        if len(modules) != 1:
            raise ValueError(f"CheckpointManager needs exactly one nn.Module in states, got {len(modules)}")
        self.model_key, self.model = modules[0]
        self.optimizers = {k: v for k, v in states.items() if isinstance(v, torch.optim.Optimizer)}
        per_rank = [
            k for k, v in states.items() if isinstance(v, StatefulDataLoader) or getattr(v, "per_rank_state", 0)
        ]
        self.per_rank = {k: (states[k], f"dp_rank_{dp_rank}") for k in per_rank}  # data positions
        if rng if rng is not None else bool(self.optimizers):  # a training state, not weights only
            self.per_rank["rng"] = (RNGState(device), f"rank_{rank}")
        self.shared = {
            k: v
            for k, v in states.items()
            if k not in self.per_rank and k != self.model_key and k not in self.optimizers
        }
        for k, v in self.shared.items():
            if not (callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))):
                raise TypeError(f"checkpoint state {k!r} ({type(v).__name__}) has no state_dict/load_state_dict")

    def to_save(self, model_only: bool, dtype: torch.dtype | None, group: Any) -> dict[str, Any]:
        state: dict[str, Any] = {self.model_key: ModelState(self.model, dtype)}
        if model_only:
            return state
        for k, opt in self.optimizers.items():
            state[k] = OptimizerState(self.model, opt, group)
        for k, obj in self.shared.items():
            state[k] = codec.encode(obj.state_dict(), k)
        for k, (obj, key) in self.per_rank.items():
            state[k] = {key: codec.encode(obj.state_dict(), k)}
        return state

    def placeholders(self, path: str, entries: dict[str, Any], model_only: bool) -> dict[str, Any]:
        """What DCP loads ``path`` into: the model's own (sharded) tensors, and placeholders of the stored sizes
        (``entries``: :func:`~titanlite.checkpoint.layout.stored_entries`) for the rest."""

        def stored(prefix: str) -> dict[str, torch.Tensor]:  # placeholders of the entries under prefix
            found = {k[len(prefix) :]: v for k, v in entries.items() if k.startswith(prefix)}
            if pickled := [prefix + k for k, v in found.items() if v is None]:
                raise CheckpointError(
                    f"{path} stores {pickled[0]} as a pickle (an older titanlite or another tool wrote it); "
                    "titanlite never unpickles checkpoint data, so it cannot resume from this folder"
                )
            return codec.placeholders(found)

        state: dict[str, Any] = {self.model_key: get_model_state_dict(self.model)}
        if model_only:
            return state
        self.switched = set()
        for k, opt in self.optimizers.items():
            template = get_optimizer_state_dict(self.model, opt)
            if (missing := missing_optimizer_entry(k, template, entries)) is not None:
                logger.warning(
                    f"checkpoint {path}: its {k} state was written by another optimizer (it has no {missing}): the "
                    f"{k} ({type(opt).__name__}) starts with an empty state; the LR schedule keeps its position"
                )
                opt.state.clear()  # drop what building the template created
                self.switched.add(k)
                continue
            state[k] = {**template, "param_groups": stored(f"{k}.param_groups.")}
        for k in self.shared:
            state[k] = stored(f"{k}.")
            if not state[k]:
                raise CheckpointError(f"{path} has no saved state {k!r}")
        for k, (_, own) in self.per_rank.items():
            fallback = "dp_rank_0" if own.startswith("dp_rank_") else None
            for key in (own, fallback):
                if key is not None and (found := stored(f"{k}.{key}.")):
                    state[k] = {key: found}
                    break
        return state

    def decode(self, state: dict[str, Any]) -> dict[str, Any]:
        """The loaded ``state`` with its JSON entries decoded (ValueError when damaged)."""
        for k in state:
            if k in self.shared:
                state[k] = codec.decode(state[k])
            elif k in self.per_rank:
                state[k] = codec.decode(next(iter(state[k].values())))
            elif k in self.optimizers:
                state[k]["param_groups"] = codec.decode(state[k]["param_groups"])
        return state

    def apply(self, state: dict[str, Any], path: str) -> None:
        """Load the decoded ``state`` into the objects; a per-rank state the folder lacks is kept, with a warning."""
        set_model_state_dict(self.model, state[self.model_key])
        for k, opt in self.optimizers.items():
            if k in state:
                set_optimizer_state_dict(self.model, opt, state[k])
        objects = {**self.shared, **{k: obj for k, (obj, _) in self.per_rank.items()}}
        for k, obj in objects.items():
            if k in state:
                obj.load_state_dict(state[k])
                if any(getattr(obj, "optimizer", None) is self.optimizers[o] for o in getattr(self, "switched", ())):
                    rebase_schedule(obj)
            elif k in self.per_rank and len(state) > 1:
                logger.warning(f"checkpoint {path} has no {k} state for this rank (saved with fewer ranks); kept as is")
