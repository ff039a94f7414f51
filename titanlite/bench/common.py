"""What the benchmarks share: the common flags, device sync and name, timing loops, the training step's timer and
time split, results out (a JSON line, JSON lines, a JSON file) and ``bench train`` runs in fresh processes.

``bench generate`` and ``bench eval`` also time a ``reference`` worker running the same requests elsewhere
(:func:`serve`, their hidden ``--serve`` flag): the ``baseline`` mode, another git revision of titanlite under the
checkout's benchmarks/revision.py. That older titanlite may lack newer modules, so only the standard library and
torch are imported here at module level.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from titanlite.utils.dtypes import DTYPES

REPO = Path(__file__).resolve().parents[2]  # the checkout


def shared_data() -> Path:
    """The shared test data: ``$TITANLITE_SHARED_DATA``, else ``../shared/data`` beside the checkout."""
    return Path(os.environ.get("TITANLITE_SHARED_DATA") or REPO.parent / "shared" / "data")


def add_device_args(p: argparse.ArgumentParser, dtypes: Sequence[str] = (), default: str = "float32", help=None):
    """``--device`` (CUDA when visible), and ``--dtype`` of ``dtypes`` (default: every one titanlite names)."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(dtypes or DTYPES), default=default, help=help)


def add_flavor_args(p: argparse.ArgumentParser) -> None:
    """A Llama 3 flavor's shape: ``--flavor``, ``--n-layers``, ``--vocab-size`` (see :func:`flavor_args`)."""
    p.add_argument("--flavor", default="1B", help="llama3 flavor whose shape to build (debugmodel, 1B, 8B, ...)")
    p.add_argument("--n-layers", type=int, default=0, help="override the flavor's layer count (0: keep)")
    p.add_argument("--vocab-size", type=int, default=128256, help="vocabulary (Llama 3's 128256 by default)")


def flavor_args(a: argparse.Namespace):
    """``(spec, model_args)``: the llama3 flavor ``a.flavor`` with ``a.vocab_size`` and ``a.n_layers`` (when set)."""
    from titanlite.models import get_model_spec

    spec = get_model_spec("llama3")
    overrides = {"vocab_size": a.vocab_size} | ({"n_layers": a.n_layers} if a.n_layers else {})
    return spec, dataclasses.replace(spec.flavors[a.flavor], **overrides)


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA); nothing to wait for on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"


def peak_memory_gib(device: torch.device) -> float:
    """CUDA peak allocated memory, or the process's peak RSS on CPU (GiB)."""
    from titanlite.trainer.peaks import memory_stats

    mem = memory_stats(device)
    return mem.get("mem_peak_gib", mem.get("mem_peak_rss_gib"))


def seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of one ``fn()``, ``device`` synchronized before and after."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def best_seconds(fn: Callable[[], object], repeats: int = 3) -> float:
    """The fastest of ``repeats`` runs of ``fn()`` on CPU (the machine may be shared: the least disturbed one)."""
    return min(seconds(fn, torch.device("cpu")) for _ in range(repeats))


def mean_seconds(fn: Callable[[], object], steps: int, device: torch.device, warmup: int = 2) -> float:
    """Mean seconds of ``fn()`` over ``steps`` calls after ``warmup`` untimed ones, ``device`` synchronized."""
    for _ in range(warmup):
        fn()
    return seconds(lambda: [fn() for _ in range(steps)], device) / steps


def alternating(names: Sequence, repeats: int) -> Iterator[tuple[int, object]]:
    """``(repeat, name)``: every name once per repeat, the order reversed on every other repeat, so that side by
    side runs share a shared machine's drift."""
    for i in range(repeats):
        yield from ((i, name) for name in (names if i % 2 == 0 else names[::-1]))


def interleaved(modes: list[str], repeats: int, run: Callable[[str], object], warmup: Callable[[str], object]):
    """Per mode the results of ``run(mode)`` over ``repeats`` rounds, after one ``warmup(mode)`` each: every mode
    once per round, the order rotated by one each round (so the modes share the machine's load)."""
    for mode in modes:
        warmup(mode)
    results: dict[str, list] = {m: [] for m in modes}
    for r in range(repeats):
        k = r % len(modes)
        for mode in modes[k:] + modes[:k]:
            results[mode].append(run(mode))
    return results


def imported_from() -> str:
    """Where the titanlite this process runs comes from (to show which code a column measured)."""
    import titanlite

    return str(Path(titanlite.__file__).resolve().parent.parent)


def mode_caller(handle: Callable[[dict], dict], reference_worker=None) -> Callable[[dict, str], dict]:
    """``call(request, mode)``: this titanlite's ``handle`` for its own modes; for ``"baseline"``, the eager path
    of ``reference_worker`` (``call(request) -> result``: the same request timed in another process)."""

    def call(request: dict, mode: str) -> dict:
        if mode == "baseline":
            return reference_worker.call({**request, "mode": "eager"})
        return handle({**request, "mode": mode})

    return call


def serve(handle: Callable[[dict], dict]) -> None:
    """A reference worker's loop: one JSON request per stdin line, one JSON answer per stdout line (other
    output goes to stderr, so it cannot break the protocol)."""
    out, sys.stdout = sys.stdout, sys.stderr
    for line in sys.stdin:
        out.write(json.dumps(handle(json.loads(line))) + "\n")
        out.flush()


def busy_seconds(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Length of the union of ``(begin, end)`` intervals, clipped to ``[start, end]`` (overlaps counted once)."""
    total, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            total, reach = total + b - a, b
    return total


class StepTimer:
    """Accumulates named regions of the timed steps (after ``warmup`` steps); each region ends with a device sync,
    so its time lands where it is spent."""

    def __init__(self, device: torch.device, warmup: int, split: bool = True):
        self.device, self.warmup, self.split = device, warmup, split
        self.step = 0
        self.totals: dict[str, float] = defaultdict(float)
        self.start = None  # wall clock at the start of the first timed step

    @property
    def timing(self) -> bool:
        return self.step > self.warmup

    def begin_step(self) -> None:
        self.step += 1
        if self.step == self.warmup + 1:
            sync(self.device)
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            self.start = time.perf_counter()

    @contextlib.contextmanager
    def region(self, name: str):
        if not (self.timing and self.split):
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            sync(self.device)
            self.totals[name] += time.perf_counter() - t0

    def add(self, name: str, seconds: float) -> None:
        if self.timing:
            self.totals[name] += seconds

    def elapsed(self) -> float:
        sync(self.device)
        return time.perf_counter() - self.start

    def split_report(self, steps: int, step_s: float, keys: Sequence[str]) -> dict:
        """``time_split_s`` (per step; ``keys`` always present, the rest of the step as ``other``) and
        ``time_split_frac`` (of ``step_s``)."""
        split = {k: v / steps for k, v in self.totals.items()}
        for key in keys:
            split.setdefault(key, 0.0)
        split["other"] = max(0.0, step_s - sum(split.values()))
        return {"time_split_s": split, "time_split_frac": {k: v / step_s for k, v in split.items()}}


def write_json(path: str | os.PathLike, obj, indent: int | None = 1) -> None:
    """``obj`` as JSON to ``path`` (parent folders made; written whole or not at all)."""
    from titanlite.utils.fsio import atomic_write

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(obj, indent=indent) + "\n", fsync=False)


def emit(result: dict, json_out: str | None) -> dict:
    """Print ``result`` as one JSON line (and write it to ``json_out`` when given); returns it."""
    print(json.dumps(result), flush=True)
    if json_out:
        write_json(json_out, result, indent=None)
    return result


def append_jsonl(path: str | None, record: dict) -> None:
    """Append ``record`` as one JSON line to ``path`` (nothing without a path)."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def run_bench_train(
    argv: list[str], out: Path, timeout: float, what: str, nproc: int = 1, log: Path | None = None
) -> dict:
    """``bench train`` with ``argv`` in a fresh process (``nproc`` > 1: under ``torchrun --standalone``, the
    processes sharing this one's cores), writing its JSON line to ``out``: that result. Its output goes to ``log``
    (else it is kept only to report a failure). A failure, or a run past ``timeout`` seconds (killed with its
    workers), exits with one line naming ``what``."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc > 1 else []
    cmd = [sys.executable, *launcher, "-m", "titanlite.bench.train", "--json-out", str(out), *argv]
    env = None
    if nproc > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, cores // nproc)))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    from titanlite.config import exit_with_error

    with open(log, "w+") if log else tempfile.TemporaryFile("w+") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the run and its workers lead no other session
            proc.wait()
            exit_with_error(f"{what} took more than {timeout:g} s; " + (f"log: {log}" if log else "killed"), 1)
        if code != 0 or not out.exists():
            f.seek(0)
            where = f"log: {log}" if log else f.read()[-500:]
            exit_with_error(f"{what} failed (exit status {code}): {where}", 1)
    return json.loads(out.read_text())
