"""Downstream benchmarks (HellaSwag, ARC, PIQA, LAMBADA) scored by log-likelihood, as lm-eval defines them.

``evaluate(model, tokenizer, ["hellaswag", "lambada_openai"], data_dir)`` scores a model (plain, FSDP or
TP sharded) and returns per-task metrics and per-item records (:mod:`titanlite.eval.scoring`);
the tasks and how to add one are in :mod:`titanlite.eval.tasks`; the command line
``python -m titanlite.eval --checkpoint DIR --tasks ...`` is :mod:`titanlite.eval.cli`.
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
