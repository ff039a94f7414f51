"""One run per folder: an exclusive lock on ``<folder>/.titanlite.lock`` (the dump folder, and the checkpoint
folder wherever it lives; docs/checkpoints.md, "One run per folder").

A second run in the folder would remove the first one's in-progress saves, interleave its metrics and purge or
move aside its checkpoints. :class:`RunLock` takes a non-blocking POSIX record lock (``fcntl.lockf``, also over
NFS) and writes who holds it; the kernel releases it when the process ends, however (SIGKILL included). Without
locks on the file system the run goes on with a warning; under torchrun rank 0 holds it. Closing *any* descriptor
of a file releases the process's POSIX lock, so each lock file is opened once per process (:data:`_HELD`, keyed by
device and inode): a second :class:`RunLock` on it shares the lock, released with the last one.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import weakref
from pathlib import Path

from titanlite.errors import ConfigError

logger = logging.getLogger("titanlite")

LOCK_FILE = ".titanlite.lock"

# (st_dev, st_ino) of a lock file this process holds -> [descriptor, holders]. Process-wide by nature: the kernel
# keeps POSIX locks per process, and this table mirrors that (it is not configuration).
_HELD: dict[tuple[int, int], list[int]] = {}


def _unhold(key: tuple[int, int]) -> None:
    entry = _HELD.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] <= 0:
        del _HELD[key]
        os.close(entry[0])  # closing the descriptor releases the lock


class RunLock:
    """``RunLock(folder, what)``: ``what`` names the folder's setting in errors (``job.dump_folder``,
    ``checkpoint.folder``)."""

    def __init__(self, folder: str | os.PathLike, what: str = "job.dump_folder"):
        self.folder, self.what, self.fd, self._close = Path(folder), what, None, None

    @property
    def path(self) -> Path:
        return self.folder / LOCK_FILE

    def acquire(self) -> RunLock:
        """Create the folder and lock it; ValueError (one line) when it cannot be a folder or another
        process holds it (named: host, pid, start time, command)."""
        import fcntl

        if self._close is not None:
            return self
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise ConfigError(f"{self.what}={self.folder}: it, or a folder above it, is a file") from None
        except OSError as e:
            raise ConfigError(f"{self.what}={self.folder}: cannot create it ({e.strerror})") from None
        try:
            st = os.stat(self.path)  # never open a file this process holds: closing that would release it
            key = (st.st_dev, st.st_ino)
        except FileNotFoundError:
            key = None
        if key in _HELD:
            _HELD[key][1] += 1
            self.fd, self._close = _HELD[key][0], weakref.finalize(self, _unhold, key)
            return self
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: another process holds it
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "unknown process"
            os.close(fd)
            raise ConfigError(
                f"{self.what}={self.folder} is in use by another run ({holder[:300]}); wait for it to end or "
                f"choose another {self.what}"
            ) from None
        except OSError as e:  # no flock on this file system
            logger.warning(f"could not lock {self.path} ({e.strerror}); make sure no other run uses this folder")
            os.close(fd)
            return self
        now = datetime.datetime.now().isoformat(timespec="seconds")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {now}: {' '.join(sys.argv)}\n".encode(), 0)
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        _HELD[key] = [fd, 1]
        self.fd, self._close = fd, weakref.finalize(self, _unhold, key)  # released when dropped, too
        return self

    def release(self) -> None:
        if self._close is not None:
            self._close()
            self.fd = self._close = None
