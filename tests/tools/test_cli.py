"""The ``titanlite`` command (titanlite.cli): its listing, its errors, every command's own help, and an install.

- In-process: ``titanlite --help`` lists every command with one line; an unknown command is one ``error:`` line
  and exit status 2; each command's ``--help`` is its module's own parser (the usage line names the command);
  the old ``scripts/*.py`` shims forward to the same ``main``.
- Installed (slow): ``pip install`` of a copy of the sources into a fresh venv (no network: the venv reaches this
  one's dependencies through a path file, never this checkout); then one interpreter of that venv, in a folder
  outside the checkout, runs the commands through ``titanlite.cli.main`` (what the console script calls): every
  command's ``--help``, the listing of the shipped recipes, preparing a small text, training the tiny model 2 steps
  (``--config debug_model``: the recipe the wheel carries) with a checkpoint, converting it to Hugging Face,
  estimating a run and plotting the metrics; the ``titanlite`` console script itself lists and refuses commands.
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


# The commands the installed package runs, in order, each through ``titanlite.cli.main`` in one interpreter of
# the venv (the console script is ``sys.exit(main())``; two real launches of it are checked below).
COMMANDS_RUN = [
    ("prepare", ["prepare", "--input", "corpus.txt", "--tokenizer", "bytes", "--output", "shards"]),
    ("list", ["train", "--list-configs"]),  # the recipes the wheel carries
    (
        "train",
        [
            *("train", "--config", "debug_model"),  # the shipped recipe: no such file here
            *TINY_MODEL,
            *("--training.steps", "2", "--training.seq_len", "32", "--lr_scheduler.warmup_steps", "0"),
            *("--validation.enable", "false", "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "1"),
            *("--checkpoint.enable", "true", "--checkpoint.interval", "2", "--job.dump_folder", "run"),
        ],
    ),
    ("convert", ["convert", "dcp-to-hf", "-q", "run/checkpoint/step-2", "hf"]),
    # the shipped recipe again, by its file name; without --num-gpus: argparse's own error
    ("estimate_error", ["estimate", "--config", "debug_model.toml", *TINY_MODEL, "--gpu", "H100"]),
    (
        "estimate",
        ["estimate", "--config", "debug_model.toml", *TINY_MODEL, "--gpu", "H100", "--num-gpus", "1"]
        + ["--tokens", "1e6", "--json"],
    ),
    ("plot", ["plot", "run", "-o", "curves.png"]),  # skipped where the venv has no matplotlib
]

SESSION_SCRIPT = """
import contextlib, importlib.util, io, json, sys
import titanlite, titanlite.cli as cli

def call(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return {"code": code, "out": out.getvalue(), "err": err.getvalue()}

found = {"file": titanlite.__file__, "path": sys.path, "help": {}, "runs": {}}
for argv in json.loads(sys.argv[1]):
    r = call([*argv, "--help"])
    found["help"][" ".join(argv)] = [r["code"], r["out"].splitlines()[0] if r["out"] else ""]
for name, argv in json.loads(sys.argv[2]):
    if name != "plot" or importlib.util.find_spec("matplotlib"):
        found["runs"][name] = call(argv)
with open("session.json", "w") as f:
    json.dump(found, f)
"""


@pytest.fixture(scope="module")
def session(installed) -> dict:
    """What one interpreter of the venv found: titanlite's file, sys.path, each command's --help exit status and
    usage line, and the exit status and output of each of ``COMMANDS_RUN``, after a small text was written."""
    work = installed["work"]
    text = work / "corpus.txt"
    text.write_text("".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n\n" for i in range(300)))
    assert not (work / "debug_model.toml").exists()
    args = [json.dumps(all_commands()), json.dumps(COMMANDS_RUN)]
    r = run(installed, "python", "-c", SESSION_SCRIPT, *args, timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads((work / "session.json").read_text())


@pytest.mark.slow
def test_installed_package_comes_from_the_venv_and_every_command_has_help(installed, session):
    """titanlite is the installed copy, the checkout is not on sys.path, and each command's --help (its module
    imported from the install) exits 0 with its usage line; the console script itself lists and refuses."""
    assert Path(session["file"]).resolve().is_relative_to(installed["venv"].resolve()), session["file"]
    assert not any(p and Path(p).resolve() == REPO for p in session["path"]), session["path"]
    assert set(session["help"]) == {" ".join(argv) for argv in all_commands()}
    for name, (code, usage) in session["help"].items():
        assert code == 0 and usage.startswith("usage: "), (name, code, usage)
    listing = run(installed, "titanlite", "--help")
    assert listing.returncode == 0 and "\n  bench " in listing.stdout
    unknown = run(installed, "titanlite", "frobnicate")
    assert unknown.returncode == 2 and unknown.stderr.strip() == (
        "titanlite: error: unknown command 'frobnicate' (choose from train, generate, eval, convert, prepare, "
        "estimate, plot, bench)"
    )


@pytest.mark.slow
def test_installed_command_prepares_trains_converts_estimates_and_plots(installed, session):
    work, runs = installed["work"], session["runs"]
    prep = runs["prepare"]
    assert prep["code"] == 0, prep["err"][-3000:]
    totals = json.loads((work / "shards" / "manifest.json").read_text())["totals"]["train"]
    assert totals["tokens"] == len((work / "corpus.txt").read_bytes()) + 2  # one document: BOS, its bytes, EOS

    listed = runs["list"]
    assert listed["code"] == 0 and [line.split()[0] for line in listed["out"].splitlines()] == sorted(
        p.stem for p in (REPO / "train_configs").glob("*.toml")
    )
    train = runs["train"]
    assert train["code"] == 0, train["out"][-2000:] + train["err"][-3000:]
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]

    convert = runs["convert"]
    assert convert["code"] == 0, convert["err"][-3000:]
    assert json.loads((work / "hf" / "config.json").read_text())["num_hidden_layers"] == 2
    assert (work / "hf" / "model.safetensors").stat().st_size > 0

    estimate = runs["estimate_error"]
    assert estimate["code"] == 2 and "--num-gpus" in estimate["err"]  # argparse's own error, as before
    estimate = runs["estimate"]
    assert estimate["code"] == 0, estimate["err"][-3000:]
    with safe_open(str(work / "hf" / "model.safetensors"), "pt") as f:  # the trained model's exact size
        assert json.loads(estimate["out"])["params"] == sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())

    pytest.importorskip("matplotlib")
    plot = runs["plot"]
    assert plot["code"] == 0, plot["err"][-3000:]
    assert (work / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
