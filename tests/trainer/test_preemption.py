"""SIGTERM/SIGINT: finish the step, checkpoint, exit 0 (128 + signal when nothing was saved); resume reproduces
the uninterrupted run; what torchrun does with the signal."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.launch import run_python
from tests.helpers.tiny import TINY_MODEL
from titanlite.trainer.preemption import REPEAT_WINDOW_S, PreemptionHandler
from titanlite.utils.run_lock import LOCK_FILE

REPO = Path(__file__).resolve().parents[2]
STEPS = 40
TINY = [
    *TINY_MODEL,
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--metrics.log_freq",
    "1",
    "--training.steps",
    str(STEPS),
    "--lr_scheduler.warmup_steps",
    "2",
    "--training.seed",
    "5",
    "--checkpoint.interval",
    "1000",
]


def test_first_signal_requests_stop_second_exits_at_once():
    exits = []
    handler = PreemptionHandler(exit_fn=exits.append)
    previous = signal.getsignal(signal.SIGTERM)
    with handler:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the Python-level handler runs at the next bytecode boundary
        assert handler.requested and handler.signal_name == "SIGTERM" and exits == []
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert exits == [128 + signal.SIGINT]
    assert signal.getsignal(signal.SIGTERM) is previous  # restored on exit


def _cmd(folder: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "titanlite.train", *TINY, "--job.dump_folder", str(folder), *extra]


def _losses(folder: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            assert r["step"] not in out, f"step {r['step']} logged twice"
            out[r["step"]] = r["loss"]
    return out


def _last_step(path: Path) -> int:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [json.loads(x).get("step", 0) for x in lines if x.endswith("}")]
    return max(steps, default=0)


def test_sigterm_checkpoints_exits_0_and_resume_is_exact(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run_dir = tmp_path / "run"
    run = subprocess.Popen(
        _cmd(run_dir, "--checkpoint.enable", "true"),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while _last_step(run_dir / "metrics.jsonl") < 3:
            assert run.poll() is None, run.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the run did not reach step 3"
            time.sleep(0.02)
        run.send_signal(signal.SIGTERM)
        out, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, out[-3000:]
    assert "received SIGTERM" in out and "preemption: stopped after step" in out, out[-3000:]
    stopped = int(out.split("preemption: stopped after step ")[1].split()[0])
    assert 3 <= stopped < STEPS
    ckpt = run_dir / "checkpoint"
    assert [p.name for p in ckpt.iterdir() if p.name != LOCK_FILE] == [f"step-{stopped}"]  # complete, no partial folder
    assert (ckpt / f"step-{stopped}" / ".metadata").exists()

    resumed = run_python(_cmd(run_dir, "--checkpoint.enable", "true"), cwd=REPO, env=env, timeout=180)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"RESUMED from {ckpt / f'step-{stopped}'}" in resumed.stdout + resumed.stderr
    ref = run_python(_cmd(tmp_path / "ref"), cwd=REPO, env=env, timeout=180)  # the uninterrupted run
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    expected = _losses(tmp_path / "ref")
    got = _losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == expected  # bit-identical to the uninterrupted run


def test_stop_request_without_checkpointing_returns_cleanly(tmp_path, caplog):
    """In-process: a stop request after step 2 ends train() normally (no checkpoint to write)."""
    import logging

    from titanlite.models import load_config
    from titanlite.trainer import Trainer
    from titanlite.trainer.hooks import Hook

    class StopAfter2(Trainer):
        def build_hooks(self):
            handler = self.preemption

            class Signal(Hook):
                def on_step_end(self, state, result):
                    if result.step == 1:  # the request arrives before step 2's reduction, which agrees on it
                        handler.request(signal.SIGINT)

            return [Signal()] + super().build_hooks()

    t = StopAfter2(load_config(TINY + ["--job.dump_folder", str(tmp_path)]))
    with caplog.at_level(logging.INFO, logger="titanlite"):
        records = t.train()
    assert t.state.step == 2 and [r["step"] for r in records] == [1, 2]
    assert "stopped after step 2 of 40 on SIGINT; checkpointing is off" in caplog.text
    assert "run summary: 2 steps" in caplog.text
    assert t.preemption.exit_status() == 128 + signal.SIGINT  # nothing to resume from: not a success


def test_same_signal_again_soon_is_the_same_request():
    """A repeat of the first signal within REPEAT_WINDOW_S (torchrun forwarding the SIGTERM a scheduler also
    sent the worker) does not exit; after the window, or a different signal, does."""
    exits, now = [], [100.0]
    handler = PreemptionHandler(exit_fn=exits.append, clock=lambda: now[0])
    with handler:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        now[0] += REPEAT_WINDOW_S - 0.5
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert handler.requested and handler.signum == signal.SIGTERM and exits == []
        now[0] += 1.0  # past the window: a real second request
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert exits == [128 + signal.SIGTERM]


def _wait_for_step(proc: subprocess.Popen, metrics: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while _last_step(metrics) < step:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"the run did not reach step {step}"
        time.sleep(0.02)


def test_sigterm_without_checkpointing_exits_128_plus_signal(tmp_path):
    """Checkpointing off: nothing to resume from, so the command must not exit 0 (a scheduler would record the
    preempted job as finished): 143 = 128 + SIGTERM, the shell's convention."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.Popen(
        _cmd(tmp_path), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait_for_step(run, tmp_path / "metrics.jsonl", 3)
        run.send_signal(signal.SIGTERM)
        out, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 128 + signal.SIGTERM == 143, out[-3000:]
    assert (
        "checkpointing is off ([checkpoint] enable = false): nothing was saved; the command exits with status 143"
        in out
    )
    assert not (tmp_path / "checkpoint").exists()


def test_failed_checkpoint_on_stop_exits_128_plus_signal(tmp_path, caplog):
    """The stopped step's checkpoint fails: logged, the earlier checkpoint is intact, and main() exits 143."""
    import errno
    import logging

    from titanlite.train import main
    from titanlite.trainer import Trainer
    from titanlite.trainer.hooks import Hook

    class StopAt3SaveFails(Trainer):
        def build_hooks(self):
            handler, ckpt = self.preemption, self.checkpointer
            interval_save = ckpt.save

            def save(step, **kw):
                if kw.get("force"):  # the preemption save
                    raise OSError(errno.EIO, "Input/output error")
                return interval_save(step, **kw)

            ckpt.save = save

            class Signal(Hook):
                def on_step_end(self, state, result):
                    if result.step == 2:  # before step 3's reduction: the run stops after step 3
                        handler.request(signal.SIGTERM)

            return [Signal()] + super().build_hooks()

    args = TINY + ["--job.dump_folder", str(tmp_path), "--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    with caplog.at_level(logging.INFO, logger="titanlite"), pytest.raises(SystemExit) as stopped:
        main(args, trainer_cls=StopAt3SaveFails)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert "the checkpoint of step 3 failed: OSError: [Errno 5] Input/output error" in caplog.text
    assert "stopped after step 3 of 40 on SIGTERM; the checkpoint of step 3 failed (OSError)" in caplog.text
    assert [p.name for p in (tmp_path / "checkpoint").iterdir() if p.name != LOCK_FILE] == ["step-2"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # main() restored the handlers


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (torchrun's workers), from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _kill_tree(pids: list[int]) -> None:
    for pid in pids:  # torchrun and each worker lead their own process groups
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.mark.multiprocess
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds torchrun's workers through /proc")
@pytest.mark.parametrize(
    "target, torchrun_status",
    [
        ("all", 1),  # the scheduler signals every process (Slurm): torchrun forwards it too, then exits 1
        ("workers", 0),  # only the workers are signalled: torchrun sees them all succeed
    ],
)
def test_torchrun_sigterm(tmp_path, target, torchrun_status):
    """What a scheduler sees under ``torchrun --nproc-per-node 2`` (README, Preemption): a SIGTERM that reaches
    torchrun makes it exit 1 (its SignalException) even though both workers saved the stopped step; signalling
    the workers alone gives torchrun's exit 0 when they saved. (With nothing to save a worker exits 128 + 15,
    test_sigterm_without_checkpointing_exits_128_plus_signal, and torchrun reports any non-zero exit as a
    failure.)"""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "titanlite.train", *TINY]
    cmd += ["--job.dump_folder", str(tmp_path), "--checkpoint.enable", "true"]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    workers: list[int] = []
    try:
        _wait_for_step(proc, tmp_path / "metrics.jsonl", 3)
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        for pid in workers + ([proc.pid] if target == "all" else []):
            os.kill(pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        _kill_tree([proc.pid, *workers])
        proc.wait(timeout=30)
    assert proc.returncode == torchrun_status, out[-4000:]
    assert ("SignalException" in out) == (target == "all"), out[-4000:]
    assert "second signal" not in out  # torchrun's forwarded copy did not make the workers exit at once
    stops = [line.split("stopped after step ")[1] for line in out.splitlines() if "stopped after step" in line]
    assert len(stops) == 2 and stops[0] == stops[1], out[-4000:]  # both ranks stopped after the same step
    step = int(stops[0].split()[0])
    ckpt = tmp_path / "checkpoint"
    assert [p.name for p in ckpt.iterdir() if p.name != LOCK_FILE] == [f"step-{step}"]
    assert (ckpt / f"step-{step}" / ".metadata").exists()
