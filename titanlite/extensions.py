"""Extensions: Python modules a run imports before its config is checked (``[job] extensions``).

An extension plugs into titanlite through public hooks only, typically by calling
``titanlite.models.register_model`` when imported (``torchtitan_ext.qwen3`` registers the
``qwen3`` family). Core never imports extensions by name; a config asks for them::

    [job]
    extensions = ["torchtitan_ext.qwen3"]

    [model]
    name = "qwen3"

or on the command line ``--job.extensions torchtitan_ext.qwen3`` (comma-separated for several).
The model name in ``[model]`` is validated against the registry while the config is loaded, so the
extensions must be imported *before* that: :func:`extensions_from_argv` reads them from the same
``--config`` file and overrides (a command-line value replaces the file's, as for any key), and
:func:`load_extensions` imports them. ``titanlite.train.main`` does both first; code that calls
:func:`titanlite.config.load_config` itself imports its extensions first (a plain ``import``).
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import Iterable, Sequence

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

_KEY = "job.extensions"


def extensions_from_argv(argv: Sequence[str]) -> list[str]:
    """The ``[job] extensions`` a command line asks for (file value, replaced by ``--job.extensions``).

    Lenient on purpose: anything malformed is left for the config loader to report.
    """
    path, cli = None, None
    args = list(argv)
    for i, tok in enumerate(args):
        name, value = tok, None
        if tok.startswith("--") and "=" in tok:
            name, value = tok.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            value = args[i + 1]
        if name == "--config" and value:
            path = value
        elif name == "--" + _KEY and value is not None:
            cli = [s.strip() for s in value.split(",") if s.strip()]
    if cli is not None:
        return cli
    if path is None or not os.path.isfile(path):
        return []
    try:
        with open(path, "rb") as fh:
            names = tomllib.load(fh).get("job", {}).get("extensions", [])
    except (OSError, tomllib.TOMLDecodeError, AttributeError):
        return []
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def load_extensions(names: Iterable[str]) -> list[str]:
    """Import each module (idempotent); ``ValueError`` naming the module when one fails."""
    loaded = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # ImportError, or an error raised while registering
            msg = " ".join(str(e).split())
            raise ValueError(f"job.extensions: cannot import {name!r} ({type(e).__name__}: {msg})") from e
        loaded.append(name)
    return loaded


def load_extensions_or_exit(argv: Sequence[str]) -> list[str]:
    """For entry points: ``error: ...`` on stderr and exit status 2 when an extension fails."""
    try:
        return load_extensions(extensions_from_argv(argv))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
