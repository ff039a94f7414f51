"""Small file-system and message helpers shared across titanlite (a leaf: imports only titanlite.errors).

- :func:`atomic_write`: a file that holds the old content or the new one, never a part of the new one.
- :func:`atomic_dir`: a folder built under a temporary name and renamed into place when complete.
- :func:`fsync_dir`: make a rename in a folder durable (best effort).
- :func:`append_line`: a line appended to a log file and fsynced.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from titanlite.errors import UsageError, UserError

PathLike = str | os.PathLike


def fsync_dir(path: PathLike) -> None:
    """fsync a folder (so the renames in it survive a crash); best effort: some file systems refuse to open or
    fsync a folder. Works on a file too."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def append_line(path: PathLike, line: str | bytes) -> None:
    """Append ``line`` and a newline to ``path`` and fsync it. A last line torn by a crash (the file does not end
    in a newline) is ended first, so it stays one unreadable line instead of spoiling this one."""
    data = line.encode() if isinstance(line, str) else line
    with open(path, "ab+") as f:
        end = f.seek(0, os.SEEK_END)
        torn = end > 0 and (f.seek(end - 1), f.read(1))[1] != b"\n"
        f.write(b"\n" * torn + data + b"\n")
        f.flush()
        os.fsync(f.fileno())


def atomic_write(
    path: PathLike,
    data: str | bytes | Iterable[bytes],
    *,
    fsync: bool = True,
    hidden_tmp: bool = False,
    before_rename: Callable[[], None] | None = None,
) -> None:
    """Write ``data`` (text as UTF-8, bytes, or byte chunks) to a temporary file beside ``path``, then rename it
    over ``path``: ``path`` holds its old content or the whole new one. The temporary file is ``<name>.tmp``
    (``.<name>.tmp`` with ``hidden_tmp``), fsynced first unless ``fsync=False``. ``before_rename`` runs between
    the fsync and the rename. On an error the temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp" if hidden_tmp else f"{path.name}.tmp")
    chunks = [data.encode("utf-8")] if isinstance(data, str) else [data] if isinstance(data, bytes) else data
    try:
        with open(tmp, "wb") as f:
            f.writelines(chunks)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(out_dir: PathLike) -> Iterator[Path]:
    """Yields ``<out_dir>.partial-<token>`` to fill, renamed to ``out_dir`` when the block ends; on any error the
    partial folder and the parents this call created are removed. ``out_dir`` must not exist or be empty; a link to
    an empty folder stands for it (the link then shows the result), a dangling one is refused. Refusals, a folder
    that cannot be created and a full disk are one-line user errors, with nothing touched."""
    out_dir = _output_folder(Path(out_dir))
    created = [p for p in reversed(out_dir.parents) if not p.exists()]
    partial = out_dir.with_name(f"{out_dir.name}.partial-{secrets.token_hex(4)}")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        partial.mkdir()
    except OSError as e:  # a read-only or foreign folder on the way
        raise UsageError(f"output {out_dir}: cannot create it ({e.strerror or e})") from None
    try:
        yield partial
        os.rename(partial, out_dir)  # replaces an empty folder in one step (POSIX rename)
    except BaseException as e:
        shutil.rmtree(partial, ignore_errors=True)
        for folder in reversed(created):
            with contextlib.suppress(OSError):  # only while empty: something else may have appeared
                folder.rmdir()
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):  # the user's disk, not a bug
            raise UserError(f"disk full: could not write {out_dir} (nothing was written)") from e
        raise
    fsync_dir(out_dir.parent)


def _output_folder(out_dir: Path) -> Path:
    """The folder :func:`atomic_dir` publishes to for ``out_dir`` (the target of a link); UsageError unless it is
    absent or an empty folder."""
    given = out_dir
    if out_dir.is_symlink():
        if not out_dir.exists():  # a dangling link, or a loop of links
            raise UsageError(
                f"output {out_dir} is a symbolic link to {os.readlink(out_dir)}, which does not exist: create that "
                "folder or remove the link (nothing was written)"
            )
        out_dir = out_dir.resolve()
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        link = f" (a link to {out_dir})" if out_dir != given else ""
        raise UsageError(f"output {given}{link} already exists and is not empty (nothing was overwritten)")
    return out_dir


__all__ = ["append_line", "atomic_dir", "atomic_write", "fsync_dir"]
