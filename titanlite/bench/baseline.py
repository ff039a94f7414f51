"""Measure an older titanlite side by side with this one, in the same benchmark run.

``--baseline REF`` in ``titanlite bench generate`` / ``bench eval``: the ``titanlite`` package of git
revision ``REF`` of this checkout is extracted (``git archive``, nothing checked out or registered) into a
temporary folder, with this version's ``titanlite/bench`` copied into it, and a worker process runs the same
benchmark module there with ``--serve``: it imports the old package (first on ``PYTHONPATH``) and answers one
JSON request per line on stdin with one JSON line on stdout. The caller interleaves the worker's timings with
its own, round by round, so both see the same machine load. The benchmark's measuring code must only use what
both versions have.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]  # the checkout (git archive needs one)


def extract_package(ref: str, dest: Path) -> Path:
    """``titanlite/`` of git revision ``ref`` written under ``dest``, with this version's benchmarks as its
    ``titanlite/bench``; returns ``dest``."""
    try:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", "--format=tar", ref, "titanlite"],
            check=True,
            capture_output=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        why = detail.decode(errors="replace").strip() or e
        raise SystemExit(f"error: --baseline {ref}: git archive failed: {why}") from None
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    bench = Path(__file__).resolve().parent
    shutil.copytree(
        bench, dest / "titanlite" / "bench", dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__")
    )
    return dest


class Baseline:
    """A worker running ``python -m module *args`` (which make it serve, e.g. ``--serve``) against the titanlite
    of ``ref`` (in the extracted folder, so neither the checkout nor an installed titanlite comes first)."""

    def __init__(self, ref: str, module: str, args: list[str]):
        self.ref = ref
        self._tmp = tempfile.TemporaryDirectory(prefix="titanlite-baseline-")
        root = extract_package(ref, Path(self._tmp.name))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=root,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"error: the baseline worker ({self.ref}) exited with status {self.proc.wait()}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self._tmp.cleanup()


def caller(handle: Callable[[dict[str, Any]], dict[str, Any]], baseline: Baseline | None):
    """``call(request, mode)``: this titanlite's ``handle`` for its own modes, the worker's eager path for
    ``"baseline"``."""

    def call(request: dict[str, Any], mode: str) -> dict[str, Any]:
        if mode == "baseline":
            return baseline.call({**request, "mode": "eager"})
        return handle({**request, "mode": mode})

    return call


def serve(handle: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """The worker's loop: one JSON request per stdin line, one JSON answer per stdout line (other output
    goes to stderr, so it cannot break the protocol)."""
    out, sys.stdout = sys.stdout, sys.stderr
    for line in sys.stdin:
        out.write(json.dumps(handle(json.loads(line))) + "\n")
        out.flush()


def imported_from() -> str:
    """Where the titanlite this process runs comes from (to show which code a column measured)."""
    import titanlite

    return str(Path(titanlite.__file__).resolve().parent.parent)
