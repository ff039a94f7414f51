"""Pipeline parallelism on ``torch.distributed.pipelining``: the split, the stages and the schedule.

PyTorch provides the stages (point-to-point sends of activations and gradients) and the schedules
(GPipe, 1F1B, interleaved and zero-bubble variants); titanlite adds what they leave to the caller:

1. **The split** (:class:`PipelinePlan`, a pure function of the config and the layer count): the
   blocks are cut into stages, evenly by default, by ``pipeline_parallel_layers_per_stage``, or at
   ``pipeline_parallel_split_points`` (``"layers.4"`` starts a new stage). The first stage keeps the
   embedding, the last the final norm and output. Stages go to ranks in a loop (stage ``s`` on pp
   rank ``s % pp``) or, for the V schedules (ZBV, DualPipeV), in a V (rank ``r`` holds ``r`` and
   ``2pp - 1 - r``). Each problem is a one-line ``ValueError`` naming the key, raised before any
   communication.
2. **The stage modules** (:func:`pipeline_decoder`, a family's ``pipeline_fn``): pruned copies of
   the meta model, each keeping only its modules under their full-model names. The family's
   parallelize function then applies float8, TP, AC, compile and FSDP to each stage.
3. **One module per rank** (:class:`ModelParts`): the rank's stages merged under the full model's
   names (``tok_embeddings``, ``layers.<i>``, ``norm``, ``output``), so the optimizer, gradient
   clipping, metrics and DCP checkpoints see one module whose state dict is a slice of the
   single-process one: checkpoints reshard freely between pipelined and plain layouts.
4. **The step** (:class:`Pipeline`): the schedule runs the microbatches; the loss exists on the
   last stage only, as the token *sum* divided by the step's global token count (``scale_grads``
   off: the schedule must not divide by the microbatch count again), so gradient accumulation,
   data and pipeline parallelism all give the single-process update. The raw sums are kept so that
   the trainer can share the true loss with every stage. With a chunked loss
   (:class:`~titanlite.output_loss.ChunkedLoss`) the last stage returns hidden states and the loss
   applies the stage's output layer to them.

Torch infers the shapes a stage exchanges by running its forward once on one microbatch (with placeholder
inputs on later stages) at the first step and at each switch between training and evaluation. Modules
that keep running statistics of their training forwards (MoE layers' expert loads) would count it:
:class:`_Stage` turns ``track_stats`` off on them for that forward.

Tied parameters whose copies would fall in different stages (a tied embedding and output) are
refused: the stages would train two separate copies, and torch's stages do not synchronize them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    _Action,
    _add_send_recv,
    _ComputationType,
)

from titanlite import _torch_compat
from titanlite.dtypes import autocast
from titanlite.errors import ConfigError
from titanlite.output_loss import as_output_loss
from titanlite.parallel.fsdp import is_fsdp
from titanlite.parallel.pipeline_schedules import (
    MULTI_STAGE_SCHEDULES,
    V_SCHEDULES,
    pipeline_bubble_fraction,
    pipeline_rank_stages,
    split_evenly,
)
from titanlite.parallel.tensor_parallel import to_local_value

SCHEDULES: dict[str, type] = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
}
_FORWARD = _ComputationType.FORWARD
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
    """How the model and the batch are cut (see the module docstring); build it with :meth:`from_config`."""

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
        stage = copy.deepcopy(model)
        for name, child in list(stage.named_children()):
            if isinstance(child, nn.ModuleDict):
                for key in [k for k in child if f"{name}.{k}" not in keep]:
                    del child[key]
            elif name not in keep and (name in first or name in last):
                setattr(stage, name, None)
        stages.append(stage)
    return stages


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
    """This rank's pipeline stages as one module under the full model's names (module docstring, step 3).

    Parameters live in the stage modules (``stages``, which the schedule runs); this module only
    *references* them, so its ``state_dict`` keys, ``named_parameters`` and ``parameters`` are the
    full model's for the blocks this rank holds. It is never called itself."""

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
        self.args = getattr(stages[0], "args", None)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipelined model runs through its schedule (titanlite.parallel.pipeline.Pipeline)")

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
        _torch_compat.seed_dtensor_rng(seed, mesh)


class Pipeline:
    """This rank's stages and their schedule: :meth:`step` (forward + backward of one local batch) and
    :meth:`evaluate` (forward only). Both return the token-sum loss of the microbatches whose last stage
    runs here, or 0 on a rank without the last stage; the caller sums it over the pipeline group.

    Evaluation runs the same schedule in its forward-only mode (torch re-infers the stages' shapes, with one
    microbatch's forward and backward, at each switch), except for the V schedules, whose evaluation mode
    fails in torch 2.13: they get a second schedule with a forward-only order (see ``_schedule``)."""

    def __init__(
        self,
        parts: ModelParts,
        plan: PipelinePlan,
        group: Any,
        device: torch.device,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | Any,
        autocast_dtype: torch.dtype | None = None,
    ):
        """``loss_fn``: a token-sum ``loss_fn(logits, labels)``, or a :class:`~titanlite.output_loss.ChunkedLoss`."""
        self.parts, self.plan, self.group, self.device = parts, plan, group, device
        self.autocast_dtype = autocast_dtype if autocast_dtype not in (None, torch.float32) else None
        self.has_first, self.has_last = 0 in parts.stage_ids, plan.num_stages - 1 in parts.stage_ids
        self.last_stage = parts.stages[parts.stage_ids.index(plan.num_stages - 1)] if self.has_last else None
        self.output_loss = as_output_loss(loss_fn)
        if self.last_stage is not None:  # it returns what the output loss takes: logits, or hidden states
            self.output_loss.check(self.last_stage)
            self.last_stage.forward = functools.partial(_forward_for, self.last_stage.forward, self)
        self.loss_fn = self.bind(self.output_loss)  # (last stage's output, labels) -> token-sum loss
        self.schedule = self._schedule()
        self._eval_schedule = None
        self._fn, self._divisor, self._sums = self.loss_fn, 1, []

    def bind(self, output_loss: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """``(last stage's output, labels) -> loss`` of ``output_loss`` (a chunked one applies the stage's output
        layer, under the stage's autocast)."""
        dtype = None if self.last_stage is None or is_fsdp(self.last_stage) else self.autocast_dtype

        def loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            with autocast(self.device.type, dtype):
                return output_loss(self.last_stage, outputs, labels)

        return loss

    def _schedule(self, forward_only: bool = False) -> Any:
        plan = self.plan
        stages = [_Stage(m, i, plan.num_stages, self.device, group=self.group) for i, m in self._stages()]
        arg = stages if is_multi_stage(plan.schedule) else stages[0]
        kw = dict(n_microbatches=plan.n_microbatches, loss_fn=self._loss, scale_grads=False)
        schedule = SCHEDULES[plan.schedule](arg, **kw)
        if forward_only and plan.schedule in V_SCHEDULES:
            # torch 2.13's V schedules still run their backward actions in eval mode (and fail): give them a
            # forward-only order, each rank's stages in turn over every microbatch, with the sends and receives
            # added by torch's own lowering (its validation, which insists on backward actions, is skipped)
            n, to_rank = plan.n_microbatches, schedule.stage_index_to_group_rank
            order = {
                r: [_Action(s, _FORWARD, mb) for s in plan.stage_ids(r) for mb in range(n)] for r in range(plan.degree)
            }
            schedule.pipeline_order_with_comms = _add_send_recv(order, lambda s: to_rank[s], plan.num_stages)
        return schedule

    def _stages(self) -> list[tuple[int, nn.Module]]:
        """(stage index, the module its PipelineStage runs): the stage itself, or, for autocast (stages without
        FSDP, whose mixed precision policy casts instead), a wrapper running only its forward under autocast."""
        if self.autocast_dtype is None:
            return list(zip(self.parts.stage_ids, self.parts.stages))
        return [
            (i, m if is_fsdp(m) else _Autocast(m, self.autocast_dtype))
            for i, m in zip(self.parts.stage_ids, self.parts.stages)
        ]

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        total = self._fn(logits, labels)
        self._sums.append(to_local_value(total.detach()))
        return total / self._divisor

    def _run(self, run: Callable, inputs, labels, extra: dict, fn: Callable, divisor: int) -> torch.Tensor:
        self._fn, self._divisor, self._sums = fn, divisor, []
        args = (inputs,) if self.has_first else ()
        run(*args, target=labels if self.has_last else None, return_outputs=False, **extra)
        # the last n: a schedule's first run also calls the loss once to infer the backward's shapes
        sums = self._sums[-self.plan.n_microbatches :] if self.has_last else []
        self._sums = []
        return torch.stack(sums).sum(0) if sums else torch.zeros((), device=self.device)  # a loss may be a vector

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, extra: dict, tokens: int) -> torch.Tensor:
        """Forward and backward of ``inputs`` (this rank's local batch), each microbatch's loss divided by
        ``tokens`` (the optimizer step's global token count); returns the undivided sum (see the class)."""
        return self._run(self.schedule.step, inputs, labels, extra, self.loss_fn, tokens)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor, extra: dict, loss_fn: Callable) -> torch.Tensor:
        """Forward only, through the evaluation schedule; the summed ``loss_fn(logits, labels)`` as for :meth:`step`
        (chunked like the training loss)."""
        fn = self.bind(self.output_loss.with_fn(loss_fn))
        if self.plan.schedule not in V_SCHEDULES:  # torch re-infers the shapes at each switch to evaluation and back
            return self._run(self.schedule.eval, inputs, labels, extra, fn, 1)
        if self._eval_schedule is None:
            self._eval_schedule = self._schedule(forward_only=True)
        return self._run(self._eval_schedule.eval, inputs, labels, extra, fn, 1)


def _forward_for(forward: Callable, pipeline: Pipeline, *args: Any, **kwargs: Any) -> Any:
    """The last stage's forward with the arguments its pipeline's output loss asks for (``return_hidden``)."""
    return forward(*args, **kwargs, **pipeline.output_loss.model_kwargs)


class _Stage(PipelineStage):
    """A ``PipelineStage`` whose shape inference leaves the modules' running statistics alone (module docstring)."""

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        tracking = [m for m in self.submod.modules() if getattr(m, "track_stats", False)]
        for m in tracking:
            m.track_stats = False
        try:
            return super()._prepare_forward_infra(*args, **kwargs)
        finally:
            for m in tracking:
                m.track_stats = True


class _Autocast(nn.Module):
    """A stage whose forward runs under ``torch.autocast`` (the schedule also runs the backward, which must not)."""

    def __init__(self, stage: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.stage, self.dtype, self.device_type = stage, dtype, next(stage.parameters()).device.type

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.stage(*args, **kwargs)
