"""The pipeline bubble of ``bench train``, measured: when this rank's stages compute, and per stage the measured
bubble next to the planner's prediction (``PipelinePlan.bubble_fraction()``); the two fractions
(``bubble_measured``, ``bubble_measured_in_schedule``) are defined in docs/benchmarks.md, "Pipeline parallelism".
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
import torch.distributed as dist

from titanlite.bench.common import busy_seconds, sync
from titanlite.parallel.pipeline import PipelinePlan


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return [t for v in values for t in _tensors(v)]


class StageActivity:
    """When this rank's pipeline stages compute: ``(stage, kind, begin, end)`` intervals of ``time.perf_counter``;
    the rest of the step is the rank's bubble. Hooks rather than ``torch.profiler``, which would slow the CPU steps
    it measures more; the hooks' own graph walks are recorded as busy (``hooks``), so they do not inflate it.

    ``forward``: hooks on each stage module; ``loss``: the schedule's loss function, wrapped (:meth:`wrap_loss`);
    ``backward``: a pre-hook on every autograd node of the stage's graph, the first to run opening the interval
    and the engine's end-of-pass callback closing it (node hooks, because the zero-bubble schedules'
    weight-gradient passes start inside the graph, where no output hook sees them). On CUDA every boundary
    synchronizes the device, so intervals are the kernels' time.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.intervals: list[tuple[int, str, float, float]] = []
        self._forward_begin: dict[int, float] = {}
        self._backward: tuple[int, float] | None = None  # (stage, begin) of the backward pass in progress

    def attach(self, stage: int, module: torch.nn.Module) -> None:
        """Record ``module``'s forward and backward passes as stage ``stage``."""
        module.register_forward_pre_hook(functools.partial(self._forward_pre, stage))
        module.register_forward_hook(functools.partial(self._forward_post, stage))

    def wrap_loss(self, loss_fn, stage: int):
        """``loss_fn`` recorded as stage ``stage``'s work (its forward, and the start of the backward)."""

        def timed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            begin = self._now()
            loss = loss_fn(logits, labels)
            self._add(stage, "loss", begin)
            if loss.grad_fn is not None:  # the loss's backward is the first of the stage's pass
                loss.grad_fn.register_prehook(functools.partial(self._backward_node, stage))
            return loss

        return timed_loss

    def busy(self, start: float, end: float, stage: int | None = None, kinds: tuple[str, ...] = ()) -> float:
        """Seconds within ``[start, end]`` in which the stage (any stage without ``stage``) computed."""
        spans = [(a, b) for s, k, a, b in self.intervals if stage in (None, s) and (not kinds or k in kinds)]
        return busy_seconds(spans, start, end)

    def _now(self) -> float:
        sync(self.device)
        return time.perf_counter()

    def _add(self, stage: int, kind: str, begin: float) -> None:
        self.intervals.append((stage, kind, begin, self._now()))

    def _forward_pre(self, stage: int, module, args) -> None:
        self._forward_begin[stage] = self._now()

    def _forward_post(self, stage: int, module, args, output) -> None:
        self._add(stage, "forward", self._forward_begin.pop(stage))
        self._watch_graph(stage, output)

    def _watch_graph(self, stage: int, output) -> None:
        """A pre-hook on every autograd node behind ``output`` (none without autograd, e.g. in evaluation)."""
        begin, hook = self._now(), functools.partial(self._backward_node, stage)
        todo = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
        seen = set(todo)
        while todo:
            node = todo.pop()
            node.register_prehook(hook)
            for child, _ in node.next_functions:
                if child is not None and child not in seen:
                    seen.add(child)
                    todo.append(child)
        self._add(stage, "hooks", begin)

    def _backward_node(self, stage: int, grad_outputs) -> None:
        """A node of the stage's graph is about to run: the first of a backward pass opens its interval."""
        if self._backward is None:
            self._backward = (stage, self._now())
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        stage, begin = self._backward
        self._backward = None
        self._add(stage, "backward", begin)


def stage_record(trainer, elapsed: float, steps: int, peak_memory_gib) -> dict:
    """This rank's compute over the timed steps, per step (seconds): what :func:`pipeline_report` gathers."""
    timer, activity = trainer.train_step.timer, trainer.stage_activity
    start, end = timer.start, timer.start + elapsed
    schedule = timer.totals["forward_backward"] if timer.split else None
    stages = {
        s: {
            "forward_s_per_step": activity.busy(start, end, s, ("forward", "loss")) / steps,
            "backward_s_per_step": activity.busy(start, end, s, ("backward",)) / steps,
            "hooks_s_per_step": activity.busy(start, end, s, ("hooks",)) / steps,
        }
        for s in trainer.model.stage_ids
    }
    return {
        "pp_rank": trainer.parallel_dims.pp_rank,
        "busy_s": activity.busy(start, end),
        "wall_s": elapsed,
        "schedule_s": schedule,
        "peak_memory_gib": peak_memory_gib,
        "stages": stages,
    }


def gather(obj) -> list:
    """``obj`` from every rank (a list of one without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _mean(values: list) -> float | None:
    return None if any(v is None for v in values) else statistics.fmean(values)


def pipeline_report(trainer, elapsed: float, steps: int, peak_memory_gib) -> dict:
    """The plan, and per stage the measured bubble next to the predicted one (see the module docstring).
    Ranks that hold the same stages (data / tensor parallel replicas) are averaged."""
    plan: PipelinePlan = trainer.pipeline_plan
    records = gather(stage_record(trainer, elapsed, steps, peak_memory_gib))
    predicted = plan.bubble_fraction()
    stages, per_rank = [], []
    for r in range(plan.degree):
        mine = [rec for rec in records if rec["pp_rank"] == r]
        busy, wall = _mean([m["busy_s"] for m in mine]), _mean([m["wall_s"] for m in mine])
        schedule = _mean([m["schedule_s"] for m in mine])
        rank = {
            "pp_rank": r,
            "bubble_measured": max(0.0, 1 - busy / wall),
            "bubble_measured_in_schedule": None if not schedule else max(0.0, 1 - busy / schedule),
            "wall_s_per_step": wall / steps,  # the window the bubble is a fraction of
            "peak_memory_gib": _mean([m["peak_memory_gib"] for m in mine]),
        }
        per_rank.append(rank)
        for s in plan.stage_ids(r):
            times = {k: _mean([m["stages"][s][k] for m in mine]) for k in mine[0]["stages"][s]}
            stages.append({"stage": s, "layers": plan.stage_sizes[s], **rank, **times, "bubble_predicted": predicted})
    stages.sort(key=lambda st: st["stage"])
    in_schedule = [r["bubble_measured_in_schedule"] for r in per_rank]
    return {
        "schedule": plan.schedule,
        "degree": plan.degree,
        "num_stages": plan.num_stages,
        "stages_per_rank": plan.stages_per_rank,
        "n_microbatches": plan.n_microbatches,
        "stage_sizes": list(plan.stage_sizes),
        "bubble_predicted": predicted,
        "bubble_measured_mean": statistics.fmean(r["bubble_measured"] for r in per_rank),
        "bubble_measured_in_schedule_mean": _mean(in_schedule),
        "stages": stages,
    }
