"""The README's library loop runs as written and its loss falls."""
import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_readme_library_loop_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    loop = next(b for b in blocks if "for step in range" in b)
    assert len(loop.splitlines()) <= 35
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(loop, "README.md", "exec"), {})
    losses = [float(line.split()[-1]) for line in out.getvalue().splitlines() if line.startswith("step")]
    assert len(losses) == 20
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5
