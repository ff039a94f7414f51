"""Every fenced block of README.md and docs/*.md, executed (or declared not to be, with the reason).

Blocks are found by ``find_blocks``: each fenced block of each page, named ``<page>#<heading slug>-<n>`` (the
n-th block under that heading). ``HOW`` is the one table that says how each is executed; a block without an
entry, or an entry without a block, fails ``test_every_block_has_an_entry``. Modes:

- ``run``: the bash block as written (after the entry's literal substitutions, each of which must match);
- ``sized``: as ``run``, but every real training command (``python -m titanlite.train``,
  ``bash scripts/run_train.sh``) gets ``TINY`` appended (a 1-layer, 2-step run; later flags win), every
  ``torchrun ... -m titanlite.train`` becomes the same command's dry run at its world size (GPUs, nodes or
  several CPU processes: the layout, not the training, is what a CPU test can check; parallel training
  itself is tested in tests/parallel/test_parallel_parity.py and friends), and checkpoint paths ``step-N`` under
  ``outputs/`` point at the 2-step runs' ``step-2``;
- ``help``: each program the block runs is asked for ``--help``, in this process (benchmarks: minutes of CPU
  or a GPU);
- ``python``: the snippet as a script; ``toml``: parsed and loaded through ``titanlite.models.load_config``
  (unknown keys fail); ``library``: executed by tests/test_library_examples.py (the test named);
  ``output``: program output shown as an example, not code; ``skip``: not executed, for the reason given.

Blocks run in a scratch copy of the checkout (symlinks; ``../shared`` beside it), so their ``outputs/`` and
``data/`` never land in the repository; its ``python`` and ``titanlite`` run titanlite's command lines forked from
the pytest process's fork server (tests/helpers/warm_python.py: a block's commands run as written, without importing
torch again for each); ``needs`` runs the blocks whose files a block reads first, once per
session (command 1's tiny debug run serves every block that reads ``outputs/debug_model``).
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import library_blocks
from tests.helpers.shared_data import SHARED_DATA
from tests.helpers.warm_python import WarmPython

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TINY = (
    "--training.steps 2 --model.n_layers 1 --training.seq_len 64 --training.local_batch_size 2 "
    "--training.global_batch_size 2 --lr_scheduler.warmup_steps 1 --validation.freq 2 --validation.steps 1 "
    "--metrics.log_freq 1"
)
TINY_MODEL = (
    "--model.n_layers 1 --training.seq_len 64 --training.local_batch_size 2 --training.global_batch_size 2 "
    "--validation.freq 2 --validation.steps 1 --metrics.log_freq 1"
)
TIMEOUT = 240


@dataclasses.dataclass(frozen=True)
class Block:
    id: str
    lang: str
    code: str
    line: int


def _slug(heading: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", heading.lower()).strip("-")


def find_blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown page (indented fences too), named by heading and position."""
    lines = path.read_text(encoding="utf-8").splitlines()
    page, heading, counts, blocks, i = path.relative_to(REPO).as_posix(), "top", {}, [], 0
    while i < len(lines):
        if m := re.match(r"#{1,6} (.*)", lines[i]):
            heading = _slug(m.group(1))
        if f := re.match(r"(\s*)```(\S*)\s*$", lines[i]):
            indent, lang, j = f.group(1), f.group(2), i + 1
            while not re.match(r"\s*```\s*$", lines[j]):
                j += 1
            counts[heading] = counts.get(heading, 0) + 1
            code = "\n".join(x[len(indent) :] for x in lines[i + 1 : j])
            blocks.append(Block(f"{page}#{heading}-{counts[heading]}", lang, code, i + 1))
            i = j
        i += 1
    return blocks


BLOCKS = {b.id: b for page in PAGES for b in find_blocks(page)}


@dataclasses.dataclass(frozen=True)
class How:
    mode: str  # run | sized | help | python | toml | library | output | skip
    reason: str = ""
    subs: tuple[tuple[str, str], ...] = ()  # literal replacements, each must occur in the block
    needs: tuple[str, ...] = ()  # blocks whose files this one reads
    setup: str = ""  # bash run first (the user's own files: SETUP_*)
    slow: bool = False


DEBUG = "README.md#quick-start-two-commands-fresh-machine-1"  # command 1, at TINY size: outputs/debug_model
OWN = "README.md#train-on-your-own-text-1"
SETUP_MY_TEXT = (
    f"mkdir -p my_text && head -n 400 {SHARED_DATA}/text/c4_sample.jsonl > my_text/c4.jsonl"  # real C4 lines
)
SETUP_LLAMA3 = (
    f"mkdir -p assets/llama3 && cp -f {SHARED_DATA}/tokenizers/test_tiktoken.model assets/llama3/tokenizer.model"
)
FINEWEB = (("/data/fineweb/sample-20BT", "my_text"), ("--workers 32", "--workers 2"))
STEP_19073 = ("outputs/llama1b/checkpoint/step-19073", "outputs/debug_model/checkpoint/step-100")
BENCH = "a benchmark: minutes of CPU or a GPU; its figures are docs/benchmarks.md's, its flags are checked here"
OUTPUT = "program output shown as an example"

HOW: dict[str, How] = {
    DEBUG: How(
        "sized",
        "command 2 (the whole suite) cannot run inside the suite: it runs ruff and collects one test file",
        subs=(("bash scripts/test.sh", "bash scripts/test.sh --collect-only -q tests/test_layers.py"),),
    ),
    "README.md#quick-start-two-commands-fresh-machine-2": How("run"),
    "README.md#quick-start-two-commands-fresh-machine-3": How("sized"),
    OWN: How("sized", "my_text/ is the user's: a C4 sample", setup=SETUP_MY_TEXT),
    "README.md#train-on-your-own-text-2": How("python", needs=(OWN,)),
    "README.md#continue-a-finished-run-1": How("sized", needs=(DEBUG,)),
    "README.md#continue-a-finished-run-2": How(
        "run",
        "a 1-layer model, 10 steps then 12 from step 2 (the debug run's 100 and 200 from step 10: minutes of CPU)",
        subs=(
            ("debug_model.toml", f"debug_model.toml {TINY_MODEL} --lr_scheduler.warmup_steps 1"),
            ("--checkpoint.interval 10 --job", "--checkpoint.interval 2 --training.steps 10 --job"),
            ("--checkpoint.interval 10 --training.steps 200", "--checkpoint.interval 2 --training.steps 12"),
            ("--checkpoint.load_step 10", "--checkpoint.load_step 2"),
        ),
    ),
    "README.md#use-titanlite-as-a-library-1": How("python"),
    "README.md#the-main-job-on-gpus-1": How(
        "sized",
        "the corpus and Meta's tokenizer are the user's: a C4 sample and a small tiktoken file",
        subs=FINEWEB,
        setup=f"{SETUP_MY_TEXT} && {SETUP_LLAMA3}",
        slow=True,
    ),
    "docs/benchmarks.md#llama-3-2-1b-seq-len-2048-one-gpu-h100-h200-1": How("help", BENCH),
    "docs/benchmarks.md#the-training-step-side-by-side-with-transformers-one-gpu-issue-26-1": How("help", BENCH),
    "docs/benchmarks.md#cpu-reference-2-cores-shared-machine-1": How("help", BENCH),
    "docs/benchmarks.md#mixture-of-experts-the-debug-moe-against-the-dense-debug-model-and-the-moe-layer-s-time-split-1": How(  # noqa: E501
        "help", BENCH
    ),
    "docs/benchmarks.md#pipeline-parallelism-on-cpu-pp-2-against-fsdp-2-and-the-bubble-1": How("help", BENCH),
    "docs/benchmarks.md#context-parallelism-one-attention-layer-s-peak-memory-at-16k-tokens-cp-2-and-4-against-one-process-1": How(  # noqa: E501
        "help", BENCH
    ),
    "docs/benchmarks.md#generation-the-static-kv-cache-eager-and-compiled-against-recomputing-and-against-5c7a1f4-1": How(  # noqa: E501
        "help", BENCH
    ),
    "docs/benchmarks.md#comparing-with-another-git-revision-development-only-1": How(
        "help", "a development benchmark (minutes); tests/tools/test_benchmarks_revision.py runs it at a tiny size"
    ),
    "docs/benchmarks.md#running-scripts-gpu-check-sh-on-the-gpu-machine-1": How(
        "skip",
        "the GPU machine's set-up: downloads a wheel from PyPI and runs scripts/gpu_check.sh --cpu (~9 min of "
        "compiles; its pieces are tested: tests/tools/test_bench_scripts.py, test_parallel_bench.py)",
    ),
    "docs/benchmarks.md#downstream-evaluation-scoring-1": How("help", BENCH),
    "docs/benchmarks.md#downstream-evaluation-scoring-2": How(
        "sized", "5 items per task on CPU", subs=(("--limit 1000", "--limit 5"),), needs=(DEBUG,), slow=True
    ),
    "docs/checkpoints.md#checkpoints-1": How(
        "sized",
        "the 1B run's checkpoint and Meta's HF model are not here: the tiny debug run and its own export",
        subs=(STEP_19073, ("path/to/Llama-3.2-1B", "hf_out")),
        needs=(DEBUG,),
    ),
    "docs/configuration.md#a-validation-folder-of-its-own-1": How(
        "sized",
        "my_held_out/ is the user's: C4 lines",
        setup=f"mkdir -p my_held_out && tail -n 200 {SHARED_DATA}/text/c4_sample.jsonl > my_held_out/c4.jsonl",
    ),
    "docs/configuration.md#the-output-layer-and-loss-in-chunks-1": How("help", BENCH),
    "docs/evaluation.md#see-what-the-model-learned-samples-downstream-scores-bits-per-byte-1": How("toml"),
    "docs/evaluation.md#generation-1": How("sized", needs=(DEBUG,)),
    "docs/evaluation.md#generation-2": How(
        "sized",
        "a window of 32 over 100 tokens (the tiny run trained on 64)",
        subs=(("--max-new-tokens 600 --context-window 256", "--max-new-tokens 100 --context-window 32"),),
        needs=(DEBUG,),
    ),
    "docs/evaluation.md#downstream-evaluation-1": How(
        "sized", "5 items per task on CPU", subs=(("--limit 1000", "--limit 5"),), needs=(DEBUG,)
    ),
    "docs/evaluation.md#downstream-evaluation-2": How("python"),
    "docs/extensions.md#writing-an-extension-1": How("toml"),
    "docs/extensions.md#writing-an-extension-2": How("sized", slow=True),
    "docs/layout.md#layout-1": How("output", "a file tree, not code"),
    "docs/memory_model.md#the-run-planner-s-memory-and-time-model-1": How("output", "a table of the memory terms"),
    "docs/memory_model.md#the-run-planner-s-memory-and-time-model-2": How(
        "output", "the activation formula; tests/plan/test_planner.py checks it against measured memory"
    ),
    "docs/library.md#models-1": How("python"),
    "docs/library.md#1-your-own-training-loop-1": How(
        "library", "test_own_loop_reproduces_the_trainer_bitwise (and on 2 processes)"
    ),
    "docs/library.md#1-your-own-training-loop-2": How(
        "library", "test_build_training_gives_a_foreign_loop_the_configs_policies_and_loss"
    ),
    "docs/library.md#3-checkpoint-and-resume-from-your-own-loop-1": How(
        "library", "test_checkpoint_and_resume_from_own_loop_is_identical_after_a_kill"
    ),
    "docs/library.md#4-a-model-family-of-your-own-with-the-stock-launcher-1": How(
        "library", "test_own_family_trains_with_the_stock_launcher_and_is_planned_exactly"
    ),
    "docs/library.md#4-a-model-family-of-your-own-with-the-stock-launcher-2": How(
        "sized",
        "gpt2_family.py is the page's previous block",
        setup="cp {block:docs/library.md#4-a-model-family-of-your-own-with-the-stock-launcher-1} gpt2_family.py",
        slow=True,
    ),
    "docs/library.md#5-the-pieces-one-by-one-prepared-shards-modelspec-trainstep-s-result-load-model-1": How(
        "python", needs=(OWN,)
    ),
    "docs/library.md#5-the-pieces-one-by-one-prepared-shards-modelspec-trainstep-s-result-load-model-2": How(
        "library", "test_the_least_model_spec_trains_and_its_step_result_is_the_direct_computation"
    ),
    "docs/library.md#5-the-pieces-one-by-one-prepared-shards-modelspec-trainstep-s-result-load-model-3": How(
        "python", subs=(("step-100", "step-2"),), needs=(DEBUG,)
    ),
    "docs/library.md#swapping-one-piece-of-the-stock-job-1": How(
        "library", "test_a_registered_loss_is_chosen_by_name_and_validation_stays_cross_entropy"
    ),
    "docs/monitoring.md#what-a-run-reports-1": How("output", OUTPUT),
    "docs/recipes.md#recipes-data-mixtures-token-budgets-sequence-length-stages-mid-training-and-sft-1": How(
        "sized",
        "the shipped configs read step-100 of the 100-step debug run: the tiny run's step-2 here; chat windows of "
        "256 tokens (64 would cut every reply)",
        subs=(
            (
                "debug_midtrain.toml ",
                "debug_midtrain.toml --checkpoint.initial_load_path outputs/debug_model/checkpoint/step-100 ",
            ),
            (
                "debug_sft.toml ",
                "debug_sft.toml --checkpoint.initial_load_path outputs/debug_model/checkpoint/step-100 ",
            ),
        ),
        needs=(DEBUG,),
        slow=True,
    ),
    "docs/recipes.md#recipes-data-mixtures-token-budgets-sequence-length-stages-mid-training-and-sft-2": How(
        "sized",
        needs=("docs/recipes.md#recipes-data-mixtures-token-budgets-sequence-length-stages-mid-training-and-sft-1",),
        slow=True,
    ),
    "docs/recipes.md#weighted-mixtures-1": How("toml"),
    "docs/recipes.md#sequence-length-stages-1": How("toml"),
    "docs/recipes.md#chat-data-mid-training-and-sft-1": How("run"),
    "docs/scale.md#plan-a-run-before-paying-for-it-1": How("run"),
    "docs/scale.md#plan-a-run-before-paying-for-it-2": How("output", OUTPUT),
    "docs/scale.md#from-raw-text-to-the-main-job-1": How(
        "sized",
        "the corpus and Meta's tokenizer are the user's: a C4 sample and a small tiktoken file",
        subs=(
            ("/path/to/original/tokenizer.model", f"{SHARED_DATA}/tokenizers/test_tiktoken.model"),
            ("--output data/fineweb_llama3", "--output data/fineweb_llama3_scale"),  # the README's block made the other
            *FINEWEB,
        ),
        setup=SETUP_MY_TEXT,
        slow=True,
    ),
    "docs/scale.md#multi-node-launch-1": How("sized", setup=SETUP_LLAMA3),
    "docs/scale.md#pipeline-parallelism-1": How("sized"),
    "docs/scale.md#context-parallelism-1": How("sized"),
    "docs/scale.md#context-parallelism-2": How("output", OUTPUT),
    "docs/scale.md#mixture-of-experts-and-expert-parallelism-1": How("sized", slow=True),
    "docs/scale.md#when-the-first-collective-hangs-1": How("sized", setup=SETUP_LLAMA3),
    "docs/scale.md#dry-run-without-gpus-1": How(
        "run", "Meta's tokenizer: a small tiktoken file", setup=SETUP_LLAMA3, slow=True
    ),
    "docs/scale.md#dry-run-without-gpus-2": How("output", OUTPUT),
    "docs/scale.md#dry-run-without-gpus-3": How("output", OUTPUT),
    "docs/torchtitan.md#torchtitan-interop-torchtitan-ext-compat-1": How(
        "sized",
        "a torchtitan checkout's config: its shipped llama3 8B TOML as tests/fixtures/torchtitan holds it; the "
        "bracket is the usage's optional overrides",
        subs=(
            ("path/to/torchtitan/llama3_8b.toml", "tests/fixtures/torchtitan/llama3_8b.toml"),
            (" [--section.key value ...]", " --translate-only"),
        ),
    ),
}


def _join_continuations(code: str) -> list[str]:
    return code.replace("\\\n", " ").splitlines()


def _strip_comment(line: str) -> str:
    return re.sub(r"\s+#\s.*$", "", line) if not line.lstrip().startswith("#") else ""


def _world_size(launcher: list[str]) -> int:
    opts = {k: v for k, v in zip(launcher, launcher[1:]) if k.startswith("--")}
    return int(opts.get("--nnodes", 1)) * int(opts.get("--nproc-per-node", 1))


def sized(code: str) -> str:
    """``code`` at CPU size: see the module docstring."""
    out = []
    for line in _join_continuations(code):
        line = _strip_comment(line)
        line = re.sub(r"(outputs/[\w.]+/checkpoint/step-)\d+", r"\g<1>2", line)
        if m := re.search(r"\btorchrun (.*?)-m titanlite\.train\b", line):
            world = _world_size(shlex.split(m.group(1)))
            line = line.replace(m.group(0), "python -m titanlite.train")
            line += f" --job.dry_run true --job.dry_run_world_size {world}"
        elif re.search(r"-m titanlite\.train\b|\btitanlite train\b|scripts/run_train\.sh", line) and (
            "--job.dry_run true" not in line
        ):
            line += " " + TINY + (" --training.seq_len 256" if "debug_sft" in line or "debug_midtrain" in line else "")
        out.append(line)
    return "\n".join(out)


def help_targets(code: str) -> list[str]:
    """The programs the block's commands run (``titanlite <command>``, ``scripts/x.py`` or ``-m module``), each once,
    in order."""
    pattern = r"(?<![\w.-])(titanlite (?:(?:bench|convert) )?[\w-]+|scripts/\w+\.py|-m [\w.]+)"
    found = [m.group(1) for line in _join_continuations(code) if (m := re.search(pattern, line))]
    return list(dict.fromkeys(found))


def run_help(target: str, cwd: Path) -> str:
    """``target --help`` in this process (torch is imported once, not per command): its usage text."""
    import contextlib
    import io
    import runpy

    from titanlite import cli

    out, argv, old_cwd = io.StringIO(), sys.argv, os.getcwd()
    sys.argv = [target.removeprefix("-m "), "--help"]
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
            if target.startswith("titanlite "):
                raise SystemExit(cli.main([*target.split()[1:], "--help"]))
            elif target.startswith("-m "):
                runpy.run_module(target.removeprefix("-m "), run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
    finally:
        sys.argv = argv
        os.chdir(old_cwd)
    assert e.value.code in (0, None), f"{target} --help: exit {e.value.code}"
    assert "usage:" in out.getvalue(), f"{target} --help printed no usage"
    return out.getvalue()


class Workspace:
    """A scratch checkout: symlinks to the repository's folders, its own outputs/ and data/."""

    def __init__(self, root: Path):
        self.root = root / "titanlite"
        self.root.mkdir()
        (root / "shared").symlink_to(SHARED_DATA.parent)
        for name in (
            "titanlite",
            "train_configs",
            "scripts",
            "benchmarks",
            "tests",
            "torchtitan_ext",
            "pyproject.toml",
            "constraints.txt",
        ):
            (self.root / name).symlink_to(REPO / name)
        venv = self.root / ".venv"  # the repository's environment, marked installed (no pip from a scratch copy)
        venv.mkdir()
        for entry in (REPO / ".venv").iterdir():
            if not entry.name.startswith(".titanlite-installed") and entry.name != "bin":
                (venv / entry.name).symlink_to(entry)
        for extras in ("base", "test"):
            (venv / f".titanlite-installed-{extras}").touch()
        self.warm = WarmPython(str(REPO / ".venv" / "bin" / "python"))
        (venv / "bin").mkdir()  # its python and titanlite fork titanlite's command lines (tests/helpers/warm_python.py)
        for entry in (REPO / ".venv" / "bin").iterdir():
            warm = "titanlite" if entry.name == "titanlite" else "python" if entry.name.startswith("python") else None
            (venv / "bin" / entry.name).symlink_to(self.warm.bin / warm if warm else entry)
        self.done: dict[str, float] = {}

    def bash(self, script: str, what: str) -> None:
        threads = os.environ.get("OMP_NUM_THREADS", "2")  # scripts/test.sh: 1 (its workers share the cores)
        env = dict(os.environ, OMP_NUM_THREADS=threads, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(self.root))
        out = subprocess.run(
            ["bash", "-c", f"set -eo pipefail\nsource .venv/bin/activate\nexport PATH={self.warm.bin}:$PATH\n{script}"],
            cwd=self.root,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            start_new_session=True,
        )
        assert out.returncode == 0, (
            f"{what}: exit {out.returncode}\n{script}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        )

    def run(self, block_id: str) -> None:
        if block_id in self.done:
            return
        how, block = HOW[block_id], BLOCKS[block_id]
        for need in how.needs:
            self.run(need)
        start = time.perf_counter()
        code = block.code
        for old, new in how.subs:
            assert old in code, f"{block_id}: the substitution {old!r} no longer matches the block"
            code = code.replace(old, new)
        setup = re.sub(r"\{block:([^}]+)\}", lambda m: self.write(BLOCKS[m.group(1)]), how.setup)
        if how.mode in ("run", "sized"):
            body = code if how.mode == "run" else sized(code)
            self.bash(f"{setup}\n{body}" if setup else body, block_id)
        elif how.mode == "help":
            targets = help_targets(code)
            assert targets, f"{block_id}: no scripts/*.py or -m module to ask for --help"
            for target in targets:
                run_help(target, self.root)
        elif how.mode == "python":
            self.bash(f"python {self.write(dataclasses.replace(block, code=code))}", block_id)
        elif how.mode == "toml":  # in this process: the config parser checks every section and key
            from titanlite.models import load_config

            sys.path.insert(0, str(REPO))  # [job] extensions = ["torchtitan_ext.qwen3"]
            try:
                load_config(["--config", self.write(block, ".toml")])
            finally:
                sys.path.remove(str(REPO))
        self.done[block_id] = time.perf_counter() - start

    def write(self, block: Block, suffix: str = ".py") -> str:
        path = self.root.parent / "blocks" / (_slug(block.id) + suffix)  # outside the checkout: ruff skips it
        path.parent.mkdir(exist_ok=True)
        path.write_text(block.code + "\n")
        return str(path)


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    if not (REPO / ".venv" / "bin" / "python").exists():
        pytest.skip("no .venv in the repository (bash scripts/setup_env.sh test)")
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared test data not found at {SHARED_DATA}")
    workspace = Workspace(tmp_path_factory.mktemp("docs"))
    yield workspace
    workspace.warm.close()


def test_every_block_has_an_entry():
    missing = sorted(set(BLOCKS) - set(HOW))
    stale = sorted(set(HOW) - set(BLOCKS))
    assert not missing, "blocks with no entry in tests/test_docs.py HOW: " + ", ".join(
        f"{b} (line {BLOCKS[b].line})" for b in missing
    )
    assert not stale, "entries of HOW with no block (renamed or moved?): " + ", ".join(stale)
    for block_id, how in HOW.items():
        assert how.mode in ("run", "sized", "help", "python", "toml", "library", "output", "skip"), block_id
        assert how.reason or how.mode in ("run", "sized", "python", "toml"), f"{block_id}: say why ({how.mode})"
        if how.mode in ("run", "sized", "help"):
            assert BLOCKS[block_id].lang == "bash", block_id
        if how.mode in ("python", "library"):
            assert BLOCKS[block_id].lang == "python", block_id


def test_library_blocks_are_the_ones_test_library_examples_runs():
    ran = {library_blocks.LOOP, library_blocks.CKPT, library_blocks.FAMILY, library_blocks.LOSS, library_blocks.BUILD}
    ran |= {library_blocks.SPEC}
    module = ast.parse((REPO / "tests" / "test_library_examples.py").read_text(encoding="utf-8"))
    tests = {node.name for node in module.body if isinstance(node, ast.FunctionDef)}
    for block_id, how in HOW.items():
        if how.mode == "library":
            assert BLOCKS[block_id].code + "\n" in ran or BLOCKS[block_id].code in ran, block_id
            assert how.reason.split()[0] in tests, f"{block_id}: no test {how.reason.split()[0]}"


def _params():
    for block_id, how in HOW.items():
        if how.mode in ("run", "sized", "help", "python", "toml"):
            yield pytest.param(block_id, id=block_id, marks=[pytest.mark.slow] if how.slow else [])


@pytest.mark.parametrize("block_id", list(_params()))
def test_block(block_id, workspace):
    workspace.run(block_id)


def test_docs_run_in_scratch_not_in_the_repository():
    """The blocks write outputs/ and data/ in the scratch copy; the repository ignores both anyway."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    for path in ("outputs/x", "data/x"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO, check=False).returncode == 0, path
