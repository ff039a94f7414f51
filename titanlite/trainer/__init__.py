"""The training loop: :class:`Trainer` and its pieces (step, hooks for metrics, guard, preemption, profiling,
validation, samples and seq_len stages; ``assemble.build_training`` for a foreign loop)."""

from titanlite.trainer.trainer import Trainer  # noqa: F401
