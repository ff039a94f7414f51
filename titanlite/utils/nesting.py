"""JSON and TOML parsing with a bound on nesting: the one guard every reader of those files goes through.

Python's parsers recurse once per ``[`` or ``{``: a file nested ~100,000 deep raises ``RecursionError``, and one
just below the interpreter's limit can exhaust it later in code that walks it. :func:`loads_json` and
:func:`loads_toml` refuse documents nested deeper than :data:`MAX_DEPTH` with their format's own decode error
(a subclass), so each reader's existing handler names the file in its one-line message. A leaf: imports nothing
from titanlite.
"""

from __future__ import annotations

import json
from typing import IO, Any

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

MAX_DEPTH = 100  # levels of arrays / objects / tables
_WHY = f"nested more than {MAX_DEPTH} levels deep"


class JSONNestingError(json.JSONDecodeError):
    """A JSON document nested deeper than :data:`MAX_DEPTH`."""

    def __init__(self, doc: str | bytes = "") -> None:
        super().__init__(_WHY, doc if isinstance(doc, str) else "", 0)


class TOMLNestingError(tomllib.TOMLDecodeError):
    """A TOML document nested deeper than :data:`MAX_DEPTH`."""

    def __init__(self) -> None:
        ValueError.__init__(self, _WHY)


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether ``value`` (parsed JSON / TOML: dicts, lists, scalars) nests deeper than ``limit``; level by level,
    without recursion."""
    level, depth, kinds = [value] if isinstance(value, (dict, list)) else [], 0, (dict, list)
    while level:
        depth += 1
        if depth > limit:
            return True
        level = [x for c in level for x in (c.values() if isinstance(c, dict) else c) if isinstance(x, kinds)]
    return False


def loads_json(text: str | bytes, **kwargs: Any) -> Any:
    """``json.loads(text)``; :class:`JSONNestingError` (a ``JSONDecodeError``) for too deep a document."""
    try:
        value = json.loads(text, **kwargs)
    except RecursionError:
        raise JSONNestingError(text) from None
    if too_deep(value):
        raise JSONNestingError(text)
    return value


def load_json(fp: IO, **kwargs: Any) -> Any:
    return loads_json(fp.read(), **kwargs)


def loads_toml(text: str) -> dict[str, Any]:
    """``tomllib.loads(text)``; :class:`TOMLNestingError` (a ``TOMLDecodeError``) for too deep a document."""
    try:
        value = tomllib.loads(text)
    except RecursionError:
        raise TOMLNestingError() from None
    if too_deep(value):
        raise TOMLNestingError()
    return value
