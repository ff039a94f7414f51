"""The training loop's hook points and the state it shares with them (OLMo-core's callbacks, in small).

:meth:`titanlite.trainer.Trainer.train` calls every hook's methods (:class:`Hook`) in list order, ``on_train_end``
in reverse, like nested context managers closing. Validation, metrics, the NaN/spike guard, preemption, the
profiler and checkpointing are hooks; a foreign loop can drive them with its own :class:`LoopState`
(:func:`run_steps` does it for a step function).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

logger = logging.getLogger("titanlite")


@dataclasses.dataclass
class LoopState:
    """Where the loop is: ``step`` optimizer steps done, ``tokens_seen``, the logged ``records``.

    ``state_dict``/``load_state_dict`` carry ``step``, ``tokens_seen`` and ``source_tokens`` (the checkpoint's
    ``train_state``). ``data_iter``: the training batches (a rollback replaces it); ``stop`` ends the loop after
    the current step; ``sink`` receives every logged record; ``side_seconds``: the time hooks spent evaluating the
    model (:meth:`side_work`), which training throughput leaves out.
    """

    total_steps: int
    step: int = 0
    tokens_seen: int = 0
    stop: bool = False
    data_iter: Iterator | None = None
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    sink: Any = None  # anything with .log(record), e.g. a MetricsLogger
    side_seconds: float = 0.0
    source_tokens: dict[str, int] = dataclasses.field(default_factory=dict)  # a mixture's tokens per source

    @contextlib.contextmanager
    def side_work(self) -> Iterator[None]:
        """Time spent inside goes to ``side_seconds``, out of the tokens/s of the steps around it."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.side_seconds += time.perf_counter() - start

    def log(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self.sink is not None:
            self.sink.log(record)

    @property
    def last_step(self) -> bool:
        return self.step >= self.total_steps

    def state_dict(self) -> dict[str, int]:
        per_source = {f"tokens_seen/{name}": n for name, n in self.source_tokens.items()}
        return {"step": self.step, "tokens_seen": self.tokens_seen, **per_source}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        prefix = "tokens_seen/"
        self.source_tokens = {k[len(prefix) :]: int(v) for k, v in state.items() if k.startswith(prefix)}

    def count_sources(self, names: list[str], tokens: list[int]) -> None:
        """Add a step's tokens per mixture source (``StepResult.extra["source_tokens"]``)."""
        for name, n in zip(names, tokens):
            self.source_tokens[name] = self.source_tokens.get(name, 0) + int(n)


class Hook:
    """Base class: every hook point is a no-op; override the ones you need."""

    def on_train_start(self, state: LoopState) -> None:
        """Before the first step, after a resume set ``state.step``."""

    def before_update(self, state: LoopState, result: Any) -> None:
        """After backward and clipping, before the optimizer step of step ``result.step``: may set ``result.action``
        (``"update"``, ``"skip"``, ``"rollback"``), ``.lr_scale`` or ``.stop_requested``, or fill ``.values``."""

    def on_step_end(self, state: LoopState, result: Any) -> None:
        """After step ``state.step`` (skipped steps count as steps)."""

    def on_resume(self, state: LoopState, result: Any) -> None:
        """After a checkpoint reload during step ``result.step`` moved ``state.step`` back (a rollback)."""

    def on_train_end(self, state: LoopState) -> None:
        """After the last step, also after an early stop."""


def call_hooks(hooks: list[Hook], point: str, *args: Any) -> None:
    """Call ``point`` on every hook, in order. ``on_train_end`` goes in reverse order and reaches every
    hook even when one raises (the first error is raised after the last hook: every log and file is
    still closed)."""
    if point != "on_train_end":
        for hook in hooks:
            getattr(hook, point)(*args)
        return
    error = None
    for hook in reversed(hooks):
        try:
            hook.on_train_end(*args)
        except Exception as e:  # noqa: BLE001 - raised below, once every hook has run
            error = error or e
    if error is not None:
        raise error


def run_steps(
    hooks: list[Hook], state: LoopState, step: Callable[[Callable], Any], sources: Sequence[str] = ()
) -> None:
    """The loop after ``on_train_start``: ``step(before_update)`` (an optimizer step that calls ``before_update``
    with its result) until ``state.total_steps`` or ``state.stop``, every hook point in its place; ``sources``: a
    mixture's source names (``result.extra["source_tokens"]``). ``on_train_end`` runs after an error too; the
    loop's error is the one raised (closing may fail as well, e.g. on a full disk: logged)."""
    try:
        while state.step < state.total_steps and not state.stop:
            result = step(lambda r: call_hooks(hooks, "before_update", state, r))
            if result.action == "rollback":  # the guard reloaded a checkpoint: state.step went back
                call_hooks(hooks, "on_resume", state, result)
                continue
            state.step += 1
            state.tokens_seen += result.tokens
            if (per_source := result.extra.pop("source_tokens", None)) is not None:
                state.count_sources(list(sources), per_source)
            call_hooks(hooks, "on_step_end", state, result)
    except BaseException:
        try:
            call_hooks(hooks, "on_train_end", state)
        except Exception as e:  # noqa: BLE001
            logger.error(f"closing the run after that error failed too: {type(e).__name__}: {e}")
        raise
    call_hooks(hooks, "on_train_end", state)  # the last save is waited for, logs and threads are closed
