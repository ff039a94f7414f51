"""Extensions: Python modules a run imports before its config is checked (``[job] extensions``).

An extension plugs into titanlite through public hooks only, typically by calling
``titanlite.models.register_model`` when imported (``torchtitan_ext.qwen3`` registers the
``qwen3`` family). Core never imports extensions by name; a config asks for them::

    [job]
    extensions = ["torchtitan_ext.qwen3"]

    [model]
    name = "qwen3"

or on the command line ``--job.extensions torchtitan_ext.qwen3`` (comma-separated for several).
The model name in ``[model]`` is validated against the registry while the config is loaded:
:func:`titanlite.models.load_config` (through :func:`titanlite.models.model_schema`) imports the
extensions (:func:`load_extensions`) once the file and the command-line overrides have set
``job.extensions``, before it checks ``[model]``. Any script or trainer that loads a config that way
therefore sees the families its extensions register.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable


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
