"""No module under tests/ imports a test module: what several test files share lives in tests/helpers/ or a
conftest.py. A test module that imports another runs the other's module-level code (its fixtures, skips and
imports) wherever it is used, and ties the two files' layouts together."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _is_test_module(name: str) -> bool:
    return name.rpartition(".")[2].startswith("test_")


def imported_test_modules(path: Path) -> list[str]:
    """The test modules ``path`` imports (at any depth of its code), as written: ``import tests.x.test_y``,
    ``from tests.x.test_y import f``, ``from tests.x import test_y``, ``from .test_y import f``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if _is_test_module(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if _is_test_module(module):
                found.append(module)
            elif node.level or module == "tests" or module.startswith("tests."):
                found += [f"{module}.{alias.name}" for alias in node.names if _is_test_module(alias.name)]
    return found


def offenders(root: Path) -> dict[str, list[str]]:
    """Each module under ``root`` that imports a test module, with the test modules it imports."""
    return {str(p.relative_to(root)): names for p in sorted(root.rglob("*.py")) if (names := imported_test_modules(p))}


def test_no_module_imports_a_test_module():
    found = offenders(TESTS)
    assert not found, f"test modules imported (move what they share to tests/helpers/ or a conftest.py): {found}"


def test_the_check_finds_each_form_of_import(tmp_path):
    forms = [
        "from tests.checkpoint.test_checkpoint import TINY",
        "import tests.test_library_examples as examples",
        "from tests.ext import test_compat",
        "from .test_generate import NoCacheLM",
        "def f():\n    from tests.eval.test_generate import NoCacheLM",
    ]
    for i, code in enumerate(forms):
        (tmp_path / f"test_form{i}.py").write_text(code + "\n")
    (tmp_path / "test_clean.py").write_text("from tests.helpers.tiny import TINY_MODEL\nimport pytest\n")
    found = {p.name: imported_test_modules(p) for p in tmp_path.glob("*.py")}
    assert found.pop("test_clean.py") == []
    assert sorted(found) == [f"test_form{i}.py" for i in range(len(forms))]
    assert all(len(names) == 1 for names in found.values()), found
