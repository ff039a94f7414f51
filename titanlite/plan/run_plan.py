"""How long a run trains and at which sequence length: the token budget and the seq_len stages (for a user:
docs/recipes.md, "Token budgets" and "Sequence-length stages").

Pure functions of the ``[training]`` values (no torch), unit-tested against hand arithmetic. The arithmetic is on
integers, so a budget of any size is either met exactly or said not to be. Resuming under a budget
(``resumed = (step, tokens seen)``, the checkpoint's): when the checkpoint saw the tokens this plan gives its
steps, nothing changes; when it did not (the batch changed since), the run trains
``ceil(remaining tokens / tokens per step)`` more steps, so it still stops at the budget.

A stage's ``global_batch_size`` (sequences per step) sets its own batch: the accumulation becomes
``global_batch_size / (local sequences x dp)``; otherwise it keeps the base config's accumulation, and its
micro-batch the same ``local_batch_size x seq_len`` tokens (which the stage's seq_len must divide).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from fractions import Fraction

from titanlite.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Stage:
    """Steps ``first_step .. last_step`` (1-based, inclusive) at ``seq_len``."""

    first_step: int
    last_step: int
    seq_len: int
    local_batch_size: int
    grad_accum_steps: int
    tokens_per_step: int

    @property
    def steps(self) -> int:
        return self.last_step - self.first_step + 1


@dataclasses.dataclass(frozen=True)
class RunPlan:
    total_steps: int
    stages: tuple[Stage, ...]
    log_lines: tuple[str, ...]
    resumed: tuple[int, int] | None = None  # (step, tokens seen) the plan continues from, when they were taken

    @property
    def total_tokens(self) -> int:
        return self.tokens_through(self.total_steps)

    def tokens_through(self, step: int) -> int:
        """Tokens trained by the end of optimizer step ``step`` under this plan."""
        first, done = (0, 0) if self.resumed is None or step < self.resumed[0] else self.resumed
        return done + sum(
            max(min(s.last_step, step) - max(s.first_step, first + 1) + 1, 0) * s.tokens_per_step for s in self.stages
        )

    def stage_index(self, step: int) -> int:
        """The stage that trains optimizer step ``step`` (1-based; past the end: the last stage)."""
        return next((i for i, s in enumerate(self.stages) if step <= s.last_step), len(self.stages) - 1)

    @property
    def max_seq_len(self) -> int:
        return max(s.seq_len for s in self.stages)


def _fail(msg: str) -> None:
    raise ConfigError(msg)


def stage_batch(i: int, spec: dict, seq_len: int, local_batch_size: int, dp: int, accum: int) -> tuple[int, int, int]:
    """``(seq_len, local sequences, accumulation)`` of schedule entry ``i`` (see the module docstring)."""
    key = f"training.seq_len_schedule[{i}]"
    n = int(spec["seq_len"])
    if n < 1:
        _fail(f"{key}.seq_len = {n} must be >= 1")
    micro = local_batch_size * seq_len
    if micro % n:
        _fail(
            f"{key}.seq_len = {n} does not divide the micro-batch of training.local_batch_size x training.seq_len "
            f"= {local_batch_size} x {seq_len} = {micro} tokens (each stage keeps the micro-batch's tokens)"
        )
    local = micro // n
    if "global_batch_size" in spec:
        g = int(spec["global_batch_size"])
        if g < 1 or g % (local * dp):
            _fail(
                f"{key}.global_batch_size = {g} must be a multiple of the stage's {local} sequences per micro-batch"
                f" x data-parallel degree {dp} = {local * dp}"
            )
        accum = g // (local * dp)
    return n, local, accum


def plan_steps(
    *,
    steps: int,
    tokens: int,
    seq_len: int,
    local_batch_size: int,
    grad_accum_steps: int,
    dp_degree: int,
    schedule: Sequence[dict] = (),
    resumed: tuple[int, int] | None = None,
) -> RunPlan:
    """The run's stages and step count (see the module docstring); ValueError naming the key otherwise.
    ``resumed``: the ``(step, tokens seen)`` of the checkpoint the run resumes from, under a budget."""
    plan = _plan(steps, tokens, seq_len, local_batch_size, grad_accum_steps, dp_degree, schedule)
    if tokens <= 0 or resumed is None or plan.tokens_through(resumed[0]) == resumed[1]:
        return plan
    step, seen = resumed
    if schedule:
        _fail(
            f"training.tokens with training.seq_len_schedule: the checkpoint of step {step:,} has seen {seen:,} "
            f"tokens but this config's stages give {plan.tokens_through(step):,} by then (the batch changed): "
            "resume with the batch it was trained with"
        )
    (stage,) = plan.stages
    more = max(_ceil_div(tokens - seen, stage.tokens_per_step), 0)
    stages = (dataclasses.replace(stage, first_step=1, last_step=step + more),)
    line = (
        f"resumed at step {step:,} with {seen:,} tokens seen (not this config's {plan.tokens_through(step):,}: the "
        f"batch changed): {more:,} more steps x {stage.tokens_per_step:,} tokens"
    )
    total = seen + more * stage.tokens_per_step
    return RunPlan(step + more, stages, (line, _budget_line(tokens, step + more, total)), resumed=(step, seen))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _plan(steps, tokens, seq_len, local_batch_size, grad_accum_steps, dp_degree, schedule) -> RunPlan:
    dp, accum = dp_degree, grad_accum_steps
    specs = list(schedule) or [{"seq_len": seq_len}]
    batches = [stage_batch(i, s, seq_len, local_batch_size, dp, accum) for i, s in enumerate(specs)]
    per_step = [n * local * dp * a for n, local, a in batches]
    budget = tokens if tokens > 0 else None
    lengths: list[int | None] = []
    for i, spec in enumerate(specs):
        key = f"training.seq_len_schedule[{i}]"
        if "fraction" in spec and "steps" in spec:
            _fail(f"{key} sets both fraction and steps: give one")
        if "steps" in spec:
            if int(spec["steps"]) < 1:
                _fail(f"{key}.steps = {spec['steps']} must be >= 1")
            lengths.append(int(spec["steps"]))
        elif "fraction" in spec:
            f = float(spec["fraction"])
            if not 0.0 < f <= 1.0:
                _fail(f"{key}.fraction = {f} must be in (0, 1]")
            if budget is not None:
                lengths.append(math.ceil(Fraction(f) * budget / per_step[i]))
            else:
                lengths.append(round(f * steps))
        elif i == len(specs) - 1:
            lengths.append(None)  # the rest
        else:
            _fail(f"{key} sets neither fraction nor steps: only the last stage may take the rest")
    fractions = sum(float(s.get("fraction", 0.0)) for s in specs)
    if fractions > 1.0 + 1e-9 or all("fraction" in s for s in schedule) and schedule and abs(fractions - 1) > 1e-6:
        _fail(f"training.seq_len_schedule's fractions add up to {fractions:g}: they must cover the run exactly once")
    if lengths[-1] is None or ("fraction" in specs[-1] and schedule):  # the last stage absorbs rounding
        done = sum(x for x in lengths[:-1])
        if budget is not None:
            used = sum(x * t for x, t in zip(lengths[:-1], per_step[:-1]))
            lengths[-1] = max(_ceil_div(budget - used, per_step[-1]), 0)
        else:
            lengths[-1] = steps - done
    total = sum(lengths)
    if budget is None and schedule and total != steps:
        _fail(f"training.seq_len_schedule's stages add up to {total} steps but training.steps = {steps}")
    for i, n in enumerate(lengths):
        if n < 1:
            where = f"training.seq_len_schedule[{i}]" if schedule else "training.tokens"
            _fail(f"{where} gets {n} steps: every stage needs at least one step")
    stages, first = [], 1
    for (n, local, a), count, tps in zip(batches, lengths, per_step):
        stages.append(Stage(first, first + count - 1, n, local, a, tps))
        first += count
    return RunPlan(total, tuple(stages), tuple(_log_lines(stages, budget, dp)))


def _log_lines(stages: list[Stage], budget: int | None, dp: int) -> list[str]:
    lines = []
    for i, s in enumerate(stages):
        what = f"stage {i + 1} (steps {s.first_step}-{s.last_step}): " if len(stages) > 1 else ""
        lines.append(
            f"{what}{s.steps:,} steps x {s.tokens_per_step:,} tokens (local batch {s.local_batch_size} x dp {dp} x "
            f"grad accumulation {s.grad_accum_steps} x seq_len {s.seq_len}) = {s.steps * s.tokens_per_step:,} tokens"
        )
    if budget is not None:
        lines.append(_budget_line(budget, stages[-1].last_step, sum(s.steps * s.tokens_per_step for s in stages)))
    return lines


def _budget_line(budget: int, steps: int, total: int) -> str:
    over = total - budget
    tail = "exactly the budget" if over == 0 else f"{over:,} tokens over it (the last step does not fit whole)"
    return f"token budget training.tokens = {budget:,}: {steps:,} steps train {total:,} tokens, {tail}"
