"""SIGTERM/SIGINT: finish the step, checkpoint, exit 0; resume reproduces the uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tiny import TINY_MODEL

from titanlite.preemption import PreemptionHandler

REPO = Path(__file__).resolve().parents[1]
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
    ref = subprocess.Popen(
        _cmd(tmp_path / "ref"), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
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
    assert [p.name for p in ckpt.iterdir()] == [f"step-{stopped}"]  # complete, no partial folder
    assert (ckpt / f"step-{stopped}" / ".metadata").exists()

    resumed = subprocess.run(
        _cmd(run_dir, "--checkpoint.enable", "true"), cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"RESUMED from {ckpt / f'step-{stopped}'}" in resumed.stdout + resumed.stderr
    ref_out, _ = ref.communicate(timeout=180)
    assert ref.returncode == 0, ref_out[-3000:]
    expected = _losses(tmp_path / "ref")
    got = _losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == expected  # bit-identical to the uninterrupted run


def test_stop_request_without_checkpointing_returns_cleanly(tmp_path, caplog):
    """In-process: a stop request after step 2 ends train() normally (no checkpoint to write)."""
    import logging

    from titanlite.hooks import Hook
    from titanlite.models import load_config
    from titanlite.train import Trainer

    class StopAfter2(Trainer):
        def build_hooks(self):
            handler = self.preemption

            class Signal(Hook):
                def before_update(self, state, result):
                    if result.step == 2:  # the request arrives during step 2
                        handler.requested, handler.signal_name = True, "SIGINT"

            return [Signal()] + super().build_hooks()

    t = StopAfter2(load_config(TINY + ["--job.dump_folder", str(tmp_path)]))
    with caplog.at_level(logging.INFO, logger="titanlite"):
        records = t.train()
    assert t.state.step == 2 and [r["step"] for r in records] == [1, 2]
    assert "stopped after step 2 of 40 on SIGINT; checkpointing is off" in caplog.text
    assert "run summary: 2 steps" in caplog.text
