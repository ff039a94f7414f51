"""LR schedule values against hand-computed points."""

import math

import pytest
import torch

from titanlite.optim import build_lr_scheduler, lr_factor


def f(step, **kw):
    base = dict(total_steps=100, warmup_steps=10, decay_ratio=-1.0, decay_type="linear", min_lr_factor=0.0)
    base.update(kw)
    return lr_factor(step, **base)


def test_warmup_is_linear_and_reaches_peak():
    assert f(1) == pytest.approx(1 / 11)
    assert f(10) == pytest.approx(10 / 11)
    assert f(11) == pytest.approx(1 - 1 / 90)  # first decay step of a linear decay over 90 steps


def test_linear_decay_to_min_at_last_step():
    assert f(100, min_lr_factor=0.1) == pytest.approx(0.1)
    assert f(55) == pytest.approx(1 - 45 / 90)


def test_cosine_and_sqrt_shapes():
    # halfway through a 90-step decay
    assert f(55, decay_type="cosine") == pytest.approx(0.5)
    assert f(55, decay_type="sqrt") == pytest.approx(1 - math.sqrt(0.5))
    assert f(55, decay_type="cosine", min_lr_factor=0.2) == pytest.approx(0.2 + 0.8 * 0.5)


def test_warmup_stable_decay():
    # decay over the last 20% (20 steps): constant 1.0 from step 11 through 80
    kw = dict(decay_ratio=0.2)
    assert f(11, **kw) == 1.0 and f(80, **kw) == 1.0
    assert f(81, **kw) == pytest.approx(1 - 1 / 20)
    assert f(90, **kw) == pytest.approx(0.5)
    assert f(100, **kw) == pytest.approx(0.0)


def test_no_warmup():
    assert f(1, warmup_steps=0) == pytest.approx(1 - 1 / 100)


def test_scheduler_applies_factor_per_optimizer_step():
    class Cfg:
        warmup_steps, decay_ratio, decay_type, min_lr_factor = 2, -1.0, "linear", 0.0

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = build_lr_scheduler(opt, Cfg, total_steps=6)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [lr_factor(s, total_steps=6, warmup_steps=2) for s in range(1, 7)]
    assert seen == pytest.approx(expected)
    assert seen[-1] == 0.0
