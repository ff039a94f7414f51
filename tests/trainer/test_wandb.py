"""Optional Weights & Biases logging (``[metrics] enable_wandb``, titanlite.trainer.wandb_logger).

- With a recording stand-in for the ``wandb`` module: a short run gives W&B exactly the numbers
  metrics.jsonl holds (so the same scalars TensorBoard gets), the samples as a table, the eval scores;
  a resumed run continues the same W&B run id; ranks other than 0 start no run; without the package
  the run stops with one line naming the extra, and nothing is trained.
- With the real package (when the test extra installed it), offline (``WANDB_MODE=offline``): a run and
  its resume write one offline W&B run whose id is the one kept in the dump folder.
"""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import pytest

from tests.helpers.tiny import TINY_MODEL
from titanlite.models import load_config
from titanlite.train import main
from titanlite.trainer import Trainer
from titanlite.trainer.metrics_log import MetricsLogger
from titanlite.trainer.wandb_logger import RUN_ID_FILE

REPO = Path(__file__).resolve().parents[2]
EVAL_DATA = REPO.parent / "shared" / "data" / "eval"


class FakeRun:
    def __init__(self, calls: dict, **kwargs):
        self.calls, self.id = calls, kwargs["id"]
        calls["init"].append(kwargs)

    def define_metric(self, name: str, **kwargs) -> None:
        self.calls["define_metric"].append((name, kwargs))

    def log(self, data: dict) -> None:
        self.calls["log"].append(data)

    def finish(self) -> None:
        self.calls["finish"] += 1


class FakeTable:
    def __init__(self, columns: list, data: list):
        self.columns, self.data = columns, data


@pytest.fixture
def fake_wandb(monkeypatch) -> dict:
    """A ``wandb`` module that records what it is given."""
    calls: dict = {"init": [], "define_metric": [], "log": [], "finish": 0}
    module = types.ModuleType("wandb")
    module.init = lambda **kwargs: FakeRun(calls, **kwargs)
    module.Table = FakeTable
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def argv(dump: Path, steps: int, *extra: str) -> list[str]:
    run = ["--config", str(REPO / "train_configs/debug_model.toml"), *TINY_MODEL, "--training.seq_len", "32"]
    run += ["--training.local_batch_size", "2", "--training.global_batch_size", "2", "--training.steps", str(steps)]
    run += ["--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1", "--validation.freq", "2"]
    run += ["--metrics.enable_wandb", "--metrics.wandb_project", "p", "--metrics.wandb_mode", "offline"]
    run += ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.last_save_model_only", "false"]
    run += ["--job.dump_folder", str(dump)]
    return [*run, *extra]


def numbers(record: dict) -> dict:
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def test_wandb_gets_the_logged_scalars_samples_and_scores_and_a_resume_continues_the_run(tmp_path, fake_wandb):
    extra = ["--sampling.enable", "--sampling.freq", "2", "--sampling.max_new_tokens", "4"]
    if EVAL_DATA.is_dir():
        extra += ["--eval.enable", "--eval.data_dir", str(EVAL_DATA), "--eval.tasks", "piqa", "--eval.limit", "2"]
        extra += ["--eval.freq", "2"]
    Trainer(load_config(argv(tmp_path, 2, *extra))).train()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    run_id = (tmp_path / RUN_ID_FILE).read_text().strip()
    (init,) = fake_wandb["init"]
    assert init["id"] == run_id and init["resume"] == "allow" and init["mode"] == "offline"
    assert init["project"] == "p" and init["dir"] == str(tmp_path) and init["config"]["training"]["steps"] == 2
    assert ("*", {"step_metric": "step"}) in fake_wandb["define_metric"]  # the training step is the x-axis
    logged = list(fake_wandb["log"])
    assert [numbers(d) for d in logged] == [numbers(r) for r in records]  # every number, the same values
    assert any("val_loss" in d for d in logged) and any("loss" in d for d in logged)
    (table,) = [d["samples"] for d in logged if "samples" in d]
    assert table.columns == ["step", "prompt", "completion"] and len(table.data) == 2 and table.data[0][0] == 2
    if EVAL_DATA.is_dir():
        assert any("eval/piqa/acc" in d for d in logged)
    assert fake_wandb["finish"] == 1

    Trainer(load_config(argv(tmp_path, 4))).train()  # resumes from step 2
    assert [i["id"] for i in fake_wandb["init"]] == [run_id, run_id]
    assert [d["step"] for d in fake_wandb["log"][len(logged) :] if "loss" in d] == [3, 4]


def test_only_rank_0_starts_a_run(tmp_path, fake_wandb):
    section = load_config(["--metrics.enable_wandb"]).metrics
    MetricsLogger(section, tmp_path, rank=1).log({"step": 1, "loss": 2.0})
    assert fake_wandb["init"] == [] and not (tmp_path / RUN_ID_FILE).exists()


def test_without_the_package_the_run_stops_in_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(SystemExit) as e:
        main(argv(tmp_path, 2))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'titanlite[wandb]'" in err[0] and "metrics.enable_wandb" in err[0]
    assert not (tmp_path / "checkpoint").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_the_real_package_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb (the optional extra titanlite[wandb]) is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    short = ["--checkpoint.interval", "1", "--validation.enable", "false"]
    Trainer(load_config(argv(tmp_path, 1, *short))).train()
    Trainer(load_config(argv(tmp_path, 2, *short))).train()  # resumes from step 1
    run_id = (tmp_path / RUN_ID_FILE).read_text().strip()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    # wandb names a run folder ...-<id>, or ...-<id>-<n> when the resumed run starts within the same second
    assert runs and all(re.search(rf"-{run_id}(-\d+)?$", r.name) for r in runs)
    assert all(any(r.glob("*.wandb")) for r in runs)
