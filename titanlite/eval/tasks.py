"""Downstream benchmarks as log-likelihood tasks: what to score and how to turn the scores into metrics.

A task reads its data files (in their original formats, under one data folder laid out like
``../shared/data/eval``) and returns :class:`Item` s: a context, one or more continuations
("choices") and the index of the right one. :mod:`titanlite.eval.scoring` computes, for every
(context, choice) pair, the summed log-probability of the choice's tokens given the context, and
the task turns those numbers into per-item records and metrics.

Adding a task is one small class: subclass :class:`MultipleChoiceTask` (or :class:`ClozeTask`),
set ``name`` and ``files`` and write ``item(row)`` for one parsed JSON line, then register it::

    @register_task
    class BoolQ(MultipleChoiceTask):
        name = "boolq"
        files = ("boolq/dev.jsonl",)

        def item(self, row):
            context = f"{row['passage']}\\nQuestion: {row['question']}?\\nAnswer:"
            return Item(context, (" no", " yes"), int(row["answer"]))

An extension module (``--extensions``) registers its tasks the same way when it is imported.
Tasks whose files are not one JSON object a line override :meth:`Task.items` (see :class:`PIQA`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

from titanlite.config import did_you_mean
from titanlite.nesting import loads_json

# Keys of the results dict next to the task names (see titanlite.eval.scoring.evaluate and the CLI).
RESERVED_NAMES = ("step", "checkpoint")


@dataclasses.dataclass(frozen=True)
class Item:
    """One benchmark question: ``context`` followed by each of ``choices``; ``label`` indexes the right one."""

    context: str
    choices: tuple[str, ...]
    label: int


class Task:
    """A benchmark: ``name`` (its registry key), ``files`` (paths under the data folder it reads) and
    :meth:`items`. Subclasses choose the records and metrics (:class:`MultipleChoiceTask`,
    :class:`ClozeTask`)."""

    name: ClassVar[str] = ""
    files: ClassVar[tuple[str, ...]] = ()

    def items(self, data_dir: str | os.PathLike) -> list[Item]:
        """Every item of the task's first file, one JSON object a line, each made by :meth:`item`."""
        path = self.path(data_dir, self.files[0])
        return [parse_row(path, lineno, self.item, row) for lineno, row in read_jsonl(path)]

    def item(self, row: dict) -> Item:
        raise NotImplementedError(f"{type(self).__name__} must define item(row) or items(data_dir)")

    def path(self, data_dir: str | os.PathLike, rel: str) -> Path:
        """``data_dir / rel``; a one-line ValueError when it is not a file."""
        path = Path(data_dir) / rel
        if not path.is_file():
            raise ValueError(
                f"{path}: no such file (the {self.name} task reads {', '.join(self.files)} under the data folder)"
            )
        return path

    def record(self, index: int, item: Item, loglik: list[float], num_tokens: list[int], greedy: list[bool]) -> dict:
        raise NotImplementedError

    def metrics(self, records: Sequence[dict]) -> dict[str, Any]:
        raise NotImplementedError


class MultipleChoiceTask(Task):
    """Pick the choice the model finds most likely.

    ``pred``: the argmax of the summed log-probability of each choice's tokens (``acc``);
    ``pred_norm``: the argmax of its mean per-token log-probability (``acc_norm``), llm.c's
    HellaSwag normalization (lm-evaluation-harness normalizes by bytes instead). Ties go to the
    first choice."""

    def record(self, index: int, item: Item, loglik: list[float], num_tokens: list[int], greedy: list[bool]) -> dict:
        per_token = [ll / max(n, 1) for ll, n in zip(loglik, num_tokens)]
        return dict(
            index=index,
            label=item.label,
            loglik=loglik,
            num_tokens=num_tokens,
            pred=first_argmax(loglik),
            pred_norm=first_argmax(per_token),
        )

    def metrics(self, records: Sequence[dict]) -> dict[str, Any]:
        n = len(records)
        return dict(
            acc=sum(r["pred"] == r["label"] for r in records) / n if n else math.nan,
            acc_norm=sum(r["pred_norm"] == r["label"] for r in records) / n if n else math.nan,
            num_items=n,
        )


class ClozeTask(Task):
    """One continuation per item (LAMBADA): ``pred`` (and ``pred_norm``) is 1 when every continuation
    token is the greedy argmax given what precedes it, else 0; ``label`` is 1. Metrics: ``acc`` (the
    fraction of 1s) and ``perplexity = exp(-mean over items of the continuation's summed
    log-probability)``, lm-evaluation-harness's definition for LAMBADA (a per-item, not a per-token,
    perplexity)."""

    def record(self, index: int, item: Item, loglik: list[float], num_tokens: list[int], greedy: list[bool]) -> dict:
        pred = int(greedy[0])
        return dict(index=index, label=1, loglik=loglik, num_tokens=num_tokens, pred=pred, pred_norm=pred)

    def metrics(self, records: Sequence[dict]) -> dict[str, Any]:
        n = len(records)
        if not n:
            return dict(acc=math.nan, perplexity=math.nan, num_items=0)
        mean_loglik = sum(r["loglik"][0] for r in records) / n
        return dict(acc=sum(r["pred"] for r in records) / n, perplexity=math.exp(-mean_loglik), num_items=n)


def first_argmax(values: Sequence[float]) -> int:
    """The index of the largest value, the first one on ties (so results never depend on a kernel's tie rule)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


# ----------------------------------------------------------------------------- reading files


def read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for each non-blank line; a one-line ValueError naming the line otherwise."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = loads_json(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            yield lineno, row


def parse_row(path: Path, lineno: int, make: Callable[..., Item], *args: Any) -> Item:
    """``make(*args)``, checked; any error in it becomes one line naming ``path`` and ``lineno``."""
    try:
        item = make(*args)
        if not isinstance(item.context, str) or not all(isinstance(c, str) and c for c in item.choices):
            raise ValueError("the context and choices must be strings, and no choice empty")
        if not item.choices or not 0 <= item.label < len(item.choices):
            raise ValueError(f"label {item.label} does not index its {len(item.choices)} choices")
        return item
    except KeyError as e:
        raise ValueError(f"{path}:{lineno}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError, IndexError, AttributeError) as e:
        raise ValueError(f"{path}:{lineno}: {' '.join(str(e).split())}") from None


# ----------------------------------------------------------------------------- the registry

_TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    """Register ``cls`` under ``cls.name`` (usable as a class decorator); a taken name is an error."""
    name = cls.name
    if not name or name in RESERVED_NAMES or "," in name:
        raise ValueError(f"{cls.__name__}.name must be a non-empty name other than {', '.join(RESERVED_NAMES)}")
    if _TASKS.get(name, cls) is not cls:
        raise ValueError(f"an eval task named {name!r} is already registered ({_TASKS[name].__name__})")
    _TASKS[name] = cls
    return cls


def task_names() -> list[str]:
    return list(_TASKS)


def get_task(name: str) -> Task:
    """A new instance of the task registered as ``name``; a one-line ValueError listing the known ones otherwise."""
    if name not in _TASKS:
        raise ValueError(f"unknown eval task {name!r} (known: {', '.join(_TASKS)}){did_you_mean(name, list(_TASKS))}")
    return _TASKS[name]()


# ----------------------------------------------------------------------------- the built-in tasks


@register_task
class HellaSwag(MultipleChoiceTask):
    """HellaSwag validation, completion style as llm.c's ``dev/data/hellaswag.py`` renders it: the
    context is ``ctx`` as given, each choice is ``" " + ending``; ``label`` indexes ``endings``."""

    name = "hellaswag"
    files = ("hellaswag/hellaswag_val.jsonl",)

    def item(self, row: dict) -> Item:
        return Item(row["ctx"], tuple(" " + ending for ending in row["endings"]), int(row["label"]))


def arc_item(row: dict) -> Item:
    """``Question: {stem}\\nAnswer:`` + ``" {text}"`` per choice; ``answerKey`` is one of the choices'
    labels (letters A-E or digits 1-5; items have 3 to 5 choices)."""
    question = row["question"]
    labels = [str(c["label"]) for c in question["choices"]]
    key = str(row["answerKey"])
    if key not in labels:
        raise ValueError(f"answerKey {key!r} is none of the choice labels {labels}")
    choices = tuple(" " + c["text"] for c in question["choices"])
    return Item(f"Question: {question['stem']}\nAnswer:", choices, labels.index(key))


@register_task
class ARCEasy(MultipleChoiceTask):
    name = "arc_easy"
    files = ("arc/ARC-Easy-Test.jsonl",)

    def item(self, row: dict) -> Item:
        return arc_item(row)


@register_task
class ARCChallenge(MultipleChoiceTask):
    name = "arc_challenge"
    files = ("arc/ARC-Challenge-Test.jsonl",)

    def item(self, row: dict) -> Item:
        return arc_item(row)


@register_task
class PIQA(MultipleChoiceTask):
    """PIQA validation: ``Question: {goal}\\nAnswer:`` + ``" {sol}"``; the labels (0 = sol1, 1 = sol2)
    are a separate file, one a line, in the same order as the questions."""

    name = "piqa"
    files = ("piqa/valid.jsonl", "piqa/valid-labels.lst")

    def items(self, data_dir: str | os.PathLike) -> list[Item]:
        questions, labels_path = self.path(data_dir, self.files[0]), self.path(data_dir, self.files[1])
        labels = labels_path.read_text(encoding="utf-8").split("\n")
        while labels and not labels[-1].strip():
            labels.pop()
        items = []
        for lineno, row in read_jsonl(questions):
            if len(items) >= len(labels):
                raise ValueError(f"{labels_path}: {len(labels)} labels, but {questions} has more questions")
            label_line = len(items) + 1
            text = labels[label_line - 1].strip()
            if text not in ("0", "1"):
                raise ValueError(f"{labels_path}:{label_line}: expected a label 0 or 1, got {text!r}")
            items.append(parse_row(questions, lineno, self.item, row, int(text)))
        if len(items) != len(labels):
            raise ValueError(f"{labels_path}: {len(labels)} labels for the {len(items)} questions of {questions}")
        return items

    def item(self, row: dict, label: int) -> Item:
        return Item(f"Question: {row['goal']}\nAnswer:", (" " + row["sol1"], " " + row["sol2"]), label)


@register_task
class Lambada(ClozeTask):
    """LAMBADA (OpenAI's detokenized test set, lm-evaluation-harness's ``lambada_openai``): the
    context is the passage up to its last space, the one continuation ``" " + last word``."""

    name = "lambada"
    files = ("lambada/lambada_test.jsonl",)

    def item(self, row: dict) -> Item:
        text = row["text"]
        if not isinstance(text, str) or " " not in text.strip():
            raise ValueError("'text' must be a passage of several words")
        context, word = text.rsplit(" ", 1)
        return Item(context, (" " + word,), 0)
