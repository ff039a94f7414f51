"""Downstream benchmarks (HellaSwag, ARC, PIQA, LAMBADA) scored by log-likelihood, as lm-eval defines them:
:func:`evaluate` (:mod:`titanlite.eval.scoring`) scores a plain or sharded model; tasks and adding one:
:mod:`titanlite.eval.tasks`; the command line: :mod:`titanlite.eval.cli`.
"""

from titanlite.eval.scoring import evaluate
from titanlite.eval.tasks import ClozeTask, Item, MultipleChoiceTask, Task, get_task, register_task, task_names

__all__ = [
    "ClozeTask",
    "Item",
    "MultipleChoiceTask",
    "Task",
    "evaluate",
    "get_task",
    "register_task",
    "task_names",
]
