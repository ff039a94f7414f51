"""Loss-spike and NaN guard: detect a bad optimizer step and raise, skip it or roll back (``[guard]``; the
detection, policies and cost for a user: docs/monitoring.md, "Loss-spike and NaN guard").

Only accepted losses enter the rolling mean, so a spike does not raise the bar for the next one. Every rank must
take the same branch (one that disagreed would hang the next collective): the stock loop's values come out of the
training step's one all-reduce (:meth:`titanlite.trainer.step.TrainStep.reduce_step`, ``agreed=True``); values not
agreed that way (a foreign loop) have their flags all-reduced (MAX) first.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from titanlite.errors import ConfigError, UserError
from titanlite.trainer.hooks import Hook

logger = logging.getLogger("titanlite.trainer.guard")

POLICIES = ("raise", "skip_step", "rollback")


class TrainingDivergedError(UserError, RuntimeError):
    """A bad step under ``policy = raise``, or more bad steps than the policy tolerates: the run stopped as its
    config asked (exit status 1)."""

    exit_code = 1


class SpikeDetector:
    """Rolling-mean loss-spike test on the host (pure Python, no tensors)."""

    def __init__(self, factor: float, window: int = 50, min_history: int = 20):
        self.factor = factor
        self.history: collections.deque[float] = collections.deque(maxlen=window)
        self.min_history = min(min_history, window)

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def threshold(self) -> float | None:
        """Loss above which the next step is a spike; None while disabled or warming up."""
        if not self.enabled or len(self.history) < self.min_history:
            return None
        return self.factor * sum(self.history) / len(self.history)

    def accept(self, loss: float) -> None:
        """Add a loss that was not flagged to the rolling window."""
        if math.isfinite(loss):
            self.history.append(loss)

    def check(self, loss: float) -> bool:
        """Whether ``loss`` is a spike; a non-spike finite loss is accepted into the window."""
        thr = self.threshold()
        spike = thr is not None and loss > thr
        if not spike:
            self.accept(loss)
        return spike


@dataclasses.dataclass
class GuardEvent:
    step: int
    kind: str  # "nonfinite" | "spike"
    loss: float
    grad_norm: float
    threshold: float | None
    action: str = ""

    def describe(self) -> str:
        if self.kind == "nonfinite":
            what = "non-finite loss or gradient norm"
        else:
            what = f"loss spike (loss above {self.threshold:.4f} = spike_factor x rolling mean)"
        return f"step {self.step}: {what}: loss {self.loss:.6g}, grad norm {self.grad_norm:.6g}"

    def record(self, counters: dict[str, int]) -> dict[str, Any]:
        return {
            "step": self.step,
            "guard_event": self.kind,
            "guard_action": self.action,
            "event_loss": self.loss,
            "event_grad_norm": self.grad_norm,
            **counters,
        }


@dataclasses.dataclass
class StepCheck:
    """What :meth:`StepGuard.check` found: host values and the agreed decision."""

    loss: float
    grad_norm: float
    stop_requested: bool
    event: GuardEvent | None = None
    action: str = "update"  # update | skip | rollback


# ----------------------------------------------------------------------------- policies


class RaisePolicy:
    name = "raise"

    def handle(self, event: GuardEvent, guard: StepGuard) -> str:
        raise TrainingDivergedError(
            f"{event.describe()} ([guard] policy = raise). Lower the learning rate, or set [guard] policy = "
            "skip_step or rollback to continue automatically."
        )


class SkipStepPolicy:
    name = "skip_step"

    def __init__(self, max_consecutive: int):
        self.max_consecutive = max_consecutive
        self.consecutive = 0

    def handle(self, event: GuardEvent, guard: StepGuard) -> str:
        self.consecutive += 1
        if self.consecutive > self.max_consecutive:
            raise TrainingDivergedError(
                f"{event.describe()}; {self.consecutive} consecutive steps skipped (more than [guard] "
                f"max_consecutive_skips = {self.max_consecutive}): the run is diverging"
            )
        return "skip"

    def good_step(self) -> None:
        self.consecutive = 0


class RollbackPolicy:
    name = "rollback"

    def __init__(self, max_rollbacks: int):
        self.max_rollbacks = max_rollbacks

    def handle(self, event: GuardEvent, guard: StepGuard) -> str:
        if guard.counts["rollbacks"] >= self.max_rollbacks:
            raise TrainingDivergedError(
                f"{event.describe()}; already rolled back {guard.counts['rollbacks']} time(s) ([guard] "
                f"max_rollbacks = {self.max_rollbacks})"
            )
        return "rollback"


def make_policy(cfg) -> Any:
    if cfg.policy == "raise":
        return RaisePolicy()
    if cfg.policy == "skip_step":
        return SkipStepPolicy(cfg.max_consecutive_skips)
    if cfg.policy == "rollback":
        return RollbackPolicy(cfg.max_rollbacks)
    raise ConfigError(f"guard.policy={cfg.policy!r} must be one of {', '.join(POLICIES)}")


# ----------------------------------------------------------------------------- the guard


class StepGuard:
    """Per-step check (see the module docstring); ``cfg`` is the ``[guard]`` section."""

    def __init__(self, cfg, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.policy = make_policy(cfg)
        self.spikes = SpikeDetector(cfg.spike_factor, cfg.spike_window, cfg.spike_min_history)
        self.counts = {"nonfinite": 0, "spikes": 0, "skipped_steps": 0, "rollbacks": 0}
        self._injected = False
        self._lr_scale: tuple[int, int, float] = (0, 0, 1.0)  # (first step, last step, factor)

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def counters(self) -> dict[str, int]:
        return {f"guard_{k}": v for k, v in self.counts.items()}

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to take the uninterrupted run's decisions: the spike window, the
        counters (the ``max_rollbacks`` budget), consecutive skips, the LR window, the test injection."""
        consecutive = getattr(self.policy, "consecutive", 0)
        return {
            "history": list(self.spikes.history),
            "counts": dict(self.counts),
            "consecutive_skips": consecutive,
            "lr_scale": list(self._lr_scale),
            "injected": self._injected,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.spikes.history.clear()
        self.spikes.history.extend(float(x) for x in state["history"])
        self.counts.update({k: int(v) for k, v in state["counts"].items()})
        if isinstance(self.policy, SkipStepPolicy):
            self.policy.consecutive = int(state["consecutive_skips"])
        first, last, factor = state["lr_scale"]
        self._lr_scale, self._injected = (int(first), int(last), float(factor)), bool(state["injected"])

    # -- testing hook
    def maybe_inject_nan(self, result: Any) -> None:
        """``[guard] debug_inject_nan_at_step``: at that step (once per process) make the step's loss and
        gradient norm NaN, as a diverging forward pass would."""
        if result.step != self.cfg.debug_inject_nan_at_step or self._injected:
            return
        self._injected = True
        result.loss, result.grad_norm = result.loss * float("nan"), result.grad_norm * float("nan")
        logger.warning(f"guard: TESTING: NaN injected into step {result.step} ([guard] debug_inject_nan_at_step)")

    # -- the check
    def check(
        self,
        step: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        stop_requested: bool | torch.Tensor = False,
        agreed: bool = False,
    ) -> StepCheck:
        """The action for optimizer step ``step`` (``update``, ``skip`` or ``rollback``) from the global loss and
        gradient norm (device tensors), in one device->host transfer; :class:`TrainingDivergedError` under ``raise``.
        ``agreed``: the loss, the norm and ``stop_requested`` (then a device tensor, > 0 to stop) are the same on
        every rank, so no collective is needed; else the flags are all-reduced (MAX) when distributed."""
        loss = loss.detach().reshape(()).float()
        grad_norm = grad_norm.detach().reshape(()).float().to(loss.device)
        threshold = self.spikes.threshold()
        if agreed:
            stop = torch.as_tensor(stop_requested, dtype=torch.float32, device=loss.device).reshape(())
            loss_v, gn_v, stop = torch.stack([loss, grad_norm, stop]).tolist()
            bad = not (math.isfinite(loss_v) and math.isfinite(gn_v))
            spiked = threshold is not None and loss_v > threshold
        else:
            nonfinite = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
            zero = torch.zeros((), dtype=torch.bool, device=loss.device)
            spike = loss > threshold if threshold is not None else zero
            stop = torch.full((), float(stop_requested), device=loss.device)
            flags = torch.stack([nonfinite.float(), spike.float(), stop])
            if self.distributed:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            loss_v, gn_v, bad, spiked, stop = torch.cat([loss.reshape(1), grad_norm.reshape(1), flags]).tolist()
        out = StepCheck(loss_v, gn_v, stop > 0)
        if bad > 0:
            self.counts["nonfinite"] += 1
            out.event = GuardEvent(step, "nonfinite", loss_v, gn_v, threshold)
        elif spiked > 0:
            self.counts["spikes"] += 1
            out.event = GuardEvent(step, "spike", loss_v, gn_v, threshold)
        if out.event is None:
            self.spikes.accept(loss_v)
            if isinstance(self.policy, SkipStepPolicy):
                self.policy.good_step()
            return out
        logger.warning("guard: %s; policy %s", out.event.describe(), self.policy.name)
        out.action = self.policy.handle(out.event, self)  # raises under "raise"
        out.event.action = out.action
        if out.action == "skip":
            self.counts["skipped_steps"] += 1
            logger.warning(f"guard: step {step} skipped: no optimizer update ({self.counts['skipped_steps']} so far)")
        return out

    # -- learning-rate factor after a rollback
    def lr_scale(self, step: int) -> float:
        first, last, factor = self._lr_scale
        return factor if first <= step <= last else 1.0

    def rolled_back(self, to_step: int) -> None:
        """Count a rollback to ``to_step`` and start the learning-rate window after it."""
        self.counts["rollbacks"] += 1
        if self.cfg.rollback_lr_steps > 0 and self.cfg.rollback_lr_factor != 1.0:
            self._lr_scale = (to_step + 1, to_step + self.cfg.rollback_lr_steps, self.cfg.rollback_lr_factor)


# ----------------------------------------------------------------------------- rollback


def rollback(guard: StepGuard, event: GuardEvent, checkpointer, loader, accum: int) -> tuple[int, Iterator]:
    """``policy = rollback`` for ``event``: reload, and return the step resumed from and a fresh iterator over
    ``loader`` (positioned by the checkpoint); with ``rollback_skip_data`` the micro-batches of the steps after the
    checkpoint up to the offending one are read and dropped, so training does not see them again."""
    kept = guard.state_dict()  # the reload must not reset the guard's own counters (the rollback budget)
    step = checkpointer.load_latest() if checkpointer is not None else None
    guard.load_state_dict(kept)
    if step is None:
        raise TrainingDivergedError(
            f"{event.describe()}; [guard] policy = rollback but there is no complete checkpoint to roll back to "
            "(enable [checkpoint] with an interval shorter than the time to a failure)"
        )
    guard.rolled_back(step)
    data_iter = iter(loader)
    skipped = 0
    if guard.cfg.rollback_skip_data:
        for _ in range((event.step - step) * accum):
            next(data_iter)
            skipped += 1
    scale, cfg = guard.lr_scale(step + 1), guard.cfg
    lr = f"; learning rate x{scale:g} for {cfg.rollback_lr_steps} steps" if scale != 1.0 else ""
    logger.warning(
        f"guard: ROLLED BACK from step {event.step} to the checkpoint of step {step}; skipped {skipped} "
        f"micro-batch(es){lr} (rollback {guard.counts['rollbacks']} of at most {cfg.max_rollbacks})"
    )
    return step, data_iter


class GuardHook(Hook):
    """The guard in the loop: the verdict on each step before its update, in the step's single device-to-host
    transfer, which also agrees on a stop request across ranks (``result.stop_flag``, else the preemption
    handler's ``stop_requested()``); the rollback (``policy = rollback`` needs ``checkpointer``, ``loader`` and
    ``grad_accum_steps``); the events in the metrics records."""

    def __init__(
        self,
        guard: StepGuard,
        *,
        stop_requested=lambda: False,
        checkpointer=None,
        loader=None,
        grad_accum_steps: int = 1,
    ):
        self.guard, self.stop_requested = guard, stop_requested
        self.checkpointer, self.loader, self.grad_accum_steps = checkpointer, loader, grad_accum_steps

    def before_update(self, state, result) -> None:
        guard = self.guard
        guard.maybe_inject_nan(result)
        agreed = getattr(result, "stop_flag", None) is not None  # the step reduced loss, norm and stop together
        stop = result.stop_flag if agreed else self.stop_requested()
        check = guard.check(result.step, result.loss, result.grad_norm, stop, agreed=agreed)
        result.values, result.stop_requested = (check.loss, check.grad_norm), check.stop_requested
        result.lr_scale, result.action = guard.lr_scale(result.step), check.action
        result.extra.update(guard.counters())
        if check.event is None:
            return
        result.event = check.event
        if check.action == "skip":
            state.log(check.event.record(guard.counters()))
        elif check.action == "rollback":
            _, state.data_iter = rollback(guard, check.event, self.checkpointer, self.loader, self.grad_accum_steps)

    def on_resume(self, state, result) -> None:
        """The rollback's event, logged after the records were rewound to the checkpoint's step."""
        if result.event is not None:
            state.log(result.event.record(self.guard.counters()))
