"""Pipeline parallelism on ``torch.distributed.pipelining``, which provides the stages and the schedules; titanlite
adds what they leave to the caller:

1. **The split** (:class:`PipelinePlan`): the blocks cut into stages (evenly, by
   ``pipeline_parallel_layers_per_stage`` or at ``pipeline_parallel_split_points``), the embedding on the first,
   the final norm and output on the last; stages go to ranks in a loop, or in a V for ZBV and DualPipeV.
2. **The stage modules** (:func:`pipeline_decoder`, a family's ``pipeline_fn``): pruned copies of the meta model,
   to which the family's parallelize function then applies float8, TP, AC, compile and FSDP.
3. **One module per rank** (:class:`ModelParts`): so that the optimizer, clipping, metrics and DCP see one module
   whose state dict is a slice of the single-process one, and checkpoints reshard between layouts.
4. **The step**: :class:`titanlite.trainer.pipeline_runner.Pipeline` runs the schedule.

Tied parameters whose copies would fall in different stages (a tied embedding and output) are refused: torch's
stages would train two unsynchronized copies.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from titanlite.errors import ConfigError
from titanlite.parallel.pipeline_schedules import (
    MULTI_STAGE_SCHEDULES,
    V_SCHEDULES,
    pipeline_bubble_fraction,
    pipeline_rank_stages,
    split_evenly,
)
from titanlite.utils import torch_compat

SCHEDULES: dict[str, type] = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
}
_KEY = "parallelism.pipeline_parallel"


def is_multi_stage(schedule: str) -> bool:
    """Whether ``schedule`` runs several (virtual) stages per rank (the planner's list, which the tests check
    against torch's classes); V_SCHEDULES place two per rank in a V."""
    return schedule in MULTI_STAGE_SCHEDULES


def _sizes_from_split_points(points: Sequence[str], n_layers: int) -> list[int]:
    starts = []
    for p in points:
        m = re.fullmatch(r"layers\.(\d+)", p)
        if m is None or not 0 < int(m.group(1)) < n_layers:
            raise ConfigError(
                f"{_KEY}_split_points: {p!r} must name a block that starts a stage, 'layers.<i>' with 0 < i < "
                f"{n_layers} (model.n_layers)"
            )
        starts.append(int(m.group(1)))
    if starts != sorted(set(starts)):
        raise ConfigError(f"{_KEY}_split_points {list(points)} must be strictly increasing")
    bounds = [0, *starts, n_layers]
    return [b - a for a, b in zip(bounds, bounds[1:])]


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """How the model and the batch are cut, a pure function of the config and the layer count; build it with
    :meth:`from_config`. Stage ``s`` runs on pp rank ``s % pp``, or, for the V schedules, rank ``r`` holds stages
    ``r`` and ``2pp - 1 - r``."""

    degree: int
    schedule: str
    n_microbatches: int
    stage_sizes: tuple[int, ...]  # blocks per stage, in model order

    @classmethod
    def from_config(cls, section: Any, n_layers: int, local_batch_size: int) -> PipelinePlan:
        """From ``[parallelism]``; ``ValueError`` (one line) for a split or schedule that cannot work."""
        pp, name = section.pipeline_parallel_degree, section.pipeline_parallel_schedule
        if name not in SCHEDULES:
            raise ConfigError(f"{_KEY}_schedule={name!r} must be one of {', '.join(SCHEDULES)}")
        per_rank = 2 if is_multi_stage(name) else 1
        if section.pipeline_parallel_split_points:
            sizes = _sizes_from_split_points(section.pipeline_parallel_split_points, n_layers)
            source = f"{_KEY}_split_points ({len(sizes)} stages)"
        elif (lps := section.pipeline_parallel_layers_per_stage) > 0:
            if n_layers % lps:
                raise ConfigError(f"{_KEY}_layers_per_stage={lps} does not divide model.n_layers ({n_layers})")
            sizes, source = [lps] * (n_layers // lps), f"{_KEY}_layers_per_stage={lps} ({n_layers // lps} stages)"
        else:
            if n_layers < pp * per_rank:
                raise ConfigError(
                    f"model.n_layers ({n_layers}) cannot be split into {pp * per_rank} pipeline stages "
                    f"({_KEY}_degree={pp} x {per_rank} per rank for {name})"
                )
            sizes, source = split_evenly(n_layers, pp * per_rank), ""
        plan = cls(pp, name, local_batch_size // section.pipeline_parallel_microbatch_size, tuple(sizes))
        plan.check(source)
        return plan

    @property
    def num_stages(self) -> int:
        return len(self.stage_sizes)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.degree

    def check(self, source: str = "") -> None:
        """The stage count suits the schedule and the degree, and the microbatches suit the schedule."""
        pp, s, name, m = self.degree, self.num_stages, self.schedule, self.n_microbatches
        what = source or f"{s} stages"
        if any(n < 1 for n in self.stage_sizes):
            raise ConfigError(f"{what}: every pipeline stage needs at least one block")
        if not is_multi_stage(name) and s != pp:
            raise ConfigError(
                f"{_KEY}_schedule={name} runs one stage per rank, so it needs {pp} stages ({_KEY}_degree), "
                f"but {what}; use Interleaved1F1B or InterleavedZeroBubble for several stages per rank"
            )
        if is_multi_stage(name) and (s % pp or s < 2 * pp):
            raise ConfigError(
                f"{_KEY}_schedule={name} needs virtual stages: a multiple of {_KEY}_degree ({pp}) and at least 2 per "
                f"rank ({2 * pp}), but {what}"
            )
        if name in V_SCHEDULES and s != 2 * pp:
            raise ConfigError(f"{_KEY}_schedule={name} needs exactly 2 stages per rank ({2 * pp}), but {what}")
        mb = "microbatches (training.local_batch_size / parallelism.pipeline_parallel_microbatch_size)"
        if name in ("1F1B", "DualPipeV") and m < s:
            raise ConfigError(f"{_KEY}_schedule={name} needs at least as many {mb} as stages ({s}), got {m}")
        if name in ("Interleaved1F1B", "InterleavedZeroBubble") and m % max(1, m // pp):
            raise ConfigError(
                f"{_KEY}_schedule={name} needs a number of {mb} divisible by its rounds (max(1, {m} // {pp})), got {m}"
            )

    def stage_ids(self, pp_rank: int) -> list[int]:
        """The stages pp rank ``pp_rank`` runs, in order (a loop, or a V for ZBV / DualPipeV)."""
        return pipeline_rank_stages(self.schedule, self.degree, self.num_stages, pp_rank)

    def stage_layers(self, stage: int) -> range:
        start = sum(self.stage_sizes[:stage])
        return range(start, start + self.stage_sizes[stage])

    def stage_modules(
        self, stage: int, first: Sequence[str] = ("tok_embeddings",), last: Sequence[str] = ("norm", "output")
    ) -> list[str]:
        """Full-model names of the modules stage ``stage`` keeps (``layers.<i>`` for its blocks)."""
        names = list(first) if stage == 0 else []
        names += [f"layers.{i}" for i in self.stage_layers(stage)]
        return names + (list(last) if stage == self.num_stages - 1 else [])

    def bubble_fraction(self) -> float:
        """Idle fraction of each rank's step for the schedule (the planner's model,
        :func:`titanlite.parallel.pipeline_schedules.pipeline_bubble_fraction`: an estimate, not a measurement)."""
        return pipeline_bubble_fraction(self.schedule, self.degree, self.n_microbatches, self.stages_per_rank)


def pipeline_decoder(
    model: nn.Module,
    plan: PipelinePlan,
    stage_ids: Sequence[int],
    first: Sequence[str] = ("tok_embeddings",),
    last: Sequence[str] = ("norm", "output"),
) -> list[nn.Module]:
    """A decoder family's ``pipeline_fn``: one pruned copy of the meta ``model`` per stage in ``stage_ids``,
    keeping ``first`` (on stage 0), its blocks (``model.layers``, an ``nn.ModuleDict``) and ``last`` (on the
    last stage). Dropped top-level modules become None: the family's forward skips them (the embedding is
    skipped on later stages, which receive hidden states; norm and output on all but the last)."""
    where = {n: s for s in range(plan.num_stages) for n in plan.stage_modules(s, first, last)}
    check_ties(model, where)
    for name, child in model.named_children():  # it would be copied into every stage: trained as several copies
        placed = name in first or name in last or isinstance(child, nn.ModuleDict)
        if not placed and any(True for _ in child.parameters()):
            raise ValueError(
                f"{type(model).__name__}.{name} has parameters but no pipeline stage (pipeline_decoder places "
                f"{', '.join([*first, *last])} and the blocks): give the family a pipeline_fn that places it"
            )
    stages = []
    for s in stage_ids:
        keep = set(plan.stage_modules(s, first, last))
        stage = copy.deepcopy(model, _dropped(model, keep, first, last))
        for name, child in list(stage.named_children()):
            if isinstance(child, nn.ModuleDict):
                for key in [k for k in child if f"{name}.{k}" not in keep]:
                    del child[key]
            elif name not in keep and (name in first or name in last):
                setattr(stage, name, None)
        stages.append(stage)
    return stages


def _dropped(model: nn.Module, keep: set[str], first: Sequence[str], last: Sequence[str]) -> dict[int, None]:
    """A ``copy.deepcopy`` memo that copies the modules a stage drops as None (they are removed from the copy
    right after): copying every block for every stage made a 126-block model's stages cost ~3 s each."""
    memo: dict[int, None] = {}
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleDict):
            memo |= {id(m): None for k, m in child.items() if f"{name}.{k}" not in keep}
        elif name not in keep and (name in first or name in last):
            memo[id(child)] = None
    return memo


def check_ties(model: nn.Module, stage_of: dict[str, int]) -> None:
    """Refuse parameters shared by modules that land in different stages (one line)."""
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    for names in owners.values():
        stages = {stage_of.get(_top_module(n)) for n in names}
        if len(stages) > 1:
            raise ConfigError(
                f"{' and '.join(names)} are one tied parameter but fall in different pipeline stages "
                f"({', '.join(str(s) for s in sorted(stages, key=str))}); pipeline stages do not synchronize shared "
                "weights (torchtitan refuses this too): set model.tie_word_embeddings = false or "
                f"{_KEY}_degree = 1"
            )


def _top_module(param_name: str) -> str:
    parts = param_name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


class ModelParts(nn.Module):
    """This rank's pipeline stages as one module under the full model's names (``tok_embeddings``,
    ``layers.<i>``, ``norm``, ``output``). Parameters live in the stage modules (``stages``, which the schedule
    runs); this module only *references* them, so its ``state_dict`` keys, ``named_parameters`` and
    ``parameters`` are the full model's for the blocks this rank holds. It is never called itself."""

    def __init__(self, stage_ids: Sequence[int], stages: Sequence[nn.Module]):
        super().__init__()
        for stage in stages:
            for name, child in stage.named_children():
                if isinstance(child, nn.ModuleDict):
                    merged = self._modules.get(name) or nn.ModuleDict()
                    merged.update(child)
                    self.add_module(name, merged)
                else:
                    self.add_module(name, child)
        self.stage_ids, self.stages = list(stage_ids), list(stages)  # a plain list: not submodules
        self.args = stages[0].args

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipelined model runs through its schedule (titanlite.trainer.pipeline_runner.Pipeline)")

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> ModelParts:
        for stage in self.stages:  # the stages own the buffers (the rotary table) too
            stage.to_empty(device=device, recurse=recurse)
        return self

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Each stage from its own seed, derived from the run's seed and the stage index: every rank starts from
        the same RNG state, so stages drawn from it would repeat one another's blocks. The RNG state is
        restored afterwards (so later random draws do not depend on the layout either)."""
        for stage_id, stage in zip(self.stage_ids, self.stages):
            device = next(stage.parameters()).device
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                seed_stage(torch.initial_seed() + 1_000_003 * (stage_id + 1), stage)
                stage.init_weights(buffer_device)

    def train(self, mode: bool = True) -> ModelParts:
        for stage in self.stages:
            stage.train(mode)
        return super().train(mode)


def seed_stage(seed: int, stage: nn.Module) -> None:
    """Seed torch, and DTensor's RNG on the stage's mesh where DTensor has one (CUDA): otherwise DTensor would
    create it on its first random op by broadcasting rank 0's state to every rank, all stages included."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(seed)
    mesh = next((p.device_mesh for p in stage.parameters() if isinstance(p, DTensor)), None)
    if mesh is not None:
        torch_compat.seed_dtensor_rng(seed, mesh)
