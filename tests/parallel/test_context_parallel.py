"""Context parallelism against one process (CPU, gloo): the tiny parity run of tests/helpers/parity.py.

Each configuration trains 6 steps from the one-process run's seed weights and must log the same losses and grad
norms, and end with the same weights, within ``RTOL`` (1e-5 relative, all fp32: only summation orders differ).
Weights compare by each tensor's norm: Adam divides each gradient element by its own magnitude, so an element
whose gradient is near 0 moves by up to the learning rate on a summation-order difference (the largest
element's difference is printed too).
Two launches: 2 processes run CP 2 causal (with validation under CP, and a checkpoint at step 3), CP 2 with
documents (full AC), and a 1-block, 3-step CP 2 with documents eager and then compiled with the ``aot_eager``
backend (equal within ``RTOL``); 4 processes run CP 4 causal and with documents, CP 2 x FSDP 2 (per-op AC),
CP 2 x TP 2 (a checkpoint at step 3), CP 2 x PP 2, and resume CP 2 x TP 2's checkpoint under CP 4. The pytest
process resumes the CP 2 checkpoint under CP 1.

Documents: a text corpus of short documents (3 to 12 bytes), so that at ``seq_len`` 32 and 8 chunks (CP 4) the
documents cross the chunk boundaries (block-causal attention, the true document ids).
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from tests.helpers.dist import cache_token_stores, run_workers
from tests.helpers.parity import HALF, STEPS, make_config

RTOL = 1e-5
CP = "--parallelism.context_parallel_degree"
NO_VAL = ["--validation.enable", "false"]
AC_FULL = ["--activation_checkpoint.mode", "full"]  # the recomputed forward all-gathers K/V again, on every rank
AC_OP = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
SHORT = ["--model.n_layers", "1", "--training.steps", "3"]
# Dynamo and AOTAutograd trace the blocks around CP's eager attention, as for inductor; the traced graphs run with
# eager kernels (inductor's own code on DTensor-free graphs is the single-process tests' job)
COMPILE = ["--compile.enable", "true", "--compile.components", "model", "--compile.backend", "aot_eager"]
CHECKPOINT = [
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    str(HALF),
    "--checkpoint.last_save_model_only",
    "false",
]


def documents_options(folder: str) -> list[str]:
    return ["--model.attn_mask_type", "block_causal", "--training.dataset", "text", "--training.dataset_path", folder]


def write_documents(folder) -> str:
    """Many short text documents (one file each)."""
    rng = random.Random(0)
    folder.mkdir(exist_ok=True)
    for i in range(400):
        text = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(3, 12)))
        (folder / f"{i:03d}.txt").write_text(text)
    return str(folder)


def train(dump: str, dp: int, extra: list[str], seed_state: dict | None) -> dict:
    """Train from ``seed_state`` (None: resume from ``dump``'s checkpoint, or start from the seed's initialization
    without one); losses, grad norms, final weights, the graphs torch.compile made."""
    from torch._dynamo.utils import counters

    from titanlite.parallel.state_dict import load_full_state_dict
    from titanlite.trainer import Trainer

    graphs = counters["stats"]["unique_graphs"]
    trainer = Trainer(make_config(dump, dp, extra))
    if seed_state is not None:
        load_full_state_dict(trainer.model, seed_state)
    return summary(trainer, trainer.train()) | {"compiled_graphs": counters["stats"]["unique_graphs"] - graphs}


def summary(trainer, records: list[dict]) -> dict:
    """What the comparisons read from a finished run."""
    state = trainer.model.state_dict()
    return {
        "flops_per_token": trainer.flops_per_token,  # what MFU counts
        "loss": [r["loss"] for r in records if "loss" in r],
        "grad_norm": [r["grad_norm"] for r in records if "grad_norm" in r],
        "val_loss": [r["val_loss"] for r in records if "val_loss" in r],
        "tokens_seen": [r["tokens_seen"] for r in records if "loss" in r],
        "weights": {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()
        },
    }


def copy_checkpoint(src, dst) -> None:
    """``src``'s run folder as ``dst``, its checkpoint of step ``HALF`` the newest."""
    shutil.copytree(src, dst)
    shutil.rmtree(f"{dst}/checkpoint/step-{STEPS}")


def worker(args: dict) -> dict:
    """Each run of ``args["runs"]`` in turn; after the one named ``args["copy_after"]`` rank 0 copies its folder
    for a resume."""
    import torch.distributed as dist

    cache_token_stores()
    out = {}
    for name, (dump, dp, extra, kind) in args["runs"].items():
        out[name] = train(dump, dp, extra, args["seeds"].get(kind))
        if name == args.get("copy_after"):
            if dist.get_rank() == 0:
                copy_checkpoint(dump, args["runs"]["resume cp2->cp4"][0])
            dist.barrier()
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One-process runs, causal and with documents, and their seed weights."""
    cache_token_stores()
    from titanlite.trainer import Trainer

    root = tmp_path_factory.mktemp("cp")
    docs = write_documents(root / "docs")
    out = {"root": root, "docs": docs, "seeds": {}}
    for kind, extra in (("causal", []), ("documents", documents_options(docs) + NO_VAL)):
        trainer = Trainer(make_config(str(root / f"ref_{kind}"), 1, extra))
        out["seeds"][kind] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        out[kind] = summary(trainer, trainer.train())
    return out


def compare(name: str, got: dict, ref: dict, report: list, first: int = 0, rtol: float = RTOL) -> None:
    """Losses, grad norms, validation losses (from step ``first + 1``) and final weights within ``rtol``; the
    tokens counted (each once: tokens/s and MFU divide them by the world) exactly."""
    for key in ("loss", "grad_norm", "val_loss"):
        a, b = torch.tensor(got[key], dtype=torch.float64), torch.tensor(ref[key][first:], dtype=torch.float64)
        if key == "val_loss" and not (len(a) and len(b)):  # validation off, or not after the resume
            continue
        assert len(a) == len(b), (name, key, got[key], ref[key])
        rel = ((a - b).abs() / b.abs()).max().item()
        report.append(f"{name:16s} {key:9s} max rel diff {rel:.1e}")
        assert rel <= rtol, f"{name}: {key} differs from one process by {rel:.2e}\n{a}\n{b}"
    assert got["tokens_seen"] == ref["tokens_seen"][first:], f"{name}: tokens counted {got['tokens_seen']}"
    worst = elementwise = 0.0
    for k, w in got["weights"].items():  # a pipeline rank holds its stage's only
        r = ref["weights"][k]
        worst = max(worst, ((w - r).norm() / r.norm()).item())
        elementwise = max(elementwise, ((w - r).abs().max() / r.abs().max()).item())
    report.append(
        f"{name:16s} weights   max rel diff {worst:.1e} (of a tensor's norm; largest element {elementwise:.1e})"
    )
    assert worst <= rtol, f"{name}: final weights differ by {worst:.2e}"


def runs_for(reference, specs: dict) -> dict:
    root = reference["root"]
    return {name: (str(root / name), dp, extra, kind) for name, (dp, extra, kind) in specs.items()}


@pytest.mark.multiprocess
def test_context_parallel_two_processes(reference):
    """CP 2 (causal, validation under CP, a checkpoint at step HALF; documents) equals one process; compiled CP 2
    equals eager CP 2; the CP 2 checkpoint resumes under CP 1 with the uninterrupted run's next losses; MFU counts
    attention at the whole sequence; the final CP 2 checkpoint loads for scoring and generation."""
    docs = documents_options(reference["docs"]) + NO_VAL
    specs = {
        "cp2": (1, [CP, "2", *CHECKPOINT], "causal"),
        "cp2_documents": (1, [CP, "2", *docs, *AC_FULL], "documents"),
    }
    short = {  # 1 block, 3 steps, from the seed's initialization: eager, then compiled (documents)
        name: (1, [CP, "2", *docs, *SHORT, *extra], "init")
        for name, extra in (("cp2_eager", []), ("cp2_compiled", COMPILE))
    }
    runs = runs_for(reference, specs | short)
    results = run_workers(worker, 2, {"runs": runs, "seeds": reference["seeds"]}, timeout=300)
    report = []
    for name, (_, _, kind) in (specs | short).items():
        assert results[0][name]["loss"] == results[1][name]["loss"], f"{name}: ranks disagree"
        if kind != "init":
            compare(name, results[0][name], reference[kind], report)
    compiled, eager = results[0]["cp2_compiled"], results[0]["cp2_eager"]
    assert compiled["compiled_graphs"] > 0 and eager["compiled_graphs"] == 0
    compare("cp2 compiled", compiled, eager, report)
    root = reference["root"]
    copy_checkpoint(root / "cp2", root / "resume_cp1")
    resumed = train(str(root / "resume_cp1"), 1, CHECKPOINT, None)
    compare("resume cp2->cp1", resumed, reference["causal"], report, first=HALF)
    check_flops(results[0]["cp2"], reference["causal"])
    check_generation(root / "cp2" / "checkpoint" / f"step-{STEPS}", results[0]["cp2"], reference["causal"], report)
    print("\n".join(report))


def check_flops(got: dict, ref: dict) -> None:
    """MFU's FLOPs per token under CP count attention at the whole sequence length (32), as one process does:
    PaLM's ``6 N + 12 L H D S`` (``N``: the matmul parameters, the embedding table only looked up)."""
    n = sum(w.numel() for k, w in ref["weights"].items() if k != "tok_embeddings.weight")
    layers, heads, head_dim, seq_len = 2, 4, 16, 32
    assert got["flops_per_token"] == ref["flops_per_token"] == 6 * n + 12 * layers * heads * head_dim * seq_len


def check_generation(step_folder, got: dict, ref: dict, report: list) -> None:
    """A checkpoint trained under CP loads on one process for scoring and generation: the logits of the CP run's
    final weights exactly, close to the one-process run's; greedy generation as from those weights."""
    import copy

    from titanlite.checkpoint.load_model import load_model
    from titanlite.generate import generate

    loaded = load_model(step_folder)
    twin, single = copy.deepcopy(loaded.model), copy.deepcopy(loaded.model)
    twin.load_state_dict(got["weights"])
    single.load_state_dict(ref["weights"])
    tokens = torch.randint(0, loaded.args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, want, one = (m(tokens) for m in (loaded.model, twin, single))
    assert torch.equal(logits, want), "the loaded checkpoint's logits are not the CP run's"
    rel = ((logits - one).norm() / one.norm()).item()
    report.append(f"{'cp2 -> generate':16s} logits    rel diff {rel:.1e} from the one-process model")
    assert rel <= RTOL
    prompts = [tokens[0, :8].tolist()]
    assert generate(loaded.model, prompts, max_new_tokens=6) == generate(twin, prompts, max_new_tokens=6)


@pytest.mark.multiprocess
def test_context_parallel_four_processes(reference):
    """CP 4 (causal and with documents), CP 2 x FSDP 2, CP 2 x TP 2 and CP 2 x PP 2 equal one process; CP 2 x TP 2's
    checkpoint of step HALF resumes under CP 4 (causal) with the uninterrupted run's next losses and weights."""
    docs = documents_options(reference["docs"]) + NO_VAL
    pp = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "4"]
    specs = {
        "cp4": (1, [CP, "4", *NO_VAL], "causal"),
        "cp4_documents": (1, [CP, "4", *docs], "documents"),
        "cp2_fsdp2": (2, [CP, "2", "--parallelism.data_parallel_shard_degree", "2", *NO_VAL, *AC_OP], "causal"),
        "cp2_tp2": (1, [CP, "2", "--parallelism.tensor_parallel_degree", "2", *NO_VAL, *CHECKPOINT], "causal"),
        "cp2_pp2": (1, [CP, "2", *pp, *NO_VAL], "causal"),
    }
    runs = runs_for(reference, specs)
    runs["resume cp2->cp4"] = (str(reference["root"] / "resume_cp4"), 1, [CP, "4", *NO_VAL, *CHECKPOINT], None)
    args = {"runs": runs, "seeds": reference["seeds"], "copy_after": "cp2_tp2"}
    results = run_workers(worker, 4, args, timeout=300)
    report = []
    for name, (_, _, kind) in specs.items():
        compare(name, results[-1][name], reference[kind], report)
    compare("resume cp2->cp4", results[0]["resume cp2->cp4"], reference["causal"], report, first=HALF)
    print("\n".join(report))
