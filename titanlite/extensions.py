"""Extensions: Python modules a run imports before its config is checked (``[job] extensions``). They plug in
through public hooks only (``titanlite.models.register_model``, ``titanlite.components.register``) when imported;
:func:`titanlite.models.load_config` imports them before it checks ``[model]`` (docs/extensions.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from titanlite.errors import ConfigError, one_line


def load_extensions(names: Iterable[str]) -> list[str]:
    """Import each module (idempotent); ``ValueError`` naming the module when one fails."""
    loaded = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # ImportError, or an error raised while registering
            msg = one_line(e)
            raise ConfigError(f"job.extensions: cannot import {name!r} ({type(e).__name__}: {msg})") from e
        except SystemExit as e:  # a module that exits while imported: the run would end with no word of why
            raise ConfigError(f"job.extensions: importing {name!r} called sys.exit({e.code!r})") from None
        loaded.append(name)
    return loaded
