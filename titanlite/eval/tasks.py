"""Downstream benchmarks as log-likelihood tasks: what to score and how to turn the scores into metrics.

A task reads its data files (original formats, under one data folder) and returns :class:`Item` s: a context, its
continuations ("choices") and the index of the right one; :mod:`titanlite.eval.scoring` computes each choice's
summed log-probability and the task turns those into records and metrics. The built-in tasks are
lm-evaluation-harness's zero-shot definitions, and llm.c's HellaSwag (docs/evaluation.md, "Downstream evaluation",
with "Adding a task"). A task whose files are not one JSON object a line overrides :meth:`Task.items` (:class:`PIQA`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

from titanlite.config import did_you_mean
from titanlite.errors import ConfigError, DataError, one_line
from titanlite.utils.nesting import loads_json

# Keys of the results dict next to the task names (see titanlite.eval.scoring.evaluate and the CLI).
RESERVED_NAMES = ("step", "checkpoint")


@dataclasses.dataclass(frozen=True)
class Item:
    """One benchmark question: ``context`` followed by each of ``choices`` (as scored, with the joining space);
    ``label`` indexes the right one. ``norm_lengths``: what ``acc_norm`` divides each choice's log-likelihood by
    (None: its characters without one leading space, lm-evaluation-harness's rule)."""

    context: str
    choices: tuple[str, ...]
    label: int
    norm_lengths: tuple[int, ...] | None = None

    def lengths(self) -> tuple[int, ...]:
        if self.norm_lengths is not None:
            return self.norm_lengths
        return tuple(len(c) - c.startswith(" ") for c in self.choices)


class Task:
    """A benchmark: ``name`` (its registry key), ``files`` (paths under the data folder it reads) and
    :meth:`items`. Subclasses choose the records and metrics (:class:`MultipleChoiceTask`,
    :class:`ClozeTask`)."""

    name: ClassVar[str] = ""
    files: ClassVar[tuple[str, ...]] = ()
    min_choices: ClassVar[int] = 1

    def items(self, data_dir: str | os.PathLike) -> list[Item]:
        """Every item of the task's first file, one JSON object a line, each made by :meth:`item`."""
        path = self.path(data_dir, self.files[0])
        return require_items(path, [self.parse_row(path, lineno, row) for lineno, row in read_jsonl(path)])

    def item(self, row: dict) -> Item:
        raise NotImplementedError(f"{type(self).__name__} must define item(row) or items(data_dir)")

    def parse_row(self, path: Path, lineno: int, *args: Any) -> Item:
        """``self.item(*args)``, checked; any error in it becomes one line naming ``path`` and ``lineno``."""
        return parse_row(path, lineno, self.item, *args, min_choices=self.min_choices)

    def path(self, data_dir: str | os.PathLike, rel: str) -> Path:
        """``data_dir / rel``; a one-line ValueError when it is not a file."""
        path = Path(data_dir) / rel
        if not path.is_file():
            raise DataError(
                f"{path}: no such file (the {self.name} task reads {', '.join(self.files)} under the data folder)"
            )
        return path

    def record(self, index: int, item: Item, loglik: list[float], num_tokens: list[int], greedy: list[bool]) -> dict:
        raise NotImplementedError

    def metrics(self, records: Sequence[dict]) -> dict[str, Any]:
        raise NotImplementedError


class MultipleChoiceTask(Task):
    """Pick the choice the model finds most likely: ``pred`` is the argmax of each choice's summed
    log-probability (``acc``), ``pred_norm`` of that sum over :meth:`Item.lengths`, or over its token count with
    ``normalize = "tokens"`` (``acc_norm``); ties go to the first choice, as ``numpy.argmax``'s do. Standard
    errors are lm-eval's (sample standard deviation / sqrt(items))."""

    min_choices = 2
    normalize: ClassVar[str] = "chars"

    def record(self, index: int, item: Item, loglik: list[float], num_tokens: list[int], greedy: list[bool]) -> dict:
        lengths = num_tokens if self.normalize == "tokens" else item.lengths()
        return dict(
            index=index,
            label=item.label,
            loglik=loglik,
            num_tokens=num_tokens,
            pred=first_argmax(loglik),
            pred_norm=first_argmax([divide(ll, n) for ll, n in zip(loglik, lengths)]),
        )

    def metrics(self, records: Sequence[dict]) -> dict[str, Any]:
        acc = [float(r["pred"] == r["label"]) for r in records]
        acc_norm = [float(r["pred_norm"] == r["label"]) for r in records]
        return dict(
            acc=mean(acc, self.name),
            acc_stderr=mean_stderr(acc),
            acc_norm=mean(acc_norm, self.name),
            acc_norm_stderr=mean_stderr(acc_norm),
            num_items=len(records),
        )


class ClozeTask(Task):
    """One continuation per item (LAMBADA): ``pred`` is 1 when every continuation token is the greedy argmax, else
    0 (``acc``); ``perplexity`` is lm-eval's per-item ``exp(-mean summed log-probability)``."""

    def record(self, index: int, item: Item, loglik: list[float], num_tokens: list[int], greedy: list[bool]) -> dict:
        pred = int(greedy[0])
        return dict(index=index, label=1, loglik=loglik, num_tokens=num_tokens, pred=pred, pred_norm=pred)

    def metrics(self, records: Sequence[dict]) -> dict[str, Any]:
        acc = [float(r["pred"]) for r in records]
        perplexity = math.exp(-mean([r["loglik"][0] for r in records], self.name))
        return dict(acc=mean(acc, self.name), acc_stderr=mean_stderr(acc), perplexity=perplexity, num_items=len(acc))


def first_argmax(values: Sequence[float]) -> int:
    """The index of the largest value, the first one on ties (so results never depend on a kernel's tie rule)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def divide(loglik: float, length: int) -> float:
    """``loglik / length`` as numpy divides floats: a zero length gives -inf (or nan for 0 / 0)."""
    if length:
        return loglik / length
    return -math.inf if loglik < 0 else math.nan if loglik == 0 else math.inf


def mean(values: Sequence[float], task: str) -> float:
    if not values:
        raise DataError(f"{task}: no items were scored")
    return sum(values) / len(values)


def mean_stderr(values: Sequence[float]) -> float | None:
    """Standard error of the mean (sample standard deviation / sqrt(n)); None for fewer than 2 values."""
    n = len(values)
    if n < 2:
        return None
    mu = sum(values) / n
    return math.sqrt(sum((v - mu) ** 2 for v in values) / (n - 1)) / math.sqrt(n)


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
                raise DataError(f"{path}:{lineno}: not a JSON object ({e.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            yield lineno, row


def require_items(path: Path, items: list[Item]) -> list[Item]:
    if not items:
        raise DataError(f"{path}: no items (the file holds no JSON lines)")
    return items


def parse_row(path: Path, lineno: int, make: Callable[..., Item], *args: Any, min_choices: int = 1) -> Item:
    """``make(*args)``, checked; any error in it becomes one line naming ``path`` and ``lineno``."""
    try:
        item = make(*args)
        if not isinstance(item.context, str) or not all(isinstance(c, str) and c for c in item.choices):
            raise DataError("the context and choices must be strings, and no choice empty")
        if len(item.choices) < min_choices:
            raise DataError(f"{len(item.choices)} choice(s); a multiple-choice item needs at least {min_choices}")
        if not is_int(item.label) or not 0 <= item.label < len(item.choices):
            raise DataError(f"label {item.label!r} does not index its {len(item.choices)} choices")
        lengths = item.lengths()
        if len(lengths) != len(item.choices) or not all(is_int(n) and n >= 0 for n in lengths):
            raise DataError("norm_lengths must be one length >= 0 per choice")
        return item
    except KeyError as e:
        raise DataError(f"{path}:{lineno}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError, IndexError, AttributeError) as e:
        raise DataError(f"{path}:{lineno}: {one_line(e)}") from None


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def text_field(row: dict, key: str) -> str:
    """``row[key]``, which must be a string (a ValueError naming the field otherwise)."""
    value = row[key]
    if not isinstance(value, str):
        raise DataError(f"field {key!r} must be a string, got {type(value).__name__} {value!r:.40}")
    return value


def int_field(row: dict, key: str) -> int:
    """``row[key]`` as an integer: an int or a string of digits (Hugging Face's copies store labels as
    text); a bool, a float or anything else is a ValueError naming the field."""
    value = row[key]
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    if not is_int(value):
        raise DataError(f"field {key!r} must be an integer, got {type(value).__name__} {value!r:.40}")
    return value


def text_list_field(row: dict, key: str) -> list[str]:
    """``row[key]``, which must be a list of strings."""
    value = row[key]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise DataError(f"field {key!r} must be a list of strings, got {type(value).__name__} {value!r:.40}")
    return value


# ----------------------------------------------------------------------------- the registry

_TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    """Register ``cls`` under ``cls.name`` (usable as a class decorator); a taken name is an error."""
    name = cls.name
    if not name or name in RESERVED_NAMES or "," in name:
        taken = ", ".join(RESERVED_NAMES)
        raise ValueError(f"{cls.__name__}.name must be a non-empty name other than {taken}")
    if _TASKS.get(name, cls) is not cls:
        raise ValueError(f"an eval task named {name!r} is already registered ({_TASKS[name].__name__})")
    _TASKS[name] = cls
    return cls


def task_names() -> list[str]:
    return list(_TASKS)


def get_task(name: str) -> Task:
    """A new instance of the task registered as ``name``; a one-line ValueError listing the known ones otherwise."""
    if name not in _TASKS:
        raise ConfigError(f"unknown eval task {name!r} (known: {', '.join(_TASKS)}){did_you_mean(name, list(_TASKS))}")
    return _TASKS[name]()


# ----------------------------------------------------------------------------- the built-in tasks


def hellaswag_clean(text: str) -> str:
    """lm-evaluation-harness's HellaSwag text clean-up: trim, turn WikiHow's `` [title]`` markers into
    sentence ends, drop every other ``[...]`` header, and fold double spaces once."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def hellaswag_label(row: dict, endings: list[str]) -> int:
    label = int_field(row, "label")
    if not 0 <= label < len(endings):
        raise DataError(f"field 'label' is {label}, which does not index the {len(endings)} endings")
    return label


@register_task
class HellaSwag(MultipleChoiceTask):
    """HellaSwag validation as lm-evaluation-harness renders it (docs/evaluation.md has the table)."""

    name = "hellaswag"
    files = ("hellaswag/hellaswag_val.jsonl",)

    def item(self, row: dict) -> Item:
        ctx = text_field(row, "ctx_a") + " " + text_field(row, "ctx_b").capitalize()
        query = hellaswag_clean(text_field(row, "activity_label") + ": " + ctx)
        endings = [hellaswag_clean(e) for e in text_list_field(row, "endings")]
        choices = tuple(" " + e for e in endings)
        return Item(query, choices, hellaswag_label(row, endings), tuple(len(e) for e in endings))


@register_task
class HellaSwagLLMC(MultipleChoiceTask):
    """HellaSwag validation as llm.c's ``dev/data/hellaswag.py`` renders it (``acc_norm`` per token)."""

    name = "hellaswag_llmc"
    files = ("hellaswag/hellaswag_val.jsonl",)
    normalize = "tokens"

    def item(self, row: dict) -> Item:
        endings = text_list_field(row, "endings")
        return Item(text_field(row, "ctx"), tuple(" " + e for e in endings), hellaswag_label(row, endings))


def arc_item(row: dict) -> Item:
    """``Question: {stem}\\nAnswer:`` + ``" {text}"`` per choice; ``answerKey`` is one of the choices'
    labels (letters A-E or digits 1-5; items have 3 to 5 choices, each label once)."""
    question = row["question"]
    if not isinstance(question, dict):
        raise DataError(f"field 'question' must be an object with 'stem' and 'choices', got {type(question).__name__}")
    raw = question["choices"]
    if not isinstance(raw, list) or len(raw) < 2 or not all(isinstance(c, dict) for c in raw):
        raise DataError("field 'question.choices' must be a list of at least 2 {text, label} objects")
    labels = [str(c["label"]) for c in raw]
    if len(set(labels)) != len(labels):
        raise DataError(f"field 'question.choices' repeats a label: {labels}")
    key = str(row["answerKey"])
    if key not in labels:
        raise DataError(f"answerKey {key!r} is none of the choice labels {labels}")
    texts = [text_field(c, "text") for c in raw]
    return Item(f"Question: {text_field(question, 'stem')}\nAnswer:", tuple(" " + t for t in texts), labels.index(key))


@register_task
class ARCEasy(MultipleChoiceTask):
    name = "arc_easy"
    files = ("arc/ARC-Easy-Test.jsonl",)
    item = staticmethod(arc_item)


@register_task
class ARCChallenge(MultipleChoiceTask):
    name = "arc_challenge"
    files = ("arc/ARC-Challenge-Test.jsonl",)
    item = staticmethod(arc_item)


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
                raise DataError(f"{labels_path}: {len(labels)} labels, but {questions} has more questions")
            label_line = len(items) + 1
            text = labels[label_line - 1].strip()
            if text not in ("0", "1"):
                raise DataError(f"{labels_path}:{label_line}: expected a label 0 or 1, got {text!r}")
            items.append(self.parse_row(questions, lineno, row, int(text)))
        if len(items) != len(labels):
            raise DataError(f"{labels_path}: {len(labels)} labels for the {len(items)} questions of {questions}")
        return require_items(questions, items)

    def item(self, row: dict, label: int) -> Item:
        goal, sol1, sol2 = (text_field(row, k) for k in ("goal", "sol1", "sol2"))
        return Item(f"Question: {goal}\nAnswer:", (" " + sol1, " " + sol2), label)


@register_task
class LambadaOpenAI(ClozeTask):
    """LAMBADA (OpenAI's detokenized test set), lm-evaluation-harness's ``lambada_openai``: the text
    split on single spaces; the context is every word but the last joined by ``" "``, the one
    continuation ``" " + last word``."""

    name = "lambada_openai"
    files = ("lambada/lambada_test.jsonl",)

    def item(self, row: dict) -> Item:
        text = text_field(row, "text")
        words = text.split(" ")
        if len(words) < 2 or not words[-1]:
            raise DataError("field 'text' must be a passage of several words, the last one not empty")
        return Item(" ".join(words[:-1]), (" " + words[-1],), 0)
