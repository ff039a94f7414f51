"""A ``python`` for shell scripts that runs titanlite's command lines forked from the fork server.

tests/test_docs.py runs the documentation's shell blocks as written: each ``python -m titanlite.train ...`` is a
fresh interpreter that imports torch and titanlite again (several CPU-seconds, more than a tiny run's training).
:class:`WarmPython` writes a folder of executables to put first on ``PATH`` (and in place of a virtual
environment's ``bin/python``):

- ``python``: a command line that runs titanlite (``-m titanlite...``) or a
  ``.py`` script is sent, with the working folder, the environment and the script's stdin/stdout/stderr file
  descriptors, over a Unix socket to a thread of the pytest process, which runs it as
  :func:`tests.helpers.launch.run_python` does (a process forked from the fork server: its own session, the
  command's argv, environment and folder) but on the caller's own file descriptors, so pipes and redirections
  behave as with a fresh interpreter; the exit status comes back. Any other command line (``-m pip``, ``-c``,
  no arguments) ``exec``s the real interpreter.
- ``titanlite``: the console script, as ``python -m titanlite.cli``.

If the caller dies (a shell killed on a timeout), the forked command's session is killed.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import sys
import tempfile
import threading
from multiprocessing import reduction
from pathlib import Path

from tests.helpers.dist import fork_server
from tests.helpers.launch import _kill_session, _prepare_child, _status

SHIM = """#!{python} -S
import json, os, socket, sys
args = sys.argv[1:]
if {console}:
    args = ["-m", "titanlite.cli", *args]
module = args[1] if len(args) > 1 and args[0] == "-m" else ""
if not (module.startswith("titanlite") or (args and args[0].endswith(".py"))):
    os.execv({python!r}, [{python!r}, *args])
s = socket.socket(socket.AF_UNIX)
s.connect({socket!r})
socket.send_fds(s, [b"x"], [0, 1, 2])
s.sendall(json.dumps({{"args": args, "cwd": os.getcwd(), "env": dict(os.environ)}}).encode() + b"\\n")
reply = b""
while not reply.endswith(b"\\n"):
    chunk = s.recv(64)
    if not chunk:
        sys.exit(1)
    reply += chunk
sys.exit(int(reply))
"""


class WarmPython:
    """The executables (:attr:`bin`) and the thread that serves them; :meth:`close` stops it."""

    def __init__(self, python: str = sys.executable):
        self.folder = Path(tempfile.mkdtemp(prefix="titanlite_warm_"))
        self.bin = self.folder / "bin"
        self.bin.mkdir()
        self.path = str(self.folder / "socket")
        for name, console in (("python", False), ("titanlite", True)):
            shim = self.bin / name
            shim.write_text(SHIM.format(python=python, console=console, socket=self.path))
            shim.chmod(0o755)
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(self.path)
        self.listener.listen(8)
        fork_server()  # started here, in the main thread
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        with conn:
            _, fds, _, _ = socket.recv_fds(conn, 1, 3)
            data = b""
            while not data.endswith(b"\n"):
                data += conn.recv(1 << 16)
            request = json.loads(data)
            process = fork_server().Process(
                target=_child, args=(request["args"], request["cwd"], request["env"], [_Fd(fd) for fd in fds])
            )
            process.start()
            for fd in fds:
                os.close(fd)
            while process.exitcode is None:
                process.join(0.2)
                if process.exitcode is None and select.select([conn], [], [], 0)[0] and not conn.recv(1):
                    _kill_session(process.pid)  # the caller is gone
            code = process.exitcode
            try:
                conn.sendall(f"{code if code >= 0 else 128 - code}\n".encode())
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()
        shutil.rmtree(self.folder, ignore_errors=True)


class _Fd:
    """A file descriptor that a forked process receives as its own (multiprocessing passes it over)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


def _child(args: list[str], cwd: str, env: dict, fds: list[int]) -> None:
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # multiprocessing gave the child /dev/null
    _prepare_child(cwd, env)
    os._exit(_status(args))
