"""Time another git revision of titanlite side by side with this checkout, in the same benchmark run.

    python -m benchmarks.revision generate --baseline REF [titanlite bench generate options]
    python -m benchmarks.revision eval --baseline REF [titanlite bench eval options]

Development only: it reads this checkout's git history, which an installed titanlite does not have. The
``titanlite`` package of revision ``REF`` is extracted (``git archive``, nothing checked out or registered) into a
temporary folder, with this checkout's ``titanlite/bench`` copied into it, and a worker process runs the benchmark
module there with ``--serve``: it imports the old package (first on ``PYTHONPATH``) and answers one JSON request
per line on stdin with one JSON line on stdout. The benchmark interleaves the worker's timings (its ``baseline``
mode: REF's eager path) with its own, round by round, so both see the same machine load. The measuring code must
therefore only use what both versions have (titanlite/bench/common.py).
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]  # the checkout (git archive needs one)
BENCHMARKS = {"generate": "titanlite.bench.generate", "eval": "titanlite.bench.eval"}


def check_revision(ref: str) -> None:
    """A one-line error (exit status 1) unless ``ref`` names a commit of this checkout, before anything is built."""
    try:
        proc = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"], capture_output=True
        )
    except OSError as e:
        raise SystemExit(f"error: --baseline {ref}: git cannot run: {e}") from None
    if proc.returncode:
        raise SystemExit(f"error: --baseline {ref}: not a commit of the checkout {REPO}")


def extract_package(ref: str, dest: Path) -> Path:
    """``titanlite/`` of git revision ``ref`` written under ``dest``, with this checkout's benchmarks as its
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
    shutil.copytree(
        REPO / "titanlite" / "bench",
        dest / "titanlite" / "bench",
        dirs_exist_ok=True,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return dest


class Worker:
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


class Revision:
    """The ``reference`` a benchmark's ``main`` takes: ``ref`` names it in the output, ``start`` runs a worker."""

    def __init__(self, ref: str):
        self.ref = ref

    def start(self, module: str, args: list[str]) -> Worker:
        return Worker(self.ref, module, args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.revision",
        description=__doc__.split("\n\n")[0],
        epilog="Every other option is the benchmark's own: titanlite bench <benchmark> --help.",
    )
    p.add_argument("benchmark", choices=sorted(BENCHMARKS))
    p.add_argument("--baseline", metavar="REF", required=True, help="git revision of titanlite to time alongside")
    a, rest = p.parse_known_args(argv)
    check_revision(a.baseline)
    benchmark = importlib.import_module(BENCHMARKS[a.benchmark])
    return benchmark.main(rest, reference=Revision(a.baseline)) or 0


if __name__ == "__main__":
    sys.exit(main())
