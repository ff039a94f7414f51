"""A resume whose data pipeline changed in kind (issue 27, item 15): adding or removing ``seq_len_schedule`` or
``mixture`` used to end in a KeyError or AssertionError traceback from deep inside the loader; it is one line naming
the change, exit status 2, and the run's folder is left as it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.checkpoint_runs import TINY, run_trainer
from titanlite.train import main

pytestmark = pytest.mark.usefixtures("one_thread")

MIXTURE = ["--training.mixture", '[{dataset = "embedded", weight = 1.0}]']


def schedule(tmp_path: Path, stages: str = "{seq_len = 16, fraction = 0.4}, {seq_len = 32}") -> list[str]:
    toml = tmp_path / f"stages{stages.count('seq_len')}.toml"
    toml.write_text(f"[training]\nseq_len_schedule = [{stages}]\n")
    return ["--config", str(toml)]


def snapshot(dump: Path) -> dict[str, bytes]:
    return {str(p.relative_to(dump)): p.read_bytes() for p in sorted(dump.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "before, after, says",
    [
        ("plain", "schedule", "saved without training.seq_len_schedule and this run has one"),
        ("schedule", "plain", "saved with training.seq_len_schedule (in stage 2) and this run has none"),
        ("plain", "mixture", "the checkpoint was saved without training.mixture (one source) and this run has one"),
        ("mixture", "plain", "saved with training.mixture (sources embedded) and this run has none"),
        ("schedule", "one_stage", "the checkpoint is in stage 2 of its training.seq_len_schedule, this run's has 1"),
    ],
)
def test_a_change_of_kind_in_the_data_pipeline_is_one_line(tmp_path, capsys, before, after, says):
    options = {"plain": lambda: [], "schedule": lambda: schedule(tmp_path), "mixture": lambda: MIXTURE}
    options["one_stage"] = lambda: schedule(tmp_path, "{seq_len = 32}")
    dump = tmp_path / "run"
    run_trainer(dump, "--training.steps", "5", *options[before]())
    kept = snapshot(dump)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([*options[after](), *TINY, "--job.dump_folder", str(dump), "--training.steps", "10"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot resume "), err
    assert says in err[0] and "start a new run from its weights (checkpoint.initial_load_path" in err[0], err[0]
    assert {k: v for k, v in snapshot(dump).items() if not k.endswith(".titanlite.lock")} == {
        k: v for k, v in kept.items() if not k.endswith(".titanlite.lock")
    }
