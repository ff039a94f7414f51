"""SIGKILL at ten moments of a run with the NaN/spike guard on, then resume: bitwise the same run.

The reference is one uninterrupted 16-step run (asynchronous saves every 4 steps, ``keep_latest_k =
2``) under ``[guard] policy = skip_step`` with a NaN injected at step 6 and a spike test whose
verdict at step 16 depends on the guard's rolling window of the four steps before (so a resume that
lost the guard's state would not skip it). Each case kills a fresh process (``python -c`` driver)
at one moment: before the first checkpoint, during staging, while the data files are written, before
``.metadata``, during the checksums, before the rename, before and during the purge of old saves,
between saves, and after the last save. This process then reruns the same command; every logged
record (losses, grad norms, learning rates, tokens, guard events and counters) must equal the
reference's, and each step must appear once.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import titanlite.data.recipe as recipe
from tests.helpers.checkpoint_runs import TINY
from tests.helpers.dist import cache_token_stores
from tests.helpers.launch import run_python
from titanlite.checkpoint import layout
from titanlite.models import load_config
from titanlite.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
RUN = [
    "--training.steps",
    "16",
    "--checkpoint.interval",
    "4",
    "--checkpoint.keep_latest_k",
    "2",
    "--checkpoint.async_mode",
    "async",
    "--guard.policy",
    "skip_step",
    "--guard.debug_inject_nan_at_step",
    "6",
    "--guard.spike_factor",
    "1.05",
    "--guard.spike_window",
    "4",
    "--guard.spike_min_history",
    "4",
]
TIMING = {"tokens_per_s", "tokens_per_s_global", "mfu", "data_wait_frac", "eta_s"}

pytestmark = pytest.mark.usefixtures("one_thread")

# KILL names the moment; every patch kills the process with SIGKILL (nothing runs after it).
DRIVER = textwrap.dedent("""
    import os, signal, sys
    import torch
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.staging as staging
    import titanlite.checkpoint.layout as layout
    import titanlite.checkpoint.manager as manager
    import titanlite.trainer.metrics as metrics
    import titanlite.data.recipe as recipe
    import titanlite.train as train
    from titanlite.trainer.hooks import Hook
    from titanlite.models import load_config
    from titanlite.train import Trainer

    tokens = torch.load(os.environ["TOKENS_FILE"])
    recipe.load_token_store = lambda dataset, path, split, tokenizer: tokens
    metrics.peak_flops = lambda *a, **k: None
    moment, saves = os.environ["KILL"], []

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    def on_save(n, original):  # kill in the n-th call (1-based) of a function of the save path
        def wrapped(*args, **kwargs):
            saves.append(1)
            if len(saves) == n:
                die()
            return original(*args, **kwargs)
        return wrapped

    if moment == "staging":  # copying the step-8 state on the staging thread
        staging.DefaultStager._stage = on_save(2, staging.DefaultStager._stage)
    elif moment == "data_write":  # the step-8 data file half written
        original = fs._write_item
        def write_item(transforms, stream, data, write_item, storage_key, fmt):
            if "step-8.partial" in str(getattr(stream, "name", "")):
                saves.append(1)
                if len(saves) == 4:
                    stream.flush()
                    die()
            return original(transforms, stream, data, write_item, storage_key, fmt)
        fs._write_item = write_item
    elif moment == "before_metadata":  # every data file written, no .metadata yet
        fs.FileSystemWriter.finish = on_save(2, fs.FileSystemWriter.finish)
    elif moment == "checksums":  # .metadata written, the checksums being computed
        layout.file_checksums = on_save(2, layout.file_checksums)
    elif moment == "before_rename":  # checkpoint.json written, not renamed to step-8 yet
        layout.publish = on_save(2, layout.publish)
    elif moment == "before_purge":  # step-12 published, step-4 not purged yet
        manager.CheckpointManager._purge = on_save(3, manager.CheckpointManager._purge)
    elif moment == "during_purge":  # step-4 half deleted
        def remove(path):
            files = sorted(path.iterdir())
            files[0].unlink()
            die()
        layout.remove = remove
    elif moment == "after_last_save":  # step-16 saved and waited for
        close = manager.CheckpointManager.close
        def closed(self):
            close(self)
            die()
        manager.CheckpointManager.close = closed

    kill_at = {"before_first_checkpoint": 2, "between_saves": 10}.get(moment, 0)

    class Kill(Hook):
        def __init__(self, checkpointer):
            self.checkpointer = checkpointer

        def on_step_end(self, state, result):
            if state.step == kill_at:
                self.checkpointer.wait()  # step-8 complete: the resume must come from it
                die()

    class Killed(Trainer):
        def build_hooks(self):
            return [Kill(self.checkpointer)] + super().build_hooks()

    Killed(load_config(sys.argv[1:])).train()
""")

MOMENTS = [
    "before_first_checkpoint",
    "staging",
    "data_write",
    "before_metadata",
    "checksums",
    "before_rename",
    "before_purge",
    "during_purge",
    "between_saves",
    "after_last_save",
]


def records(dump: Path) -> list[dict]:
    lines = (dump / "metrics.jsonl").read_text().splitlines()
    return [
        {k: v for k, v in json.loads(line).items() if k not in TIMING and not k.startswith("mem")} for line in lines
    ]


def run_here(dump: Path) -> None:
    cache_token_stores()
    Trainer(load_config(TINY + RUN + ["--job.dump_folder", str(dump)])).train()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill_moments")
    run_here(root / "reference")
    recs = records(root / "reference")
    events = [(r["step"], r["guard_event"]) for r in recs if "guard_event" in r]
    assert events == [(6, "nonfinite"), (16, "spike")], events  # the spike needs the rolling window of 12..15
    cfg = load_config(TINY)
    from titanlite.models import get_model_spec

    tokenizer = get_model_spec(cfg.model.name).tokenizer_builder(cfg.model.tokenizer_path)
    torch.save(recipe.load_token_store("embedded", "", "train", tokenizer), root / "tokens.pt")
    return root, recs


@pytest.mark.parametrize("moment", MOMENTS)
def test_sigkill_at_any_moment_resumes_bitwise(moment, reference, tmp_path, caplog):
    root, expected = reference
    dump = tmp_path / "run"
    proc = run_python(
        [sys.executable, "-c", DRIVER, *TINY, *RUN, "--job.dump_folder", str(dump)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENS_FILE": str(root / "tokens.pt"), "KILL": moment},
        timeout=180,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-3000:] + proc.stderr[-3000:]
    with caplog.at_level(logging.INFO, logger="titanlite"):
        run_here(dump)
    if moment == "after_last_save":
        assert "the run is complete" in caplog.text
    got = records(dump)
    assert [r["step"] for r in got] == [r["step"] for r in expected]  # each step once (events: their own record)
    assert [json.dumps(r, sort_keys=True) for r in got] == [json.dumps(r, sort_keys=True) for r in expected]
    resumed = {"before_first_checkpoint": None, "after_last_save": None, "before_purge": 12, "during_purge": 12}
    step = resumed.get(moment, 8 if moment == "between_saves" else 4)
    assert step is None or f"RESUMED from {dump / 'checkpoint' / f'step-{step}'}" in caplog.text
    assert [f.step for f in layout.list_step_folders(dump / "checkpoint")] == [12, 16]
    assert not layout.list_partial_folders(dump / "checkpoint")
