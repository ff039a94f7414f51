"""benchmarks/revision.py, the development-only comparison with another git revision: it stays out of the
package, and it times the revision side by side with the checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import setuptools

from tests.helpers.launch import run_python
from titanlite import cli

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[2]


def test_the_package_ships_no_git_comparison(capsys):
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = setuptools.find_packages(str(REPO), include=include)
    assert "titanlite.bench" in packages and not any(p.split(".")[0] == "benchmarks" for p in packages), packages
    assert not (REPO / "titanlite" / "bench" / "baseline.py").exists()
    for bench in ("generate", "eval"):
        with pytest.raises(SystemExit):
            cli.main(["bench", bench, "--help"])
        assert "--baseline" not in capsys.readouterr().out


def _revision(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    # 16 new tokens: the decode time is t(16) - t(1), two separate timings, which noise can invert over few tokens
    tiny = ["--flavors", "debugmodel", "--batch-sizes", "1", "--prompt-len", "8", "--new-tokens", "16"]
    cmd = [sys.executable, "-m", "benchmarks.revision", "generate", *tiny, "--repeats", "1", "--modes", "eager"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return run_python([*cmd, *args], cwd=REPO, env=env, timeout=300)  # the baseline side starts its own interpreter


@pytest.mark.slow
def test_a_revision_is_timed_side_by_side_with_the_checkout(tmp_path):
    out = tmp_path / "rows.json"
    proc = _revision(tmp_path, "--baseline", "HEAD", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    [row] = json.loads(out.read_text())
    assert row["baseline"] == "HEAD" and row["eager_tok_s"] > 0 and row["baseline_tok_s"] > 0, row
    assert "baseline: titanlite at HEAD, eager" in proc.stdout


def test_an_unknown_revision_is_a_one_line_error(tmp_path):
    proc = _revision(tmp_path, "--baseline", "no-such-revision")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        f"error: --baseline no-such-revision: not a commit of the checkout {REPO}"
    ]
