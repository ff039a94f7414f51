"""Graceful shutdown on SIGTERM / SIGINT (preemption, ``scancel``, Ctrl-C); what a user sees, the exit status and
torchrun's part: docs/monitoring.md, "Preemption".

First signal: the handler only records the request, which is all-reduced with the step's loss
(:meth:`titanlite.trainer.step.TrainStep.reduce_step`, or with the NaN guard's flags), so every rank stops after the
same step even when only one got the signal (the others count it as SIGTERM in their exit status);
:class:`PreemptionHook` then saves and ends the loop. Second signal: exit at once (an interrupted save leaves a
``step-N.partial-*`` folder, removed at the next start), unless it is the same signal within
:data:`REPEAT_WINDOW_S`: a scheduler that signals every process of a job makes a worker under torchrun get its
SIGTERM twice, milliseconds apart.

Handlers install from the main thread only, around ``Trainer.train()`` (``with trainer.preemption:``), and the
previous ones are restored on exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable

from titanlite.trainer.hooks import Hook

logger = logging.getLogger("titanlite.trainer.preemption")

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_WINDOW_S = 5.0  # the same signal again this soon is a forwarded copy of the first, not a second request


class PreemptionHandler:
    """Records a stop request on the first signal, exits at once on the second; says what the exit status
    of the process should be once the loop has stopped (:meth:`exit_status`)."""

    def __init__(
        self,
        signals: Iterable[int] = DEFAULT_SIGNALS,
        exit_fn: Callable[[int], None] = os._exit,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.signals, self.exit_fn, self.clock = tuple(signals), exit_fn, clock
        self.requested, self.signal_name = False, ""  # the first signal's name once requested
        self.signum: int | None = None  # the first signal's number once requested
        self.unsaved_stop = False  # stopped with no resumable checkpoint of that step (record_stop)
        self._requested_at = 0.0
        self._previous: dict[int, object] = {}

    def install(self) -> PreemptionHandler:
        if threading.current_thread() is not threading.main_thread():
            logger.info("preemption: not on the main thread, so SIGTERM/SIGINT keep their default behaviour")
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def __enter__(self) -> PreemptionHandler:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def request(self, signum: int) -> None:
        """Record a stop request as if ``signum`` had been received (the signal handler's first signal)."""
        self.requested, self.signum, self.signal_name = True, int(signum), signal.Signals(signum).name
        self._requested_at = self.clock()
        logger.warning(
            "preemption: received %s: finishing the current step, then saving a checkpoint and exiting "
            "(another signal exits at once; the same one within %.0f s counts as this one)",
            self.signal_name,
            REPEAT_WINDOW_S,
        )

    def record_stop(self, saved: bool) -> None:
        """The loop stopped on the request; ``saved``: a resumable checkpoint of the stopped step is on disk."""
        self.unsaved_stop = not saved

    def exit_status(self) -> int:
        """0, or 128 + the signal's number when the loop stopped on a request with nothing resumable saved for
        the stopped step (SIGTERM's number when the request came from another rank): a job that was stopped
        with nothing to resume from must not look finished to a scheduler."""
        if not self.unsaved_stop:
            return 0
        return 128 + (self.signum if self.signum is not None else int(signal.SIGTERM))

    def _handle(self, signum: int, frame) -> None:
        if not self.requested:
            self.request(signum)
            return
        name = signal.Signals(signum).name
        if signum == self.signum and self.clock() - self._requested_at < REPEAT_WINDOW_S:
            logger.info(
                "preemption: %s again within %.0f s: the same request (e.g. forwarded by torchrun)",
                name,
                REPEAT_WINDOW_S,
            )
            return
        logger.warning("preemption: second signal (%s): exiting now without waiting", name)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # exiting anyway
                stream.flush()
        self.exit_fn(128 + signum)


class PreemptionHook(Hook):
    """Stop after a step on which a stop was requested (``result.stop_requested``, agreed across ranks by the
    step's reduction, read by the guard): a full checkpoint of that step unless one was just saved, then
    ``state.stop``; whether it is on disk goes to the handler (:meth:`PreemptionHandler.record_stop`)."""

    def __init__(self, handler: PreemptionHandler, checkpointer=None):
        self.handler, self.checkpointer = handler, checkpointer

    def on_step_end(self, state, result) -> None:
        if not result.stop_requested or state.last_step:
            return
        step = state.step
        saved, what = self._save(step)
        self.handler.record_stop(saved)
        if not saved:
            what += f"; the command exits with status {self.handler.exit_status()} (128 + the signal number)"
        on = self.handler.signal_name or "a signal on another rank"
        logger.warning("preemption: stopped after step %d of %d on %s; %s", step, state.total_steps, on, what)
        state.stop = True

    def _save(self, step: int) -> tuple[bool, str]:
        """A full checkpoint of ``step``, waited for: (whether it is on disk, what happened, for the log line).
        A failed save is logged and reported, not raised: the stop goes on, with a non-zero exit status."""
        ckpt = self.checkpointer
        if ckpt is None or not ckpt.enabled:
            return False, "checkpointing is off ([checkpoint] enable = false): nothing was saved"
        try:
            if ckpt.last_saved_step != step:
                ckpt.save(step, force=True)
            ckpt.wait()
        except Exception as e:  # noqa: BLE001 - every rank sees the collective save fail the same way
            logger.error("preemption: the checkpoint of step %d failed: %s: %s", step, type(e).__name__, e)
            return False, f"the checkpoint of step {step} failed ({type(e).__name__}): nothing resumable was saved"
        return True, f"checkpoint of step {step} saved; rerun the same command to resume"
