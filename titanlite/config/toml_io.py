"""TOML in and out for configs, with no schema: a file read strictly (UTF-8, a byte-order mark allowed) and values
written back as TOML (:func:`titanlite.config.parser.config_to_toml` writes a whole config with them)."""

from __future__ import annotations

import json
import math
import os
from typing import Any

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from titanlite.config.sections import ConfigError
from titanlite.errors import DataError
from titanlite.utils.nesting import loads_toml


def decode_utf8(data: bytes, path: Any, line: int | None = None, *, bom: bool = False) -> str:
    """``data`` (a whole file, or its line ``line``) as text, with a leading byte-order mark dropped when ``bom``
    (editors on Windows write one). DataError naming the file and the line (``path:LINE: not valid UTF-8 (byte N
    of the line)``) for bytes that are not UTF-8."""
    try:
        return data.decode("utf-8-sig" if bom else "utf-8")
    except UnicodeDecodeError as e:
        start = 0 if line is not None else data.rfind(b"\n", 0, e.start) + 1
        line = line if line is not None else data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}:{line}: not valid UTF-8 (byte {e.start - start + 1} of the line)") from None


def read_toml(path: str) -> dict[str, Any]:
    """A TOML file as a dict (a UTF-8 byte-order mark is allowed); ConfigError naming the file when it is missing
    or malformed, and the line for bytes that are not UTF-8."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} {'is not a file' if os.path.exists(path) else 'not found'}")
    try:
        with open(path, "rb") as fh:
            return loads_toml(decode_utf8(fh.read(), path, bom=True))
    except (tomllib.TOMLDecodeError, OSError) as e:
        what = "malformed TOML in" if isinstance(e, tomllib.TOMLDecodeError) else "cannot read"
        raise ConfigError(f"{what} config file {path}: {e}") from None
    except ValueError as e:
        raise ConfigError(f"config file {e}") from None


def toml_key(k: str) -> str:
    return k if k and all(c.isascii() and (c.isalnum() or c in "_-") for c in k) else toml_value(k)


def toml_value(v: Any) -> str:
    """``v`` (bool, int, float, str, list, dict) as a TOML value; TypeError for anything else."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if v != v else "inf" if v > 0 else "-inf"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(map(toml_value, v)) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{toml_key(str(k))} = {toml_value(x)}" for k, x in v.items() if x is not None) + "}"
    if isinstance(v, (bool, int, float, str)):  # written as JSON writes them: TOML's syntax, but DEL is escaped too
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    raise TypeError(f"cannot write {type(v).__name__} value {v!r} as TOML")
