"""The ``titanlite`` command (titanlite.cli): its listing, its errors, every command's own help, and an install.

- In-process: ``titanlite --help`` lists every command with one line; an unknown command is one ``error:`` line
  and exit status 2; each command's ``--help`` is its module's own parser (the usage line names the command);
  the old ``scripts/*.py`` shims forward to the same ``main``.
- Installed (slow): ``pip install`` of a copy of the sources into a fresh venv (no network: the venv reaches this
  one's dependencies through a path file, never this checkout), then from a folder outside the checkout the
  ``titanlite`` console script lists the shipped recipes, prepares a small text, trains the tiny model 2 steps
  (``--config debug_model``: the recipe the wheel carries) with a checkpoint, converts it
  to Hugging Face, estimates a run and plots the metrics; every command's ``--help`` runs in that environment.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.helpers.tiny import TINY_MODEL
from titanlite import cli

REPO = Path(__file__).resolve().parents[2]


def all_commands() -> list[list[str]]:
    """Every runnable command, groups expanded: ["train"], ["convert", "dcp-to-hf"], ["bench", "moe"], ..."""
    out = []
    for name, entry in cli.COMMANDS.items():
        out += [[name, sub] for sub in entry] if isinstance(entry, dict) else [[name]]
    return out


def test_listing_names_every_command_with_one_line(capsys):
    assert cli.main(["--help"]) == 0
    listing = capsys.readouterr().out
    lines = {line.split()[0]: line for line in listing.splitlines() if line.startswith("  ")}
    assert list(lines) == ["train", "generate", "eval", "convert", "prepare", "estimate", "plot", "bench"]
    assert cli.main(["bench", "--help"]) == 0
    bench = capsys.readouterr().out
    for sub in ("train", "generate", "eval", "optimizer", "loss-chunks", "moe", "data", "checkpoint", "hf-baseline"):
        assert f"\n  {sub} " in bench, sub
    assert cli.main([]) == 2 and "usage: titanlite <command>" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, prog",
    [
        (["nope"], "titanlite"),
        (["bench", "nope", "--steps", "2"], "titanlite bench"),
        (["convert", "x"], "titanlite convert"),
    ],
)
def test_unknown_command_is_one_line_error(argv, prog, capsys):
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    name = argv[len(prog.split()) - 1]
    assert not out and err.count("\n") == 1 and err.startswith(f"{prog}: error: unknown command '{name}' (choose from ")


@pytest.mark.parametrize("argv", all_commands(), ids=" ".join)
def test_each_command_shows_its_own_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    own = {name: f"python -m titanlite.{name}" for name in ("train", "generate", "eval")}  # their -m names
    assert out.startswith(f"usage: {own.get(argv[0], 'titanlite ' + ' '.join(argv))}"), out[:200]


# ----------------------------------------------------------------------------- installed


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """A fresh venv with titanlite pip-installed from a copy of the sources (this venv's packages reached through
    a path file, whose own path files, the editable install's among them, are not processed)."""
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    for part in ("titanlite", "torchtitan_ext"):
        shutil.copytree(REPO / part, src / part, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / part, src / part)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(purelib, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", str(src)]
    r = subprocess.run(pip, capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    shutil.rmtree(src)  # nothing of the sources left but the installed package
    work = root / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    return {"venv": venv, "python": python, "work": work, "env": env}


def run(installed: dict, *argv: str, timeout: float = 180) -> subprocess.CompletedProcess:
    cmd = [str(installed["venv"] / "bin" / argv[0]), *argv[1:]]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=installed["work"], env=installed["env"]
    )


@pytest.mark.slow
def test_installed_package_comes_from_the_venv_and_every_command_has_help(installed):
    """One interpreter of the venv: titanlite is the installed copy, the checkout is not on sys.path, and each
    command's --help (its module imported from the install) exits 0 with its usage line."""
    script = f"""
import contextlib, io, json, sys
import titanlite, titanlite.cli as cli
found = {{"file": titanlite.__file__, "path": sys.path, "help": {{}}}}
for argv in {all_commands()!r}:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            cli.main([*argv, "--help"])
            code = 0
        except SystemExit as e:
            code = e.code
    found["help"][" ".join(argv)] = [code, out.getvalue().splitlines()[0] if out.getvalue() else ""]
print(json.dumps(found))
"""
    r = run(installed, "python", "-c", script)
    assert r.returncode == 0, r.stderr[-3000:]
    found = json.loads(r.stdout.splitlines()[-1])
    assert Path(found["file"]).resolve().is_relative_to(installed["venv"].resolve()), found["file"]
    assert not any(p and Path(p).resolve() == REPO for p in found["path"]), found["path"]
    for name, (code, usage) in found["help"].items():
        assert code == 0 and usage.startswith("usage: "), (name, code, usage)
    listing = run(installed, "titanlite", "--help")
    assert listing.returncode == 0 and "\n  bench " in listing.stdout
    unknown = run(installed, "titanlite", "frobnicate")
    assert unknown.returncode == 2 and unknown.stderr.strip() == (
        "titanlite: error: unknown command 'frobnicate' (choose from train, generate, eval, convert, prepare, "
        "estimate, plot, bench)"
    )


@pytest.mark.slow
def test_installed_command_prepares_trains_converts_estimates_and_plots(installed):
    work = installed["work"]
    text = work / "corpus.txt"
    text.write_text("".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n\n" for i in range(300)))
    prep = run(installed, "titanlite", "prepare", "--input", str(text), "--tokenizer", "bytes", "--output", "shards")
    assert prep.returncode == 0, prep.stderr[-3000:]
    totals = json.loads((work / "shards" / "manifest.json").read_text())["totals"]["train"]
    assert totals["tokens"] == len(text.read_bytes()) + 2  # one document: BOS, its bytes, EOS

    listed = run(installed, "titanlite", "train", "--list-configs")  # the recipes the wheel carries
    assert listed.returncode == 0 and [line.split()[0] for line in listed.stdout.splitlines()] == sorted(
        p.stem for p in (REPO / "train_configs").glob("*.toml")
    )
    assert not (work / "debug_model.toml").exists()
    train = run(
        installed,
        "titanlite",
        "train",
        "--config",
        "debug_model",  # the shipped recipe: no such file here
        *TINY_MODEL,
        *("--training.steps", "2", "--training.seq_len", "32", "--lr_scheduler.warmup_steps", "0"),
        *("--validation.enable", "false", "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "1"),
        *("--checkpoint.enable", "true", "--checkpoint.interval", "2", "--job.dump_folder", "run"),
    )
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-3000:]
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]

    convert = run(installed, "titanlite", "convert", "dcp-to-hf", "-q", "run/checkpoint/step-2", "hf")
    assert convert.returncode == 0, convert.stderr[-3000:]
    assert json.loads((work / "hf" / "config.json").read_text())["num_hidden_layers"] == 2
    assert (work / "hf" / "model.safetensors").stat().st_size > 0

    config = "debug_model.toml"  # the shipped recipe again, by its file name
    estimate = run(installed, "titanlite", "estimate", "--config", config, *TINY_MODEL, "--gpu", "H100")
    assert estimate.returncode == 2 and "--num-gpus" in estimate.stderr  # argparse's own error, as before
    estimate = run(
        installed,
        "titanlite",
        "estimate",
        *("--config", config, *TINY_MODEL, "--gpu", "H100", "--num-gpus", "1", "--tokens", "1e6", "--json"),
    )
    assert estimate.returncode == 0, estimate.stderr[-3000:]
    with safe_open(str(work / "hf" / "model.safetensors"), "pt") as f:  # the trained model's exact size
        assert json.loads(estimate.stdout)["params"] == sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())

    pytest.importorskip("matplotlib")
    plot = run(installed, "titanlite", "plot", "run", "-o", "curves.png")
    assert plot.returncode == 0, plot.stderr[-3000:]
    assert (work / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
