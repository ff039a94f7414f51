"""The seq-len schedule's hook changes the loader, the train step and the metrics only through their own methods."""

from __future__ import annotations

import pytest
import torch

from titanlite.plan.run_plan import RunPlan, Stage
from titanlite.trainer.stages import StageHook
from titanlite.trainer.step import TrainStep

PLAN = RunPlan(
    total_steps=6,
    stages=(Stage(1, 3, 32, 8, 1, 256), Stage(4, 6, 64, 4, 2, 512)),
    log_lines=(),
)


class Sealed:
    """An object whose fields nobody else writes: ``__slots__`` leaves no room for a field set from outside."""

    __slots__ = ("calls",)

    def __init__(self):
        self.calls = []


class Loader(Sealed):
    __slots__ = ()
    stage = property(lambda self: self.calls[-1][1] if self.calls else -1)

    def set_stage(self, i: int) -> None:
        self.calls.append(("set_stage", i))


class Metrics(Sealed):
    __slots__ = ()

    def set_flops_per_token(self, flops: int) -> None:
        self.calls.append(("set_flops_per_token", flops))


def test_the_stage_hook_goes_through_each_objects_api():
    model = torch.nn.Linear(4, 4)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader, metrics = Loader(), Metrics()
    hook = StageHook(PLAN, loader, step, metrics, stage_flops=(100, 200))
    seen = []
    for n in range(1, PLAN.total_steps + 1):
        hook.enter(n)
        seen.append(step.grad_accum_steps)
    assert seen == [1, 1, 1, 2, 2, 2]  # each step's stage (Stage.grad_accum_steps)
    assert loader.calls == [("set_stage", 0), ("set_stage", 1)]  # once per switch
    assert metrics.calls == [("set_flops_per_token", f) for f in (100,) * 3 + (200,) * 3]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_train_step_refuses_a_bad_accumulation(bad):
    model = torch.nn.Linear(4, 4)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), grad_accum_steps=3)
    with pytest.raises(ValueError, match="grad_accum_steps must be an integer >= 1"):
        step.set_grad_accum_steps(bad)
    assert step.grad_accum_steps == 3
