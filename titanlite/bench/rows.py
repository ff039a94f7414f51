"""Several ``titanlite bench train`` rows in one process, each appended to a JSON-lines file as it finishes.

Each row runs ``titanlite bench train`` with the common arguments and then its own, and its result is written as
one line with its ``"row"`` name, or ``{"row": ..., "error": ...}`` when it fails (the next row still runs). On a
GPU machine lent for minutes this is what makes the rows fit: the process starts, imports torch and initializes
CUDA once, and a row whose graphs another row already compiled (the same shapes with profiling, say) loads them
from inductor's caches. Between rows the compiled code is dropped (``torch._dynamo.reset``: every row compiles
its own blocks, never falling back to eager past Dynamo's recompile limit), memory is freed, the peak-memory
counter restarts and torch's deterministic-algorithms switch (``[training] deterministic``) is set back, so each
row measures what it would alone.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import sys
import traceback

import torch

from titanlite.errors import one_line

logger = logging.getLogger(__name__)
USAGE = "titanlite bench rows --jsonl PATH [--common ARGS...] --row NAME ARGS... [--row NAME ARGS...]"


def split_rows(argv: list[str]) -> tuple[str, list[tuple[str, list[str]]]]:
    """``(jsonl path, [(row name, its bench-train arguments)])`` from the command line (see the module docstring);
    ValueError for a line without ``--jsonl PATH`` or without a named row."""
    if len(argv) < 2 or argv[0] != "--jsonl":
        raise ValueError("expected --jsonl PATH first")
    path, rest, common, rows = argv[1], argv[2:], [], []
    if rest[:1] == ["--common"]:
        end = rest.index("--row") if "--row" in rest else len(rest)
        common, rest = rest[1:end], rest[end:]
    while rest:
        if rest[0] != "--row" or len(rest) < 2:
            raise ValueError(f"expected --row NAME ARGS..., got {' '.join(rest[:3])!r}")
        end = rest.index("--row", 2) if "--row" in rest[2:] else len(rest)
        rows.append((rest[1], common + rest[2:end]))
        rest = rest[end:]
    if not rows:
        raise ValueError("expected at least one --row NAME ARGS...")
    return path, rows


class _Tee(io.TextIOBase):
    """A text stream writing to ``stream`` and keeping what was written (a failed row's error line)."""

    def __init__(self, stream):
        self.stream, self.text = stream, []

    def write(self, text: str) -> int:
        self.text.append(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def run_row(argv: list[str]) -> dict:
    """One row's result, or ``{"error": one line}`` (the traceback of a bug goes to the log)."""
    from titanlite.bench import train

    stderr, deterministic = _Tee(sys.stderr), torch.are_deterministic_algorithms_enabled()
    try:
        with contextlib.redirect_stderr(stderr):
            return train.main(argv)
    except SystemExit as e:  # bad arguments or config: its one line is the last "error:" line on stderr
        errors = [line for line in "".join(stderr.text).splitlines() if line.startswith("error:")]
        return {"error": errors[-1] if errors else f"exit status {e.code}"}
    except Exception as e:  # an out-of-memory or compile failure of this row: the next rows still run
        logger.error("row failed:\n%s", traceback.format_exc())
        return {"error": one_line(e)}
    finally:
        release(deterministic)


def release(deterministic: bool = False) -> None:
    """Drop the row's compiled code and memory, restart the peak-memory counter and set torch's
    deterministic-algorithms switch back to ``deterministic``."""
    torch.use_deterministic_algorithms(deterministic)
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(f"usage: {USAGE}\n\n{__doc__.strip()}")
        sys.exit(0)
    try:
        path, rows = split_rows(argv)
    except ValueError as e:
        print(f"error: titanlite bench rows: {e}", file=sys.stderr)
        sys.exit(2)
    results = []
    for name, row_argv in rows:
        result = {"row": name, **run_row(row_argv)}
        with open(path, "a") as f:
            f.write(json.dumps(result) + "\n")
        print(f"row {name!r}: {'failed: ' + result['error'] if 'error' in result else 'done'}", file=sys.stderr)
        results.append(result)
    return results


if __name__ == "__main__":
    main()
