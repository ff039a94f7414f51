"""Run a test function in N processes, torchrun-style, under a hard timeout.

``run_workers(fn, nprocs, args)`` starts ``nprocs`` processes with torchrun's
variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), each calling ``fn(args)`` where ``fn``
is a module-level function of a test file; each rank's return value comes back (pickled) in a list
ordered by rank. A rank that fails makes the others be killed at once (they would otherwise wait
in a collective); if the whole launch exceeds ``timeout`` seconds every process group is killed and
the test fails with each rank's log tail, so a hang can never stall the suite. A launch's folder
(arguments, results, one log per rank) is removed once it succeeded.

Backends: tests are written once and parametrized with :func:`backends`: ``gloo`` (CPU; CUDA is
hidden from the workers so they build CPU meshes) everywhere, plus ``nccl`` where there are enough
GPUs. Workers run with ``OMP_NUM_THREADS=1``: several processes share the cores.

Launch: each rank is forked from a fork server (``multiprocessing``'s ``forkserver``, one per pytest
process) that has imported torch and titanlite once and measured the CPU matmul peak (with one thread;
it never made a thread), so a rank starts as a fresh process would, without paying ~2 s of CPU for the imports
and ~0.6 s for the measurement. NCCL ranks, ``spawn=True`` (what a process reads
only as it starts matters, e.g. ``MALLOC_*`` variables) and ``TITANLITE_TEST_LAUNCH=spawn`` start each rank as a
fresh interpreter instead. Either way a rank runs in its own session with ``faulthandler`` on, so a crash leaves its
stack in the log.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from titanlite.parallel.distributed import exit_skipping_finalization

REPO = Path(__file__).resolve().parents[2]


def backends(nprocs: int) -> list[str]:
    """``["gloo"]``, plus ``"nccl"`` when at least ``nprocs`` GPUs are visible."""
    out = ["gloo"]
    if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs:
        out.append("nccl")
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "<no log>"


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # each worker leads its own session/process group
            except ProcessLookupError:  # a forked rank killed before its os.setsid
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


# what nearly every rank imports; the fork server imports them once (in this order)
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "torch.distributed.pipelining",
    "titanlite.train",
    "tests.helpers.rank_warmup",
]


def fork_server() -> multiprocessing.context.BaseContext:
    """This process's fork server, started on first use with one intra-op thread (as the ranks run) and
    the repository importable."""
    ctx, server = multiprocessing.get_context("forkserver"), multiprocessing.forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is None:
        ctx.set_forkserver_preload(_PRELOAD)
        saved = dict(os.environ)
        os.environ.update(
            OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        )
        try:
            server.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return ctx


class _ForkedRank:
    """A rank forked from the fork server, with the part of ``subprocess.Popen``'s interface used here."""

    def __init__(self, env: dict, log: Path, argv: list[str], threads: int):
        self.process = fork_server().Process(target=_forked_main, args=(env, str(log), argv, threads))
        self.process.start()
        self.pid = self.process.pid

    def poll(self) -> int | None:
        return self.process.exitcode  # -N for a signal, like Popen's returncode

    returncode = property(poll)

    def wait(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)


def _forked_main(env: dict, log: str, argv: list[str], threads: int) -> None:
    """A forked rank: its own session, output to its log, the rank's environment, then the test's function."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO)
    sys.path.insert(0, str(REPO))
    torch.set_num_threads(threads)  # the fork server read OMP_NUM_THREADS when it started
    _worker_main(*argv)


def run_workers(
    fn: Callable[[dict], Any],
    nprocs: int,
    args: dict | None = None,
    *,
    backend: str = "gloo",
    timeout: float = 240.0,
    threads: int = 1,
    spawn: bool = False,
) -> list[Any]:
    """Run ``fn(args)`` on ``nprocs`` ranks; returns the per-rank results (see module docstring)."""
    module_file = Path(sys.modules[fn.__module__].__file__).resolve()
    work = Path(tempfile.mkdtemp(prefix="titanlite_dist_"))
    with open(work / "args.pkl", "wb") as f:
        pickle.dump(args or {}, f)
    port = _free_port()
    procs, logs = [], []
    for rank in range(nprocs):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(nprocs),
            LOCAL_WORLD_SIZE=str(nprocs),
            GROUP_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS=str(threads),
            TITANLITE_TEST_BACKEND=backend,
            PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        )
        if backend == "gloo":
            env["CUDA_VISIBLE_DEVICES"] = ""
        log = work / f"rank{rank}.log"
        logs.append(log)
        argv = [str(module_file), fn.__name__, str(work), fn.__module__]
        if not spawn and backend == "gloo" and os.environ.get("TITANLITE_TEST_LAUNCH", "fork") != "spawn":
            procs.append(_ForkedRank(env, log, argv, threads))
            continue
        with open(log, "w") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, *argv],
                    env=env,
                    cwd=str(REPO),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    deadline = time.monotonic() + timeout
    failed = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                _kill(procs)
                raise AssertionError(
                    f"{fn.__name__} on {nprocs} ranks ({backend}) timed out after {timeout:.0f} s (logs in {work}); "
                    + "".join(f"\n--- rank {r} log tail:\n{_tail(l)}" for r, l in enumerate(logs))
                )
            time.sleep(0.05)
    finally:
        _kill(procs)
    if failed is not None:
        code = procs[failed].returncode
        others = "".join(f"\n--- rank {r} log tail:\n{_tail(logs[r], 1000)}" for r in range(nprocs) if r != failed)
        raise AssertionError(
            f"{fn.__name__}: rank {failed} of {nprocs} ({backend}) exited with {code}"
            + (f" ({signal.Signals(-code).name})" if code < 0 else "")
            + f" (logs in {work}):\n{_tail(logs[failed], 6000)}{others}"
        )
    results = []
    for rank in range(nprocs):
        with open(work / f"result{rank}.pkl", "rb") as f:
            results.append(pickle.load(f))
    shutil.rmtree(work, ignore_errors=True)  # a failed launch keeps its folder (the logs)
    return results


TOKEN_CACHE = "TITANLITE_TEST_TOKEN_CACHE"  # a folder that lives as long as the pytest session (tests/conftest.py)


def cache_token_stores() -> None:
    """Tokenize each (dataset, split) once per process: tests build many Trainers on the same data. The embedded
    corpus (~1.3 CPU s to tokenize) once per pytest session: its tensor is saved in the session's ``TOKEN_CACHE``
    folder, which the ranks a test starts read."""
    import titanlite.data.recipe as recipe

    if getattr(recipe.load_token_store, "_cached", False):
        return
    original, cache = recipe.load_token_store, {}

    def cached(dataset, path, split, tokenizer):
        key = (dataset, path, split, getattr(tokenizer, "vocab_size", None), getattr(tokenizer, "path", None))
        if key not in cache:
            folder = os.environ.get(TOKEN_CACHE)
            if dataset != "embedded" or not folder or not os.path.isdir(folder):
                cache[key] = original(dataset, path, split, tokenizer)
            else:
                cache[key] = _session_cached(Path(folder), key, lambda: original(dataset, path, split, tokenizer))
        return cache[key]

    cached._cached = True
    recipe.load_token_store = cached


def _session_cached(folder: Path, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``make()``, saved in ``folder`` under a name of ``key`` the first time (written whole, then renamed)."""
    import hashlib

    file = folder / (hashlib.sha256(repr(key).encode()).hexdigest()[:24] + ".pt")
    if file.exists():
        return torch.load(file, weights_only=True)
    tensor = make()
    part = file.with_suffix(f".{os.getpid()}.part")
    torch.save(tensor, part)
    os.replace(part, file)
    return tensor


def _worker_main(module_file: str, fn_name: str, work: str, module_name: str) -> None:
    import torch.distributed as dist

    faulthandler.enable()  # a crash (SIGSEGV, SIGABRT) prints every thread's Python stack to the log

    # under the parent's module name (tests.<folder>.test_x), so what it pickles unpickles there
    spec = importlib.util.spec_from_file_location(module_name, module_file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    with open(Path(work) / "args.pkl", "rb") as f:
        args = pickle.load(f)
    result = getattr(module, fn_name)(args)
    rank = int(os.environ["RANK"])
    with open(Path(work) / f"result{rank}.pkl", "wb") as f:
        pickle.dump(result, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    exit_skipping_finalization(0)  # a gloo thread may abort a finishing rank (see there)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _worker_main(*sys.argv[1:5])
