"""Graceful shutdown on SIGTERM / SIGINT (preemption, ``scancel``, Ctrl-C).

First signal: the handler only records the request and logs it. The loop finishes the current optimizer
step (a signal that arrives after a step's check, e.g. during validation or a checkpoint save, is acted on
at the end of the next step); the request is all-reduced with the NaN guard's flags (:mod:`titanlite.guard`),
so every rank stops after that same step, even when the ranks got the signal at slightly different moments
or only one got it (torchrun forwards SIGTERM to every worker). :class:`PreemptionHook` then writes a full
checkpoint of that step when checkpointing is on, waits for asynchronous saves, logs one line and ends the
loop: the process exits 0, and the same command resumes from there exactly (model, optimizer, LR schedule,
data position and RNG are in the checkpoint).

Second signal: exit at once (status 128 + signal number) without waiting for anything; an interrupted
checkpoint write leaves only a ``step-N.partial-*`` folder, removed at the next start.

Handlers can only be installed from the main thread (elsewhere a message says they are not).
``python -m titanlite.train`` installs them around ``Trainer.train()`` (``with trainer.preemption:``), as a
library user may too; the previous handlers are restored on exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable

from titanlite.hooks import Hook

logger = logging.getLogger("titanlite.preemption")

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionHandler:
    """Records a stop request on the first signal, exits at once on the second."""

    def __init__(self, signals: Iterable[int] = DEFAULT_SIGNALS, exit_fn: Callable[[int], None] = os._exit):
        self.signals, self.exit_fn = tuple(signals), exit_fn
        self.requested, self.signal_name = False, ""  # the first signal's name once requested
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

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            logger.warning("preemption: second signal (%s): exiting now without waiting", name)
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):  # exiting anyway
                    stream.flush()
            self.exit_fn(128 + signum)
            return
        self.requested, self.signal_name = True, name
        logger.warning(
            "preemption: received %s: finishing the current step, then saving a checkpoint and exiting "
            "(send it again to exit at once)",
            name,
        )


class PreemptionHook(Hook):
    """Stop after a step on which a stop was requested (``result.stop_requested``, agreed across ranks by the
    guard's check): a full checkpoint of that step unless one was just saved, then ``state.stop``."""

    def __init__(self, handler: PreemptionHandler, checkpointer=None):
        self.handler, self.checkpointer = handler, checkpointer

    def on_step_end(self, state, result) -> None:
        if not result.stop_requested or state.last_step:
            return
        ckpt, step = self.checkpointer, state.step
        saved = ckpt is not None and ckpt.enabled and (ckpt.last_saved_step == step or ckpt.save(step, force=True))
        if ckpt is not None:
            ckpt.wait()
        what = (
            f"checkpoint of step {step} saved; rerun the same command to resume"
            if saved
            else "checkpointing is off ([checkpoint] enable = false): nothing was saved"
        )
        on = self.handler.signal_name or "a signal on another rank"
        logger.warning("preemption: stopped after step %d of %d on %s; %s", step, state.total_steps, on, what)
        state.stop = True
