"""The training recipes shipped with titanlite (``train_configs/`` of the repository): ``--config NAME``.

The package carries them as ``titanlite/configs/*.toml`` (in the repository a link to ``train_configs/``, which
stays their one source; a wheel holds copies). ``--config debug_model`` (or ``debug_model.toml``) names a shipped
recipe when no such file exists where the command runs, so an installed titanlite trains them from any folder;
``titanlite train --list-configs`` lists them.
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path

from titanlite.config.sections import ConfigError
from titanlite.config.toml_io import read_toml

SUFFIX = ".toml"


def shipped_configs() -> dict[str, Path]:
    """``{recipe name (file stem): path}`` of the shipped recipes, sorted by name; empty when none are installed."""
    folder = importlib.resources.files("titanlite") / "configs"
    if not folder.is_dir():
        return {}
    found = {Path(entry.name).stem: Path(str(entry)) for entry in folder.iterdir() if entry.name.endswith(SUFFIX)}
    return dict(sorted(found.items()))


def resolve_config(path: str) -> str:
    """``path`` itself when it exists or names a folder (``a/b.toml``); else the shipped recipe a bare name
    (``llama1b``, ``llama1b.toml``) names. ConfigError naming the shipped recipes when it is neither."""
    if os.path.exists(path) or os.sep in path or (os.altsep and os.altsep in path):
        return path
    name = path[: -len(SUFFIX)] if path.endswith(SUFFIX) else path
    recipes = shipped_configs()
    if name in recipes:
        return str(recipes[name])
    raise ConfigError(
        f"config file {path} not found, and no shipped recipe is named {name!r} (shipped: "
        f"{', '.join(recipes) or 'none'}; titanlite train --list-configs)"
    )


def list_configs() -> str:
    """One line per shipped recipe: its name, then its ``[job] description``."""
    lines = []
    for name, path in shipped_configs().items():
        try:
            description = read_toml(str(path)).get("job", {}).get("description", "")
        except ConfigError:  # a damaged copy: listed, and reported in full when used
            description = "(unreadable)"
        lines.append(f"{name:<20} {description}".rstrip())
    return "\n".join(lines)
