"""The errors a user can fix: bad input, reported by every command line as one ``error: ...`` line.

Every command line catches :class:`UserError` only: it prints ``error: <message>`` on stderr (``rank N:`` first
where each rank reports its own) and exits with :attr:`~UserError.exit_code`; any other exception is a bug and keeps
its traceback. Exit codes: 2, bad input or a full disk, nothing written or deleted (as argparse's usage errors); 1,
the run stopped as its config asked (``TrainingDivergedError``, ``DataExhausted``); 128 + N, stopped by signal N
with nothing resumable saved (:mod:`titanlite.trainer.preemption`). The kinds also derive from ``ValueError``, so
code catching ``ValueError`` around a parse or a check keeps working.
"""

from __future__ import annotations


def one_line(e: object) -> str:
    """``str(e)`` on one line: newlines, tabs and runs of spaces collapsed to single spaces (an error message as
    the command lines print it)."""
    return " ".join(str(e).split())


class UserError(Exception):
    """Input the user can fix; :attr:`exit_code` is the command line's exit status."""

    exit_code = 2


class ConfigError(UserError, ValueError):
    """A problem with the configuration (file, command line or values); the message is one line."""

    def __init__(self, msg: object) -> None:
        super().__init__(" ".join(str(msg).splitlines()))


class UsageError(UserError, ValueError):
    """A bad command-line flag of a tool that has no TOML config (``generate``, ``eval``, ``convert``, ...)."""


class DataError(UserError, ValueError):
    """A training, validation or eval data file that is missing, unreadable or malformed."""


class TokenizerError(UserError, ValueError):
    """A tokenizer file or name that is missing, unreadable or does not fit the model."""


class CheckpointError(UserError, ValueError):
    """A checkpoint or Hugging Face folder that is missing, damaged or does not fit the config."""


class MissingPackageError(UserError, ImportError):
    """An optional package a setting needs (``wandb``, ``pyarrow``) is not installed; the message names it."""


class NotFoundError(UserError, FileNotFoundError):
    """A file or folder the user named (a checkpoint, a dump folder, an input) does not exist."""

    def __str__(self) -> str:
        return Exception.__str__(self)  # the message as given, not OSError's "[Errno ...]" form


class UnknownNameError(ConfigError, KeyError):
    """A name no registry holds (a model family, a flavor, a model arg); also a ``KeyError``, as a lookup."""

    def __str__(self) -> str:
        return Exception.__str__(self)  # the message as given, not KeyError's quoted repr
