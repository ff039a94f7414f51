"""Command-line values checked as they are parsed (:func:`number`: ``--tokens inf`` is refused before any work,
naming the flag and the range), and argparse parsers whose errors are one line, as every other bad input."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn

from titanlite.errors import UsageError


class OneLineParser(argparse.ArgumentParser):
    """argparse with each error as one ``error: <prog>: ...`` line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {' '.join(message.split())}\n")


class UsageErrorParser(argparse.ArgumentParser):
    """argparse with each error raised as a :class:`~titanlite.errors.UsageError` (the command reports it)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _range_text(kind: type, bounds: dict[str, float | None]) -> str:
    """``"a finite number >= 0 and < 1"``: what :func:`number` expects, for its error message."""
    signs = {"at_least": ">=", "above": ">", "at_most": "<=", "below": "<"}
    limits = [f"{signs[k]} {v}" for k, v in bounds.items() if v is not None]
    return " and ".join(["an integer" if kind is int else "a finite number", *limits]).replace(" and ", " ", 1)


def number(
    kind: type = float,
    *,
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
    below: float | None = None,
) -> Callable[[str], int | float]:
    """An argparse ``type``: the text read as ``kind`` (``int`` or ``float``; a float must be finite), within the
    bounds given (``at_least`` / ``above`` below it, ``at_most`` / ``below`` above it). Anything else is an
    ``ArgumentTypeError`` saying what was expected, which argparse reports with the flag's name."""
    expected = _range_text(kind, dict(at_least=at_least, above=above, at_most=at_most, below=below))

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        fits = (
            (kind is int or math.isfinite(value))
            and (at_least is None or value >= at_least)
            and (above is None or value > above)
            and (at_most is None or value <= at_most)
            and (below is None or value < below)
        )
        if not fits:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse
