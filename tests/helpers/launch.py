"""``python <args>`` as a test runs it, without paying for the interpreter's imports every time.

:func:`run_python` is ``subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)`` for a
command line (``-m titanlite.train ...``, ``script.py ...``, ``-c code ...``), run in a process forked from the
fork server of :mod:`tests.helpers.dist`, which has imported torch and titanlite but run nothing: each
launch saves the ~3 CPU-seconds those imports cost, which dominate a command that stops at a config error.

The child is what ``python`` would be, except for the modules already imported: its own session, the given
environment (``PYTHONPATH`` entries go to ``sys.path``), working folder and ``sys.argv``; stdout and stderr go to
files that come back as text; an uncaught exception prints its traceback and exits 1, ``SystemExit`` gives its
status. A test about what a *fresh* interpreter imports (registries, layering) uses ``subprocess`` itself.
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

from tests.helpers.dist import REPO, fork_server


def run_python(
    cmd: list[str], *, cwd: str | os.PathLike | None = None, env: dict | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    """Run the command line ``cmd`` (``[sys.executable, *args]``, see the module docstring); raises
    ``subprocess.TimeoutExpired`` after ``timeout`` s."""
    assert cmd[0] == sys.executable, f"run_python runs this interpreter's command lines, not {cmd[0]!r}"
    args = [str(a) for a in cmd[1:]]
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="titanlite_run_") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        process = fork_server().Process(
            target=_child, args=(list(args), str(cwd or os.getcwd()), env, str(out), str(err))
        )
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            _kill_session(process.pid)
            process.join(10)
            raise subprocess.TimeoutExpired(cmd, timeout, out.read_text(), err.read_text())
        code = process.exitcode
        return subprocess.CompletedProcess(cmd, code, out.read_text(), err.read_text())


def start_python(cmd: list[str], *, cwd: str | os.PathLike | None = None, env: dict | None = None):
    """``cmd`` as :func:`run_python` runs it, output discarded, not waited for: the returned process's
    ``exitcode`` is None while it runs; :func:`kill_python` ends it."""
    assert cmd[0] == sys.executable, f"start_python runs this interpreter's command lines, not {cmd[0]!r}"
    env = dict(os.environ if env is None else env)
    args = [str(a) for a in cmd[1:]]
    process = fork_server().Process(target=_child, args=(args, str(cwd or os.getcwd()), env, os.devnull, os.devnull))
    process.start()
    return process


def kill_python(process) -> None:
    """SIGKILL a :func:`start_python` process (its whole session) and reap it."""
    _kill_session(process.pid)
    process.join(30)


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _child(args: list[str], cwd: str, env: dict, out: str, err: str) -> None:
    os.setsid()
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    _prepare_child(cwd, env)
    os._exit(_status(args))


def _prepare_child(cwd: str, env: dict) -> None:
    """The forked child's environment, working folder, threads and ``sys.path``, as ``python`` would have them."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    faulthandler.enable()
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or 1))
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [*extra, str(REPO)]


def _status(args: list[str]) -> int:
    """Run the command line as ``python`` would and return its exit status."""
    warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package", category=RuntimeWarning)
    try:
        if args[0] in ("-m", "-c"):
            sys.path.insert(0, os.getcwd())  # as python puts the working folder first for -m and -c
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = list(args)
            sys.path.insert(0, str(Path(args[0]).resolve().parent))
            runpy.run_path(args[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _exit_code(code) -> int:
    """``SystemExit``'s status as the interpreter turns it into one: None is 0, a message is printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
