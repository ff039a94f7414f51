"""The errors a user can fix: bad input, reported by every command line as one ``error: ...`` line.

Every command line (``titanlite <command>``, ``python -m titanlite.train``, ``python -m titanlite.generate``,
``python -m titanlite.eval``) catches :class:`UserError` only: it prints ``error: <message>`` on stderr (prefixed
``rank N:`` where each rank of a distributed job reports its own) and exits with the error's :attr:`exit_code`. Any
other exception is a bug and keeps its traceback. Exit codes:

- 2: bad input (the config, a command-line flag, data, a tokenizer, a checkpoint) or a full disk; nothing
  was written or deleted, as with argparse's usage errors;
- 1: the run stopped as its config asked (:class:`titanlite.trainer.guard.TrainingDivergedError` under
  ``[guard] policy = "raise"``, :class:`titanlite.data.mixture.DataExhausted`);
- 128 + N: stopped by signal N with nothing resumable saved (:mod:`titanlite.trainer.preemption`).

The kinds below also derive from ``ValueError`` so that code catching ``ValueError`` around a parse or a check keeps
working. A message is one line: the raiser names the file, key or flag and what was expected.
"""

from __future__ import annotations


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
