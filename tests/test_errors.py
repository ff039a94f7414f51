"""Errors at the command lines: bad input (a :class:`titanlite.errors.UserError`) is one ``error:`` line and its
exit code, with no traceback; any other exception is a bug and keeps its traceback. Each command runs in a process
of its own (:func:`tests.helpers.launch.run_python`), as a user runs it.

The bug is a ``KeyError`` raised while the model is built: the training job meets it through a model family an
extension module (``[job] extensions``) registers; the other commands through a wrapper script that replaces the
function they call first with one that raises.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.launch import run_python
from tests.helpers.tiny import TINY_MODEL
from titanlite.errors import CheckpointError, ConfigError, DataError, UsageError, UserError
from titanlite.trainer.guard import TrainingDivergedError

REPO = Path(__file__).resolve().parents[1]
BUG = "layers.3.attention.wq.weight"  # the message of the injected KeyError: what a lookup bug looks like

BROKEN_FAMILY = f"""
from titanlite.models import ModelSpec, register_model
from titanlite.models.llama3 import LLAMA3_FLAVORS, Llama3ModelArgs, Transformer
from titanlite.tokenizer import build_tokenizer


class BrokenTransformer(Transformer):
    def __init__(self, args):
        super().__init__(args)
        raise KeyError({BUG!r})  # a bug in the family's build


register_model(ModelSpec(name="broken_llama", args_cls=Llama3ModelArgs, flavors=LLAMA3_FLAVORS,
                         model_cls=BrokenTransformer, tokenizer_builder=build_tokenizer))
"""


def run(args: list[str], tmp_path: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)]), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return run_python([sys.executable, *args], cwd=tmp_path, env=env, timeout=timeout)


def assert_traceback(proc: subprocess.CompletedProcess, exc: str = "KeyError") -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback (most recent call last)" in proc.stderr and f"{exc}: '{BUG}'" in proc.stderr, proc.stderr[-3000:]
    assert not [line for line in proc.stderr.splitlines() if line.startswith("error:")], proc.stderr[-3000:]


def assert_one_line(proc: subprocess.CompletedProcess, needle: str, code: int = 2) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    assert lines[0].startswith("error: ") and needle in lines[0], lines


@pytest.mark.parametrize("dry_run", [False, True], ids=["train", "dry_run"])
def test_a_bug_in_the_model_build_keeps_its_traceback(tmp_path, dry_run):
    """A KeyError while the Trainer (or the dry run) builds the model: the traceback, exit status 1, no
    ``error:`` line. Before, ``python -m titanlite.train`` printed ``error: 'layers.3...'`` and exited 2."""
    (tmp_path / "broken_ext.py").write_text(BROKEN_FAMILY)
    args = ["-m", "titanlite.train", "--job.extensions", "broken_ext", "--model.name", "broken_llama", *TINY_MODEL]
    args += ["--job.dump_folder", str(tmp_path / "run"), "--training.steps", "2"]
    args += ["--job.dry_run", "true", "--job.dry_run_world_size", "1"] if dry_run else []
    proc = run(args, tmp_path)
    assert_traceback(proc)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_config_error_is_one_line_with_the_documented_exit_code(tmp_path):
    """Bad input found while parsing (an unknown key) and while building (degrees that do not fit the one process):
    one ``error:`` line each, exit status :attr:`ConfigError.exit_code` (2), no traceback."""
    dump = ["--job.dump_folder", str(tmp_path / "run")]
    proc = run(["-m", "titanlite.train", *TINY_MODEL, *dump, "--training.lrr", "1"], tmp_path)
    assert_one_line(proc, "unknown key 'training.lrr'", ConfigError.exit_code)
    proc = run(["-m", "titanlite.train", *TINY_MODEL, *dump, "--parallelism.tensor_parallel_degree", "2"], tmp_path)
    assert_one_line(proc, "does not divide the number of processes (WORLD_SIZE=1)", ConfigError.exit_code)
    assert ConfigError.exit_code == 2 and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_estimate_keeps_the_traceback_of_a_bug(tmp_path):
    """``titanlite estimate`` counts the model's parameters on a meta build: the family's KeyError is a bug."""
    (tmp_path / "broken_ext.py").write_text(BROKEN_FAMILY)
    config = tmp_path / "broken.toml"
    config.write_text('[job]\nextensions = ["broken_ext"]\n[model]\nname = "broken_llama"\nflavor = "debugmodel"\n')
    estimate = ["-m", "titanlite", "estimate", "--config", str(config), "--gpu", "H100", "--num-gpus", "1"]
    assert_traceback(run([*estimate, "--tokens", "1e6"], tmp_path))
    proc = run([*estimate, "--tokens", "1e6", "--training.lrr", "1"], tmp_path)
    assert_one_line(proc, "unknown key 'training.lrr'")


# the module attribute each command calls first with the user's input, and a command line that reaches it
PATCHED = {
    "convert": ("titanlite.checkpoint.convert_cli", "dcp_to_hf", ["convert", "dcp-to-hf", "step", "hf_out"]),
    "generate": ("titanlite.generate.cli", "load_model", ["generate", "--checkpoint", "step", "--prompt", "hi"]),
    "eval": ("titanlite.eval.cli", "check_args", ["eval", "--checkpoint", "step", "--data-dir", "."]),
    "prepare": ("titanlite.data.prepare", "prepare", ["prepare", "--input", "in.txt", "--output", "shards"]),
}
WRAPPER = """
import importlib, sys
from titanlite.cli import main

def raise_(*args, **kwargs):
    raise {exc}
setattr(importlib.import_module({module!r}), {name!r}, raise_)
raise SystemExit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", sorted(PATCHED))
def test_the_other_commands_keep_a_bugs_traceback_and_report_bad_input_in_one_line(tmp_path, command):
    """A built-in exception from inside the command: the traceback; a UserError from the same place: one line."""
    module, name, argv = PATCHED[command]
    for exc, check in (
        (f"KeyError({BUG!r})", assert_traceback),
        ("__import__('titanlite.errors').errors.DataError('in.txt: bad input')", None),
    ):
        script = tmp_path / "wrapper.py"
        script.write_text(WRAPPER.format(exc=exc, module=module, name=name))
        proc = run([str(script), *argv], tmp_path)
        if check is not None:
            check(proc)
        else:
            prefix = "prepare_data: " if command == "prepare" else ""
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 2 and lines == [f"{prefix}error: in.txt: bad input"], proc.stderr[-3000:]


def test_every_user_error_kind_is_a_value_error_with_exit_status_2():
    """Code that catches ValueError around a parse or a check keeps working; a stop the config asks for is 1."""
    for kind in (ConfigError, UsageError, DataError, CheckpointError):
        assert issubclass(kind, UserError) and issubclass(kind, ValueError) and kind.exit_code == 2
    assert issubclass(TrainingDivergedError, UserError) and TrainingDivergedError.exit_code == 1
