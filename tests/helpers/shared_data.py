"""The one way tests find the shared test data (tokenizers, small corpora) that lives OUTSIDE the repo.

``SHARED_DATA`` is ``$TITANLITE_SHARED_DATA`` when set, else ``<repo>/../shared/data``.
:func:`shared_file` returns a file under it, or skips the calling test when it is absent.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = Path(os.environ.get("TITANLITE_SHARED_DATA") or REPO.parent / "shared" / "data")


def shared_file(rel: str) -> Path:
    """``SHARED_DATA / rel``; skips the test (with the reason) when it does not exist."""
    path = SHARED_DATA / rel
    if not SHARED_DATA.is_dir():
        pytest.skip(
            f"shared test data not found at {SHARED_DATA}: folder missing "
            f"(set TITANLITE_SHARED_DATA to the data folder)"
        )
    if not path.exists():
        pytest.skip(f"shared test data not found at {SHARED_DATA}: {rel} missing")
    return path
