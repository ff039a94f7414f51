"""Moved modules and renamed names fail loudly (titanlite._moved): every row of the tables raises a one-line
ImportError naming its new place, and that place imports."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest

from titanlite._moved import MOVED_MODULES, MOVED_NAMES


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_a_moved_module_names_its_new_place(old):
    targets = re.findall(r"titanlite(?:\.\w+)+", MOVED_MODULES[old])
    assert targets
    with pytest.raises(ModuleNotFoundError) as e:
        importlib.import_module(old)
    message = str(e.value)
    assert "\n" not in message and all(t in message for t in targets), message
    parent, _, leaf = old.rpartition(".")
    with pytest.raises(ImportError) as e:  # the from-import form too, not Python's bare "cannot import name"
        exec(f"from {parent} import {leaf}", {})
    assert str(e.value) == message
    for target in targets:
        importlib.import_module(target)


@pytest.mark.parametrize("module,name", sorted(MOVED_NAMES))
def test_a_renamed_name_names_the_new_one(module, name):
    new = MOVED_NAMES[(module, name)]
    new_module, _, new_name = new.rpartition(".")
    assert hasattr(importlib.import_module(new_module), new_name)
    with pytest.raises(ImportError, match=new.replace(".", r"\.")):
        exec(f"from {module} import {name}", {})
    with pytest.raises(ImportError, match=new.replace(".", r"\.")):
        getattr(importlib.import_module(module), name)


def test_other_missing_names_stay_ordinary_errors():
    with pytest.raises(ModuleNotFoundError, match="No module named 'titanlite.no_such_module'"):
        importlib.import_module("titanlite.no_such_module")
    import titanlite.plan.planner as planner

    assert not hasattr(planner, "no_such_name")


def test_a_fresh_interpreter_fails_with_one_line():
    """What a user of an old import sees: the last line of the traceback names the new module."""
    out = subprocess.run([sys.executable, "-c", "import titanlite.train_step"], capture_output=True, text=True)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: titanlite.train_step has moved to titanlite.trainer.step"
    )
