"""Checks on what a command-line entry point printed."""

from __future__ import annotations


def one_line_error(capsys) -> str:
    """The one line a user error printed on stderr (``error: ...``); fails unless it is exactly one."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]
