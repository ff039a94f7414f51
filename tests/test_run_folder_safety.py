"""What a tool may run, delete or overwrite because of what a folder says (issue 27, items 1, 2, 3 and 5).

- the eval watcher imports only the modules on its own ``--extensions``, never the ``[job] extensions`` of the
  ``config.toml`` it watches (a module file beside it would run);
- ``prepare_data --overwrite`` deletes only plain shard files inside its output folder, whatever its manifest or
  journal list;
- the run lock covers the checkpoint folder wherever it lives, and a ``CheckpointManager`` used as a library takes
  it too;
- nothing writes into a checkpoint step folder (a dump folder there, ``eval --output <step>/checkpoint.json``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from shared_data import shared_file
from test_prepare_data import small_prepared  # noqa: F401  (a fixture)
from tiny import TINY_MODEL

from titanlite.config import config_to_toml
from titanlite.data import prepare as prep
from titanlite.data.shards import MANIFEST
from titanlite.models import load_config

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


# ---------------------------------------------------------------- 1. the watcher imports only its own --extensions
def watched_run(dump: Path, extensions: list[str], model: str = "llama3") -> None:
    """A run folder as a run leaves it when it starts (config.toml), with ``[job] extensions`` set in the file
    only (loading them here would import them)."""
    cfg = load_config([*TINY_MODEL, "--checkpoint.enable", "--job.dump_folder", str(dump)])
    text = config_to_toml(cfg).replace("extensions = []", f"extensions = {json.dumps(extensions)}", 1)
    dump.mkdir(parents=True)
    (dump / "config.toml").write_text(text.replace('name = "llama3"', f'name = "{model}"', 1))


def test_watcher_never_imports_the_extensions_the_watched_config_names(tmp_path):
    """Run from inside the watched folder, ``python -m`` puts that folder first on the path: a module there named
    by the run's config.toml used to be imported (and run) by the watcher."""
    eval_data = shared_file("eval")
    dump = tmp_path / "run"
    watched_run(dump, ["planted_ext_27"])
    marker = tmp_path / "planted_ran"
    (dump / "planted_ext_27.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "titanlite.eval", "--watch", str(dump), "--once", "--tasks", "piqa"]
    done = subprocess.run([*argv, "--data-dir", str(eval_data)], cwd=dump, env=env, capture_output=True, text=True)
    assert not marker.exists(), "the watcher imported a module named by the watched config.toml"
    assert done.returncode == 0, done.stderr  # a core family: the run's extensions are not needed to watch it


def test_watcher_names_the_extension_a_family_needs_instead_of_importing_it(tmp_path, capsys):
    from titanlite.eval import cli

    dump = tmp_path / "run"
    watched_run(dump, ["planted_family_ext_27"], model="planted_family")
    (dump / "planted_family_ext_27.py").write_text("raise SystemExit('imported')\n")
    sys.path.insert(0, str(dump))
    try:
        assert cli.main(["--watch", str(dump), "--once", "--data-dir", str(tmp_path)]) == 2
    finally:
        sys.path.remove(str(dump))
    err = one_line_error(capsys)
    assert "model family 'planted_family' comes from the run's [job] extensions" in err
    assert err.endswith("pass --extensions planted_family_ext_27")
    assert "planted_family_ext_27" not in sys.modules


# ---------------------------------------------------------------- 2. prepare_data --overwrite deletes only its shards
@pytest.mark.parametrize("where", ["journal_parent", "journal_absolute", "manifest_parent", "manifest_mask"])
def test_overwrite_refuses_a_listing_that_names_files_outside_the_shards(small_prepared, where):
    """manifest.json and prepare_journal.jsonl are what --overwrite deletes: an entry naming ``../victim.txt``, an
    absolute path or another mask file used to be deleted with the shards."""
    src, out, tok, kw, _ = small_prepared
    victim = out.parent / "victim.txt"
    victim.write_text("the user's file")
    name = str(victim) if where == "journal_absolute" else "../victim.txt"
    if where.startswith("journal"):
        with open(out / prep.JOURNAL, "a") as f:
            f.write(json.dumps({"name": name, "tokens": 1, "docs": 1}) + "\n")
    else:
        manifest = json.loads((out / MANIFEST).read_text())
        entry = manifest["shards"][0]
        if where == "manifest_mask":
            entry["mask"] = {"name": "../victim.txt", "checksum": entry["checksum"]}
        else:
            entry["name"] = name
        (out / MANIFEST).write_text(json.dumps(manifest))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ValueError) as e:
        prep.prepare(src, out, tok, **{**kw, "shard_tokens": 5_000, "overwrite": True})
    msg = str(e.value)
    listing = prep.JOURNAL if where.startswith("journal") else MANIFEST
    assert msg.startswith(f"{out / listing}: entry {name!r} is not a shard file of this folder") and "\n" not in msg
    assert victim.read_text() == "the user's file"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing deleted or written


@pytest.mark.parametrize("kind", ["symlink", "folder"])
def test_overwrite_refuses_a_listed_shard_that_is_no_plain_file(small_prepared, kind):
    src, out, tok, kw, manifest = small_prepared
    victim = out.parent / "victim.txt"
    victim.write_text("the user's file")
    shard = out / manifest["shards"][0]["name"]
    shard.unlink()
    if kind == "symlink":
        shard.symlink_to(victim)
    else:
        shard.mkdir()
        (shard / "inside.txt").write_text("kept")
    with pytest.raises(ValueError) as e:
        prep.prepare(src, out, tok, **{**kw, "shard_tokens": 5_000, "overwrite": True})
    msg = str(e.value)
    assert msg.startswith(f"{shard} is {'a symbolic link' if kind == 'symlink' else 'not a plain file'}"), msg
    assert "\n" not in msg and victim.read_text() == "the user's file"
    assert shard.is_symlink() if kind == "symlink" else (shard / "inside.txt").read_text() == "kept"
