"""titanlite's import layers: ``config`` imports nothing from titanlite (but ``utils.nesting``, the JSON/TOML parsing
guard, ``utils.fsio`` and ``errors``, leaves that import nothing from titanlite but ``errors``), no module imports
one of a higher layer, and there are no import cycles. Imports inside functions count too (they are read from the
source, as ``../shared/tools/import_graph.py --all`` reads them).

Layers, lowest first (a module may import its own layer or lower ones):

0. leaves: ``config``, ``components`` (built-ins named as strings, resolved on first lookup), ``errors``,
   ``extensions``, ``utils`` (``fsio``, ``nesting``, ``dtypes``, ``run_lock``, ``argtypes``, ``metrics_records``,
   ``torch_compat``: every private torch API titanlite uses), ``tokenizer`` (with ``tokenizer.hf``,
   ``tokenizer.hf_regex``), ``generate.sampling`` (greedy / temperature / top-k / top-p draws, torch only)
1. ``parallel``: policies, mesh, FSDP/TP/AC/compile/float8, the pipeline split and stages, schedules and their
   arithmetic, ``build_parallel_model``
2. ``models``: the registry, the families (a family's parallelize plan is built from ``parallel``) and
   ``models.flops`` (parameter and FLOP counts)
3. ``data`` (``data.chat``: the chat template, used by ``generate`` and ``sampling``),
   ``checkpoint`` (with ``checkpoint.safe_load``, which imports torch only), ``optim``
4. ``plan``'s estimates: ``plan.planner`` (with ``planner_moe``) and ``plan.run_plan``, above ``models`` and
   ``parallel`` whose counts and pipeline arithmetic they use
5. ``trainer``: everything that runs the model to a loss (the loop protocol ``hooks``, ``loss``, ``output_loss``,
   ``runtime``, ``step``, the ``pipeline_runner``) and every hook (checkpoint, collective timeout, eval, metrics,
   guard, preemption, profiling, validation, sampling, stages); ``generate``; ``eval`` (downstream benchmarks,
   scored through the trainer's ``runtime``)
6. the command lines on top: ``train``, ``plan.dry_run``, ``eval.watch`` / ``eval.cli`` (the checkpoint
   watcher writes the trainer's metrics log)
7. the ``titanlite`` command: ``cli`` (with ``__main__``), ``tools`` (estimate, plot), ``bench``
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "titanlite"
LAYERS = [
    (
        "titanlite",
        "titanlite.config",
        "titanlite.components",
        "titanlite.errors",
        "titanlite.extensions",
        "titanlite.utils",
        "titanlite.tokenizer",
        "titanlite.generate.sampling",
    ),
    ("titanlite.parallel",),
    ("titanlite.models",),
    (
        "titanlite.data",
        "titanlite.data.chat",
        "titanlite.checkpoint",
        "titanlite.checkpoint.safe_load",
        "titanlite.optim",
    ),
    ("titanlite.plan", "titanlite.plan.planner", "titanlite.plan.planner_moe", "titanlite.plan.run_plan"),
    ("titanlite.trainer", "titanlite.generate", "titanlite.eval"),
    (
        "titanlite.train",
        "titanlite.plan.dry_run",
        "titanlite.eval.watch",
        "titanlite.eval.cli",
        "titanlite.eval.__main__",
    ),
    ("titanlite.cli", "titanlite.__main__", "titanlite.tools", "titanlite.bench"),
]
LEAVES = ("titanlite.utils.nesting", "titanlite.utils.fsio", "titanlite.errors", "titanlite.utils.torch_compat")


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The titanlite modules ``name`` imports anywhere in its source (submodules resolved)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + [node.module])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def layer_of(name: str) -> int:
    best = None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (i, len(prefix))
    assert best is not None, f"{name} is in no layer: add it to LAYERS"
    return best[0]


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def test_config_imports_nothing_from_titanlite():
    edges = graph()
    bad = {
        m: sorted(t)
        for m, t in edges.items()
        if m.startswith("titanlite.config")
        and any(
            not x.startswith("titanlite.config")
            for x in t - {"titanlite.utils.nesting", "titanlite.utils.fsio", "titanlite.errors"}
        )
    }
    assert not bad, bad


def test_the_low_level_helpers_import_nothing_from_titanlite():
    """Nothing but ``errors`` (the exception classes, which import nothing themselves)."""
    edges = graph()
    assert not edges["titanlite.errors"]
    assert {m: sorted(edges[m] - {"titanlite.errors"}) for m in LEAVES if edges[m] - {"titanlite.errors"}} == {}


def test_no_module_imports_a_higher_layer():
    bad = [
        f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
        for m, targets in graph().items()
        for t in targets
        if layer_of(t) > layer_of(m)
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    edges, index, low, stack, on_stack, cycles = graph(), {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_the_checker_sees_function_local_imports(tmp_path):
    """The test itself can fail: an import inside a function is an edge."""
    src = tmp_path / "mod.py"
    src.write_text("def f():\n    from titanlite.train import Trainer\n")
    assert imports("titanlite.config.mod", src, {"titanlite.train", "titanlite.config.mod"}) == {"titanlite.train"}


def test_nothing_below_imports_plan_or_trainer():
    """``models``, ``parallel``, ``data``, ``checkpoint``, ``optim`` and ``config`` never import the planning tools or
    the loop (the FLOP counts live in ``models.flops``, the pipeline arithmetic in ``parallel``)."""
    lower = ("titanlite.models", "titanlite.parallel", "titanlite.data", "titanlite.checkpoint", "titanlite.optim")
    lower += ("titanlite.config",)
    bad = [
        f"{m} imports {t}"
        for m, targets in graph().items()
        if m.startswith(lower)
        for t in targets
        if t.startswith(("titanlite.plan", "titanlite.trainer", "titanlite.train"))
    ]
    assert not bad, "\n".join(bad)


def test_only_the_trainer_imports_the_loop():
    """The loop (``trainer.hooks``: Hook, LoopState, run_steps) and the hooks are the trainer's: ``checkpoint``,
    ``parallel`` and ``eval`` provide what a hook calls, never a hook."""
    loop = ("titanlite.trainer.hooks", "titanlite.trainer.trainer", "titanlite.trainer.eval_hook")
    owners = ("titanlite.checkpoint", "titanlite.parallel", "titanlite.eval")
    bad = [f"{m} imports {t}" for m, targets in graph().items() if m.startswith(owners) for t in targets if t in loop]
    assert not bad, "\n".join(bad)
