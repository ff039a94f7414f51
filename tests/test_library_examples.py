"""docs/library.md's "Use titanlite as a library" examples, executed as written (sizes shrunk where said).

1. the foreign loop equals ``Trainer`` (what ``python -m titanlite.train`` runs) bit for bit;
2. the same loop on 2 processes (FSDP 2, TP 2) equals it within fp32 summation order;
3. checkpoint and resume from the foreign loop, with a user ``Stateful``: identical after a SIGKILL;
4. the GPT-2-style family trains through the stock launcher alike on 1 process and FSDP 2, and
   ``titanlite estimate`` counts its parameters exactly;
and the loss swap: a registered loss named in the config, validation still plain cross-entropy; the least
``ModelSpec`` that ``build_parallel_model`` builds, and the ``TrainStep`` result fields the page lists.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.helpers.dist import run_workers
from tests.helpers.launch import run_python
from tests.helpers.library_blocks import BUILD, CKPT, FAMILY, LOOP, LOSS, SPEC

REPO = Path(__file__).resolve().parents[1]
RTOL = 2e-5  # fp32 summation order across ranks (see tests/parallel/test_parallel_parity.py)
README_ARGS = '"--model.n_layers", "2", "--training.steps", "20"]'
SMALL = ["--training.steps", "6", "--training.seq_len", "64", "--lr_scheduler.warmup_steps", "2"]


def shrink(code: str, extra: list[str] = ()) -> str:
    """The README loop with fewer, shorter steps (and ``extra`` config arguments)."""
    assert README_ARGS in code
    args = ", ".join(f'"{a}"' for a in [*SMALL, *extra])
    return code.replace(README_ARGS, f'"--model.n_layers", "2", {args}]')


def run_loop(env: dict) -> list[float]:
    """Example 1 in this process (or a worker of run_workers): returns its losses."""
    os.environ.update(env)
    namespace: dict = {}
    exec(compile(shrink(LOOP), "docs/library.md", "exec"), namespace)
    return namespace["losses"]


def trainer_run(tmp_path, extra: list[str] = ()) -> list[dict]:
    from titanlite.models import load_config
    from titanlite.trainer import Trainer

    cfg = load_config(
        [
            "--config",
            "train_configs/debug_model.toml",
            "--model.n_layers",
            "2",
            *SMALL,
            *extra,
            "--metrics.log_freq",
            "1",
            "--validation.enable",
            "false",
            "--job.dump_folder",
            str(tmp_path),
        ]
    )
    return Trainer(cfg).train()


def trainer_losses(tmp_path) -> list[float]:
    return [r["loss"] for r in trainer_run(tmp_path) if "loss" in r]


@pytest.fixture(scope="module")
def single_process_losses():
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        return run_loop({})
    finally:
        os.chdir(cwd)


def test_own_loop_reproduces_the_trainer_bitwise(single_process_losses, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    assert len(single_process_losses) == 6 and single_process_losses[-1] < single_process_losses[0]
    assert single_process_losses == trainer_losses(tmp_path)


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp", ["1", "2"], ids=["fsdp2", "tp2"])
def test_own_loop_on_two_processes_matches_one(tp, single_process_losses):
    results = run_workers(run_loop, 2, {"TP": tp}, timeout=240)
    assert results[0] == results[1]  # every rank logs the global loss
    torch.testing.assert_close(torch.tensor(results[0]), torch.tensor(single_process_losses), rtol=RTOL, atol=0)


def _run_script(path: Path, *, kill_after: str | None = None) -> list[str]:
    """Run ``path`` from the repository root; with ``kill_after``, SIGKILL it once that line appears (a fresh
    interpreter, read line by line; without, forked from the fork server: tests/helpers/launch.py)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if kill_after is None:
        done = run_python([sys.executable, str(path)], cwd=REPO, env=env)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return [x for x in done.stdout.splitlines() if x.startswith("step ")]
    proc = subprocess.Popen(
        [sys.executable, str(path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith(kill_after):
                os.killpg(proc.pid, signal.SIGKILL)
                break
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL, "\n".join(lines[-20:])
    return [x for x in lines if x.startswith("step ")]


def test_checkpoint_and_resume_from_own_loop_is_identical_after_a_kill(tmp_path):
    setup = LOOP[: LOOP.index("batches, losses = iter(loader), []")]
    extra = ["--checkpoint.enable", "true", "--checkpoint.interval", "2", "--checkpoint.async_mode", "async"]
    scripts = {}
    for name in ("straight", "killed"):
        code = shrink(setup, extra) + CKPT.replace("outputs/my_loop/checkpoint", str(tmp_path / name / "checkpoint"))
        scripts[name] = tmp_path / f"{name}.py"
        scripts[name].write_text(code)
    straight = _run_script(scripts["straight"])
    assert [x.split()[1] for x in straight] == [str(i) for i in range(1, 7)]
    first = _run_script(scripts["killed"], kill_after="step 5 ")
    resumed = _run_script(scripts["killed"])
    start = int(resumed[0].split()[1])
    assert start in (3, 5)  # from the step-2 or step-4 checkpoint, whichever was complete at the kill
    assert first == straight[: len(first)] and resumed == straight[start - 1 :]  # loss and token counter, exactly


def _family_run(tmp_path: Path, name: str, launcher: list[str]) -> list[float]:
    dump = tmp_path / name
    cmd = [
        *launcher,
        "-m",
        "titanlite.train",
        "--job.extensions",
        "gpt2_family",
        "--model.name",
        "gpt2",
        "--model.flavor",
        "tiny",
        "--training.seq_len",
        "64",
        "--training.steps",
        "5",
        "--training.global_batch_size",
        "16",
        "--metrics.log_freq",
        "1",
        "--validation.enable",
        "false",
        "--lr_scheduler.warmup_steps",
        "1",
        "--job.dump_folder",
        str(dump),
    ]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""
    )
    if launcher == [sys.executable]:  # one process: forked from the fork server (tests/helpers/launch.py)
        out = run_python(cmd, cwd=REPO, env=env, timeout=240)
    else:
        out = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240, start_new_session=True
        )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [json.loads(x)["loss"] for x in (dump / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


@pytest.mark.multiprocess
def test_own_family_trains_with_the_stock_launcher_and_is_planned_exactly(tmp_path):
    (tmp_path / "gpt2_family.py").write_text(FAMILY)
    one = _family_run(tmp_path, "one", [sys.executable])
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2"]
    two = _family_run(tmp_path, "fsdp2", torchrun)
    assert len(one) == 5 and one[-1] < one[0]
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=RTOL, atol=0)

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    out = run_python(
        [
            sys.executable,
            "-m",
            "titanlite",
            "estimate",
            "--job.extensions",
            "gpt2_family",
            "--model.name",
            "gpt2",
            "--model.flavor",
            "124M",
            "--training.seq_len",
            "1024",
            "--gpu",
            "H100",
            "--num-gpus",
            "8",
            "--tokens",
            "10e9",
            "--json",
        ],
        cwd=REPO,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    V, S, d, L = 50257, 1024, 768, 12
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    assert json.loads(out.stdout)["params"] == V * d + S * d + L * block + 2 * d == 124_439_808


def test_a_registered_loss_is_chosen_by_name_and_validation_stays_cross_entropy(tmp_path, monkeypatch):
    from titanlite.models import load_config
    from titanlite.trainer import Trainer

    (tmp_path / "my_loss.py").write_text(LOSS)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = [
        "--model.dim",
        "64",
        "--model.n_layers",
        "2",
        "--model.n_heads",
        "4",
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        "1",
        "--lr_scheduler.warmup_steps",
        "0",
        "--validation.enable",
        "true",
        "--validation.steps",
        "1",
        "--job.extensions",
        "my_loss",
    ]
    plain = Trainer(load_config([*args, "--job.dump_folder", str(tmp_path / "a")]))
    z = Trainer(load_config([*args, "--training.loss", "z_loss", "--job.dump_folder", str(tmp_path / "b")]))
    batch = next(iter(plain.build_train_dataloader()))  # a loader of its own: the trainer's has not started
    with torch.no_grad():
        lse = torch.logsumexp(plain.model(batch["input_ids"]).float(), -1)
    assert plain.validate() == z.validate()  # validation: plain cross-entropy for both
    (rp,), (rz,) = ([r for r in t.train() if "loss" in r] for t in (plain, z))
    assert rz["loss"] - rp["loss"] == pytest.approx(1e-4 * lse.pow(2).mean().item(), rel=1e-3)


def test_a_registered_trainer_is_chosen_from_the_stock_command_line(tmp_path):
    """An extension's Trainer subclass, named in [job] trainer, runs under ``python -m titanlite.train``
    (where train.py is also ``__main__``: the class the extension subclasses must be the registered one)."""
    ext = """
        from pathlib import Path

        from titanlite.components import register
        from titanlite.trainer.hooks import Hook
        from titanlite.train import Trainer


        class Marker(Hook):
            def __init__(self, path):
                self.path = path

            def on_train_end(self, state):
                self.path.write_text(str(state.step))


        class MyTrainer(Trainer):
            def build_hooks(self):
                return super().build_hooks() + [Marker(Path(self.cfg.job.dump_folder) / "marker")]


        register("trainer", "mine", MyTrainer)
    """
    (tmp_path / "my_trainer.py").write_text(textwrap.dedent(ext))
    args = [
        "--model.dim",
        "64",
        "--model.n_layers",
        "1",
        "--model.n_heads",
        "4",
        "--training.seq_len",
        "32",
        "--training.steps",
        "2",
        "--lr_scheduler.warmup_steps",
        "0",
        "--validation.enable",
        "false",
    ]
    cmd = [sys.executable, "-m", "titanlite.train", *args, "--job.extensions", "my_trainer", "--job.trainer", "mine"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]), OMP_NUM_THREADS="1")
    out = run_python([*cmd, "--job.dump_folder", str(tmp_path / "run")], cwd=REPO, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "run" / "marker").read_text() == "2"


def loop_with_build_training(code: str) -> str:
    """Example 1 with the README's replacement: from ``args = ...`` to ``step = TrainStep(...)`` becomes the
    ``build_training`` block, the loader kept."""
    lines = code.splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if line.startswith("args = model_args_for("))
    last = next(i for i, line in enumerate(lines) if line.startswith("step = TrainStep("))
    statement = lines[last]
    while statement.count("(") > statement.count(")"):  # a statement over several lines: to its closing ")"
        last += 1
        statement += lines[last]
    loader = "".join(lines[first : last + 1])
    loader = loader[loader.index("loader = build_dataloader(") : loader.index("accum = ")]
    return "".join(lines[:first]) + BUILD + loader + "".join(lines[last + 1 :])


def test_build_training_gives_a_foreign_loop_the_configs_policies_and_loss(tmp_path, monkeypatch):
    """bf16 autocast, full activation checkpointing and a named loss (the README's z_loss): the README loop with
    ``build_training`` equals the trainer bit for bit; example 1 as written does not (it drops all three)."""
    monkeypatch.chdir(REPO)
    (tmp_path / "my_loss.py").write_text(LOSS)  # the README's z_loss, as the loss-swap test names it
    monkeypatch.syspath_prepend(str(tmp_path))
    policies = ["--training.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode", "full"]
    policies += [
        "--job.extensions",
        "my_loss",
        "--training.loss",
        "z_loss",
        "--training.steps",
        "3",
        "--training.global_batch_size",
        "-1",
    ]
    policies += [
        "--training.local_batch_size",
        "2",
        "--model.dim",
        "64",
        "--model.n_heads",
        "4",
        "--model.n_kv_heads",
        "2",
    ]
    # few, small steps of a narrow model: bf16 matmuls run at ~2 GFLOP/s on some CPUs

    def run(code: str) -> list[float]:
        namespace: dict = {}
        exec(compile(shrink(code, policies), "docs/library.md", "exec"), namespace)
        return namespace["losses"]

    expected = [r["loss"] for r in trainer_run(tmp_path, policies) if "loss" in r]
    assert run(loop_with_build_training(LOOP)) == expected
    assert run(LOOP) != expected


def test_the_least_model_spec_trains_and_its_step_result_is_the_direct_computation():
    """The block with a ModelSpec of name, args_cls, flavors and model_cls only: its step's loss and gradient
    norm equal plain autograd on a model drawn with the same seed (the token mean over both micro-batches), its
    update equals AdamW's after clipping to max_norm, and the page names every StepResult field."""
    import dataclasses

    from titanlite.trainer.step import StepResult

    namespace: dict = {}
    exec(compile(SPEC, "docs/library.md", "exec"), namespace)
    result, model = namespace["result"], namespace["model"]
    with torch.device("meta"):  # as build_parallel_model does: the constructor draws nothing
        plain = namespace["TinyLM"](namespace["TinyArgs"]())
    plain.to_empty(device="cpu")
    torch.manual_seed(0)
    plain.init_weights()
    logits = [plain(b["input_ids"]) for b in namespace["micro_batches"]]
    labels = [b["labels"] for b in namespace["micro_batches"]]
    loss = sum(
        torch.nn.functional.cross_entropy(x.flatten(0, 1), y.flatten(), reduction="sum") for x, y in zip(logits, labels)
    )
    loss = loss / sum(y.numel() for y in labels)
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in plain.parameters()]))
    torch.testing.assert_close(result.loss_value, loss.item(), rtol=1e-6, atol=0)
    torch.testing.assert_close(result.grad_norm_value, norm.item(), rtol=1e-5, atol=0)
    assert (result.step, result.action, result.tokens, result.lr) == (1, "update", 128, 0.01)
    torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
    torch.optim.AdamW(plain.parameters(), lr=1e-2).step()
    for (name, got), want in zip(model.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=name)
    page = (REPO / "docs" / "library.md").read_text()
    section = page[page.index("**`TrainStep`'s result.**") : page.index("**Loading a trained model.**")]
    missing = [f.name for f in dataclasses.fields(StepResult) if f"`{f.name}`" not in section]
    assert not missing, f"docs/library.md does not name these StepResult fields: {missing}"
