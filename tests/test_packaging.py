"""What ``pyproject.toml`` promises: a torch lower bound that the environment satisfies, and no unpickling
``torch.load`` anywhere in the package (every call says ``weights_only=True``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch

from titanlite.config.toml_io import read_toml

REPO = Path(__file__).resolve().parents[1]


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.match(r"\d+(\.\d+)*", text).group().split("."))


def test_torch_has_the_tested_lower_bound_and_this_torch_meets_it():
    deps = read_toml(str(REPO / "pyproject.toml"))["project"]["dependencies"]
    torch_deps = [d for d in deps if re.match(r"torch\s*($|[<>=!~;\[])", d)]
    assert len(torch_deps) == 1, deps
    bound = re.match(r"torch\s*>=\s*([\d.]+)", torch_deps[0])
    assert bound is not None, f"{torch_deps[0]!r}: no lower bound (the GPU image runs torch 2.11)"
    assert version_tuple(bound.group(1)) >= (2, 11), torch_deps[0]
    assert version_tuple(torch.__version__) >= version_tuple(bound.group(1)), (torch.__version__, torch_deps[0])


def unsafe_torch_loads(source: str) -> list[int]:
    """Lines of ``torch.load(...)`` calls without ``weights_only=True``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"):
            continue
        if not (isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            continue
        safe = [k for k in node.keywords if k.arg == "weights_only" and isinstance(k.value, ast.Constant)]
        if not (safe and safe[0].value.value is True):
            lines.append(node.lineno)
    return lines


def test_every_torch_load_in_the_package_is_weights_only():
    assert unsafe_torch_loads(
        "torch.load(f)\ntorch.load(f, weights_only=False)\ntorch.load(f, weights_only=True)\n"
    ) == [
        1,
        2,
    ]
    found = {}
    for path in sorted((REPO / "titanlite").rglob("*.py")):
        if lines := unsafe_torch_loads(path.read_text(encoding="utf-8")):
            found[str(path.relative_to(REPO))] = lines
    assert not found, f"torch.load without weights_only=True: {found}"
