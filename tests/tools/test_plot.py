"""titanlite plot (titanlite.tools.plot): overlaid runs to a PNG; a clear message without matplotlib."""

import json
import sys
from pathlib import Path

import pytest

from tests.helpers.launch import run_python

REPO = Path(__file__).resolve().parents[2]
PLOT = [sys.executable, "-m", "titanlite", "plot"]  # the `titanlite plot` command


def _fake_run(folder: Path, scale: float) -> None:
    folder.mkdir(parents=True)
    lines = []
    for step in range(1, 21):
        lines.append(
            {
                "step": step,
                "loss": scale * (6 - step * 0.2),
                "lr": 1e-3 * min(1, step / 5),
                "grad_norm": 1.0 + 0.1 * step,
                "tokens_per_s": 1000.0 + step,
                "mfu": 0.3 if step > 1 else None,
            }
        )
        if step % 10 == 0:
            lines.append({"step": step, "val_loss": scale * (6.2 - step * 0.2), "val_perplexity": 100.0})
            lines.append({"step": step, "val_bpb": 4.0 - step * 0.1})
    for step in (20, 10):  # a watcher's scores, appended late and out of order
        scores = {"eval/hellaswag/acc": 0.25 + step / 1000, "eval/hellaswag/acc_norm": 0.26, "eval/piqa/acc": 0.5}
        lines.append({"step": step, **scores, "eval/lambada/perplexity": 3000.0 / step, "eval_source": "watcher"})
    lines.insert(8, {"step": 7, "guard_event": "nonfinite", "guard_action": "skip"})
    torn = '{"step": 21, "lo'  # a last line cut by a crash
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n" + torn)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    _fake_run(tmp_path / "run_a", 1.0)
    _fake_run(tmp_path / "run_b", 1.1)
    out = tmp_path / "plots" / "curves.png"
    r = run_python(
        [
            *PLOT,
            str(tmp_path / "run_a"),
            str(tmp_path / "run_b" / "metrics.jsonl"),
            "-o",
            str(out),
            "--smooth",
            "0.5",
        ],
        timeout=120,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert "2 run(s)" in r.stdout
    # the runs logged bits per byte and downstream scores: each gets its panel
    assert r.stdout.strip().endswith("MFU, validation bits per byte, downstream accuracy, downstream perplexity)"), (
        r.stdout
    )


def test_plot_draws_only_the_panels_a_run_logged(tmp_path):
    """A run with loss and lr only (no grad norm, throughput or MFU: a CPU peak left unknown, an old log) gets two
    panels, not five with three empty; a run with nothing to plot is one line, status 2."""
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": s, "loss": 5.0 - 0.1 * s, "lr": 1e-3, "mfu": None} for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "curves.png"
    r = run_python([*PLOT, str(run), "-o", str(out)], timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("(1 run(s); panels: loss, learning rate)"), r.stdout
    from PIL import Image

    height = Image.open(out).size[1]
    assert height == round(110 * 2.6 * 2)  # two panels of 2.6 inches at 110 dpi
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "mfu": None}) + "\n")
    empty = run_python([*PLOT, str(run), "-o", str(tmp_path / "e.png")])
    assert empty.returncode == 2 and "no metric to plot" in empty.stderr and not (tmp_path / "e.png").exists()


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path):
    _fake_run(tmp_path / "run", 1.0)
    blocker = tmp_path / "no_mpl"
    (blocker / "matplotlib").mkdir(parents=True)
    (blocker / "matplotlib" / "__init__.py").write_text("raise ImportError('matplotlib is not installed')\n")
    r = run_python(
        [*PLOT, str(tmp_path / "run"), "-o", str(tmp_path / "x.png")],
        timeout=60,
        env={"PYTHONPATH": str(blocker), "PATH": ""},
        cwd=REPO,
    )
    assert r.returncode == 2
    assert "needs matplotlib" in r.stderr and "pip install matplotlib" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "x.png").exists()
    missing = run_python(
        [*PLOT, str(tmp_path / "nope")], timeout=60, env={"PYTHONPATH": str(blocker), "PATH": ""}, cwd=REPO
    )
    assert missing.returncode == 2


def test_lines_that_hold_no_record_are_skipped_as_the_trainer_skips_them(tmp_path):
    """``[1, 2]``, ``"s"``, ``null``, a record without an integer step: skipped by the reader the trainer's rewind
    and the watcher use (they were a traceback here); the image is byte for byte the one of the clean file."""
    pytest.importorskip("matplotlib")
    clean, noisy = tmp_path / "a" / "run", tmp_path / "b" / "run"  # the same label: the folder's name
    _fake_run(clean, 1.0)
    _fake_run(noisy, 1.0)
    lines = (noisy / "metrics.jsonl").read_text().split("\n")
    junk = ["[1, 2]", '"s"', "null", '{"loss": 9.0}', '{"step": true, "loss": 9.0}', '{"step": "3", "loss": 9.0}']
    for i, line in enumerate(junk):
        lines.insert(3 * i + 1, line)
    (noisy / "metrics.jsonl").write_text("\n".join(lines))
    images = []
    for run in (clean, noisy):
        out = run.parent / "curves.png"
        r = run_python([*PLOT, str(run), "-o", str(out)], timeout=120, cwd=REPO)
        assert r.returncode == 0, r.stderr
        images.append(out.read_bytes())
    assert images[0] == images[1]


@pytest.mark.parametrize("name", ["x.txt", "curves.PNGX"])
def test_an_output_type_matplotlib_cannot_write_is_one_line_listing_the_types(name, tmp_path):
    pytest.importorskip("matplotlib")
    _fake_run(tmp_path / "run", 1.0)
    out = tmp_path / name
    r = run_python([*PLOT, str(tmp_path / "run"), "-o", str(out)], timeout=120)
    ext = out.suffix.lower()
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"error: -o {out}: matplotlib writes no '{ext}' image (supported extensions: ")
    assert all(f".{kind}" in r.stderr for kind in ("png", "svg", "pdf")) and not out.exists()
