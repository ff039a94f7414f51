"""The metrics record of downstream scores, and their log line: the in-loop evaluation and the watcher write the
same keys, ``eval/<task>/<metric>``, under the step of the weights they scored, so a curve does not care which of
the two computed a point.
"""

from __future__ import annotations

from typing import Any


def eval_record(step: int, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``{"step", "eval/<task>/<metric>": value}`` of every numeric metric in ``results`` (items left out)."""
    record: dict[str, Any] = {"step": step}
    for task, metrics in results.items():
        for name, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                record[f"eval/{task}/{name}"] = value
    return record


def scores_line(results: dict[str, dict[str, Any]]) -> str:
    """One log line of the scores (standard errors left out):
    ``hellaswag acc 0.26 acc_norm 0.27 | lambada_openai acc 0.01 perplexity 2e+03 ...``."""
    parts = []
    for task, metrics in results.items():
        values = [
            f"{k} {v:.4g}"
            for k, v in metrics.items()
            if isinstance(v, float) and not k.startswith("num_") and not k.endswith("_stderr")
        ]
        parts.append(f"{task} {' '.join(values)}")
    return " | ".join(parts)
