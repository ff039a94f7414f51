"""``python -m titanlite.checkpoint.seal STEP_FOLDER [STEP_FOLDER ...] [--record-files]``: upgrade checkpoints
written by an earlier titanlite, whose ``checkpoint.json`` (format version 1) carries no checksum of its own.

titanlite now refuses such a checkpoint (an edit of its model args or of its file checksums would go unnoticed,
:func:`~titanlite.checkpoint.layout.read_info`) rather than load it unchecked. Sealing is the explicit step that
says "I trust this description": each folder's files are first verified against the size and CRC-32 its
``checkpoint.json`` recorded at save, then the file is rewritten in the current format with its SHA-256. A
description that records no file checksums (older still) is refused unless ``--record-files`` is given, which
records the files as they are now. A folder already in the current format is left alone when intact; one whose
checksum fails (edited after the save) is refused: sealing never blesses an edit.

Each refusal is one ``error:`` line naming the folder; the exit status is 2 when any folder was refused.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from titanlite.checkpoint import layout
from titanlite.fsio import one_line


def seal(path: str | Path, record_files: bool = False) -> str:
    """Seal one step folder (see the module docstring); returns what was done, ValueError (one line) otherwise."""
    path = Path(path)
    file, info = path / layout.INFO_FILE, layout.read_info(path, verify=False)
    if info.get("version") == layout.FORMAT_VERSION:
        layout.read_info(path)  # intact, or the error saying it was edited
        return f"{path}: already in format version {layout.FORMAT_VERSION}, left as it is"
    if info.get("version") != 1:
        raise ValueError(f"{file} has format version {info.get('version')!r}: only version 1 is sealed")
    files = info.get("files")
    if files:
        if problem := layout.checksum_problem(path, files):
            raise ValueError(f"{path}: {problem}; not sealed")
        how = "its files match the checksums recorded at save"
    elif record_files:
        files, how = layout.file_checksums(path), "its files' checksums recorded as they are now (--record-files)"
    else:
        raise ValueError(
            f"{file} records no checksums of its files, so they cannot be checked; pass --record-files to record "
            "them as they are now, if you trust them"
        )
    layout.write_info(path, {**info, "files": files})
    return f"{path}: sealed ({how})"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m titanlite.checkpoint.seal", description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", metavar="STEP_FOLDER", help="checkpoint step folders (step-N)")
    p.add_argument("--record-files", action="store_true", help="record the files' checksums as they are now")
    a = p.parse_args(argv)
    status = 0
    for folder in a.folders:
        try:
            print(seal(folder, a.record_files))
        except ValueError as e:
            print(f"error: {one_line(e)}", file=sys.stderr)
            status = 2
    return status


if __name__ == "__main__":
    raise SystemExit(main())
