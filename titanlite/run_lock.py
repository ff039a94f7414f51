"""One run per dump folder: an exclusive lock on ``<dump_folder>/.titanlite.lock``.

A second run started in the same folder would clean up the first one's in-progress checkpoint saves
(the ``.partial`` folders it removes at start), interleave its metrics and overwrite ``config.toml``.
:class:`RunLock` takes a POSIX record lock (``fcntl.lockf``, non-blocking; also honoured over NFS)
on the lock file and writes who holds it. The kernel releases it when the process ends however it
ends (SIGKILL included), so a killed run never leaves a stale lock behind. POSIX locks belong to
the process, not to the descriptor: a second trainer built in the same process (a notebook cell run
again) takes it again instead of failing; but closing any descriptor of the file in that process
(an earlier trainer released or garbage-collected) releases the lock for the whole process, so
other processes could then take the folder while a later trainer of this one still trains. On a file
system without locks the run goes on with a warning. Under torchrun rank 0 holds it for the job.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import weakref
from pathlib import Path

logger = logging.getLogger("titanlite")

LOCK_FILE = ".titanlite.lock"


class RunLock:
    def __init__(self, folder: str | os.PathLike):
        self.folder, self.fd, self._close = Path(folder), None, None

    @property
    def path(self) -> Path:
        return self.folder / LOCK_FILE

    def acquire(self) -> RunLock:
        """Create the folder and lock it; ValueError (one line) when it cannot be a folder or another
        process holds it (named: host, pid, start time, command)."""
        import fcntl

        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise ValueError(f"job.dump_folder={self.folder}: it, or a folder above it, is a file") from None
        except OSError as e:
            raise ValueError(f"job.dump_folder={self.folder}: cannot create it ({e.strerror})") from None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: another process holds it
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "unknown process"
            os.close(fd)
            raise ValueError(
                f"job.dump_folder={self.folder} is in use by another run ({holder[:300]}); wait for it to end or "
                "choose another job.dump_folder"
            ) from None
        except OSError as e:  # no flock on this file system
            logger.warning(f"could not lock {self.path} ({e.strerror}); make sure no other run uses this folder")
            os.close(fd)
            return self
        now = datetime.datetime.now().isoformat(timespec="seconds")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {now}: {' '.join(sys.argv)}\n".encode(), 0)
        self.fd, self._close = fd, weakref.finalize(self, os.close, fd)  # released when dropped, too
        return self

    def release(self) -> None:
        if self._close is not None:
            self._close()  # closing the descriptor releases the lock
            self.fd = self._close = None
