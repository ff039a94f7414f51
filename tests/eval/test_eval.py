"""Downstream benchmarks (titanlite.eval) against independent references.

- Per-item log-likelihoods equal transformers' (LlamaForCausalLM on the HF export of the same briefly
  trained debug checkpoint, one unpadded sequence at a time) within 1e-4, and the predictions and
  LAMBADA's greedy verdicts are the ones transformers' numbers give, for a few items of every task.
- The metrics equal a hand computation from the per-item records.
- 2 gloo ranks (a plain model split by dp_rank, then an FSDP-sharded one): the per-item records are
  bitwise those of one process, with a limit the rank count does not divide; a TP-2 model (vocabulary-
  sharded DTensor logits) gives them within 1e-4.
- Left truncation to max_seq_len, counted; label parsing on real ARC/PIQA items; malformed files.
- The CLI: its JSON, and one-line errors with exit status 2.

The eval data is the shared folder's (tests/helpers/shared_data.py): tests skip when it is absent.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.helpers.dist import run_workers
from tests.helpers.launch import run_python
from tests.helpers.shared_data import shared_file
from titanlite.checkpoint.load_model import load_model
from titanlite.eval import ClozeTask, Item, MultipleChoiceTask, evaluate, get_task, register_task, task_names
from titanlite.eval.cli import main
from titanlite.trainer.runtime import Runtime

REPO = Path(__file__).resolve().parents[2]
TASKS = ["hellaswag", "hellaswag_llmc", "arc_easy", "arc_challenge", "piqa", "lambada_openai"]
ATOL = 1e-4
TRAIN_STEPS = 8

pytestmark = pytest.mark.usefixtures("one_thread")


def env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="module")
def data_dir() -> Path:
    return shared_file("eval/README.md").parent


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The debug model after a few training steps on the built-in corpus (a model-only step folder)."""
    dump = tmp_path_factory.mktemp("debug")
    cmd = [sys.executable, "-m", "titanlite.train", "--config", "train_configs/debug_model.toml"]
    cmd += ["--job.dump_folder", str(dump), "--training.steps", str(TRAIN_STEPS), "--training.seq_len", "128"]
    cmd += ["--training.local_batch_size", "8", "--training.global_batch_size", "8", "--lr_scheduler.warmup_steps", "2"]
    cmd += ["--validation.enable", "false", "--metrics.enable_tensorboard", "false"]
    cmd += ["--checkpoint.enable", "--checkpoint.interval", str(TRAIN_STEPS)]
    proc = run_python(cmd, cwd=REPO, env=env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dump / "checkpoint" / f"step-{TRAIN_STEPS}"


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_model(checkpoint)


@pytest.fixture(scope="module")
def results(loaded, data_dir) -> dict:
    """Every task, 3 items each, batches of 4 requests of different lengths (so padding is exercised)."""
    return evaluate(loaded.model, loaded.tokenizer, TASKS, data_dir, limit=3, batch_size=4)


def hf_loglik(hf_model, ids: list[int], num_cont: int) -> tuple[float, bool]:
    """transformers' summed log-prob of the last ``num_cont`` of ``ids`` (one unpadded sequence), and
    whether each of those tokens is the argmax."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids[:-1]])).logits[0].double()
    positions = range(len(ids) - 1 - num_cont, len(ids) - 1)
    logprobs = torch.log_softmax(logits, dim=-1)
    total = sum(logprobs[p, ids[p + 1]].item() for p in positions)
    greedy = all(logits[p].argmax().item() == ids[p + 1] for p in positions)
    return total, greedy


def test_logliks_and_predictions_equal_transformers(checkpoint, loaded, results, data_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    from titanlite.checkpoint.hf_export import dcp_to_hf

    hf_dir = dcp_to_hf(checkpoint, tmp_path / "hf")
    hf_model = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir), attn_implementation="eager").eval()
    tok = loaded.tokenizer
    for name in TASKS:
        items = get_task(name).items(data_dir)[:3]
        records = results[name]["items"]
        assert [r["index"] for r in records] == [0, 1, 2]
        for item, rec in zip(items, records):
            context = tok.encode(item.context, bos=True)
            assert context[0] == tok.bos_id
            refs = [hf_loglik(hf_model, context + tok.encode(c), len(tok.encode(c))) for c in item.choices]
            assert rec["num_tokens"] == [len(tok.encode(c)) for c in item.choices]
            for got, (want, _) in zip(rec["loglik"], refs):
                assert abs(got - want) <= ATOL, (name, rec["index"], got, want)
            ref_ll = [ll for ll, _ in refs]
            if name == "lambada_openai":
                assert rec["pred"] == int(refs[0][1]) and rec["label"] == 1
            else:
                assert rec["label"] == item.label
                assert rec["pred"] == max(range(len(ref_ll)), key=ref_ll.__getitem__)
                per = (
                    rec["num_tokens"] if name == "hellaswag_llmc" else [len(c.removeprefix(" ")) for c in item.choices]
                )
                norm = [ll / n for ll, n in zip(ref_ll, per)]
                assert rec["pred_norm"] == max(range(len(norm)), key=norm.__getitem__)


def test_metrics_are_computed_from_the_items(results, data_dir):
    for name in TASKS:
        res, records = results[name], results[name]["items"]
        assert res["num_items"] == len(records) == 3 and res["num_truncated"] == 0
        if name == "lambada_openai":
            assert res["acc"] == sum(r["pred"] for r in records) / 3
            assert math.isclose(res["perplexity"], math.exp(-sum(r["loglik"][0] for r in records) / 3), rel_tol=1e-12)
            continue
        acc = sum(r["loglik"].index(max(r["loglik"])) == r["label"] for r in records) / 3
        items = get_task(name).items(data_dir)[:3]
        lengths = [
            r["num_tokens"] if name == "hellaswag_llmc" else [len(c) - 1 for c in i.choices]
            for r, i in zip(records, items)
        ]
        norms = [[ll / n for ll, n in zip(r["loglik"], per)] for r, per in zip(records, lengths)]
        acc_norm = sum(nm.index(max(nm)) == r["label"] for nm, r in zip(norms, records)) / 3
        assert (res["acc"], res["acc_norm"]) == (acc, acc_norm), name


def test_the_model_mode_is_restored_and_a_briefly_trained_model_beats_nothing_by_chance(loaded, data_dir):
    """evaluate() puts a training model in eval mode and back; the scores are real numbers."""
    loaded.model.train()
    out = evaluate(loaded.model, loaded.tokenizer, ["piqa"], data_dir, limit=2, batch_size=16)
    assert loaded.model.training
    loaded.model.eval()
    assert all(math.isfinite(ll) and ll < 0 for r in out["piqa"]["items"] for ll in r["loglik"])


def test_bf16_autocast_is_applied_and_stays_close(loaded, results, data_dir):
    out = evaluate(
        loaded.model,
        loaded.tokenizer,
        ["arc_easy"],
        data_dir,
        limit=3,
        batch_size=4,
        runtime=Runtime(torch.device("cpu"), compute_dtype=torch.bfloat16),
    )
    got = [ll for r in out["arc_easy"]["items"] for ll in r["loglik"]]
    want = [ll for r in results["arc_easy"]["items"] for ll in r["loglik"]]
    assert got != want  # bf16 matmuls ran
    assert all(abs(a - b) <= 0.02 * abs(b) for a, b in zip(got, want)), (got, want)


# ----------------------------------------------------------------------------- several ranks


DIST_TASKS = ["arc_challenge", "piqa", "lambada_openai"]
DIST_LIMIT = 5  # 5 items a task: 20 + 10 + 5 = 35 requests, 9 batches of 4 over 2 ranks (rank 1: one dummy forward)


def dist_worker(args: dict) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from titanlite.parallel.build import build_parallel_model
    from titanlite.parallel.distributed import init_distributed, world_from_env
    from titanlite.parallel.parallel_dims import ParallelDims
    from titanlite.parallel.state_dict import load_full_state_dict

    world = world_from_env()
    init_distributed(world, timeout_seconds=120)
    rank = dist.get_rank()
    plain = load_model(args["checkpoint"])
    replicas = ParallelDims(dp_replicate=2, dp_shard=1, world_size=2)  # no mesh: the items' share by rank only
    common = dict(limit=DIST_LIMIT, batch_size=4, runtime=Runtime(torch.device("cpu"), replicas))
    out = {"plain": evaluate(plain.model, plain.tokenizer, DIST_TASKS, args["data_dir"], **common)}
    dims = ParallelDims(dp_shard=2, world_size=2)
    dims.build_mesh("cpu")
    sharded = build_parallel_model(plain.spec, plain.args, dims, device="cpu")
    load_full_state_dict(sharded, plain.model.state_dict() if rank == 0 else None)
    assert type(sharded.tok_embeddings.weight).__name__ == "DTensor"
    out["fsdp"] = evaluate(sharded, plain.tokenizer, DIST_TASKS, args["data_dir"], **common)
    # tensor parallel with loss parallel: vocabulary-sharded DTensor logits; both ranks are one DP rank
    dims = ParallelDims(dp_shard=1, tp=2, world_size=2)
    dims.build_mesh("cpu")
    tp_model = build_parallel_model(plain.spec, plain.args, dims, device="cpu")
    load_full_state_dict(tp_model, plain.model.state_dict() if rank == 0 else None)
    assert isinstance(tp_model(torch.zeros(1, 8, dtype=torch.long)), DTensor)
    out["tp"] = evaluate(tp_model, plain.tokenizer, DIST_TASKS, args["data_dir"], limit=DIST_LIMIT, batch_size=4)
    return out  # dist_utils ends the worker without interpreter finalization (gloo teardown aborts)


def test_two_ranks_give_the_records_of_one_process(checkpoint, loaded, data_dir):
    one = evaluate(loaded.model, loaded.tokenizer, DIST_TASKS, data_dir, limit=DIST_LIMIT, batch_size=4)
    per_rank = run_workers(dist_worker, 2, dict(checkpoint=str(checkpoint), data_dir=str(data_dir)), timeout=240)
    for rank, out in enumerate(per_rank):
        for kind in ("plain", "fsdp"):
            for name in DIST_TASKS:
                assert out[kind][name] == one[name], (rank, kind, name)  # floats compared exactly
        for name in DIST_TASKS:  # TP sums in another order (K-split matmuls, sharded log-sum-exp): not bitwise
            for got, want in zip(out["tp"][name]["items"], one[name]["items"]):
                assert max(abs(a - b) for a, b in zip(got["loglik"], want["loglik"])) <= ATOL, (rank, name)
                assert (got["pred"], got["pred_norm"]) == (want["pred"], want["pred_norm"]), (rank, name)


# ----------------------------------------------------------------------------- the scorer's paths


def per_request_logliks(model, tok, data_dir, tasks, limit, max_len) -> list[float]:
    """The scoring before shared contexts and device-side gathers, written out: each request alone, cut
    from the left to ``max_len + 1`` tokens, through the plain forward; fp32 log-softmax, summed on the host."""
    out = []
    for name in tasks:
        for item in get_task(name).items(data_dir)[:limit]:
            context = tok.encode(item.context, bos=True)
            for choice in item.choices:
                cont = tok.encode(choice)
                ids = (context + cont)[-(max_len + 1) :]
                with torch.no_grad():
                    logprobs = torch.log_softmax(model(torch.tensor([ids[:-1]]))[0].float(), dim=-1)
                out.append(sum(float(logprobs[p, ids[p + 1]]) for p in range(len(ids) - 1 - len(cont), len(ids) - 1)))
    return out


SCORED = ["hellaswag", "arc_easy", "lambada_openai"]


def test_scores_eager_and_compiled_equal_the_per_request_logliks(data_dir, monkeypatch):
    """Shared contexts (HellaSwag, ARC), single requests (LAMBADA), left truncation (max_seq_len 160), eager
    and compiled: within 1e-5 of each request scored alone. Eagerly, one device-to-host read per batch."""
    from torch._dynamo.utils import counters

    from tests.helpers.llama import tiny_args, titanlite_model
    from titanlite.eval.packing import canonical_batches, group_requests
    from titanlite.eval.scoring import build_requests, compiled_forward
    from titanlite.tokenizer import build_byte_tokenizer

    # one block: what is tested is the scoring around the model
    model, tok, max_len = titanlite_model(tiny_args(max_seq_len=160, n_layers=1)), build_byte_tokenizer(), 160
    want = per_request_logliks(model, tok, data_dir, SCORED, 3, max_len)
    loaded_items = [get_task(name).items(data_dir)[:3] for name in SCORED]
    requests = build_requests(loaded_items, tok, max_len)
    groups = group_requests(requests, share_context=True)
    assert any(g.shared for g in groups) and any(not g.shared for g in groups) and any(r.truncated for r in requests)
    batches = len(canonical_batches(groups, 4))
    reads = []
    for name in ("item", "tolist", "cpu"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: reads.append(_n) or _o(self, *a, **k)
        )
    eager = evaluate(model, tok, SCORED, data_dir, limit=3, batch_size=4)
    assert len(reads) == batches, reads
    monkeypatch.undo()
    # compiled: traced by dynamo (dynamic shapes, the KV cache's arguments) and AOTAutograd, and run as traced
    # ("aot_eager"): inductor's code for these graphs would be C++ on this CPU, not a GPU's kernels
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    compiled_forward.cache_clear()
    graphs = counters["stats"]["unique_graphs"]
    try:
        compiled = evaluate(model, tok, SCORED, data_dir, limit=3, batch_size=4, compile=True)
    finally:
        compiled_forward.cache_clear()
    assert counters["stats"]["unique_graphs"] > graphs
    for out in (eager, compiled):
        got = [ll for name in SCORED for r in out[name]["items"] for ll in r["loglik"]]
        assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) <= 1e-5


def test_a_family_without_the_cache_or_max_seq_len(data_dir):
    """A family of one's own: no cache protocol (scored one request a row), no args.max_seq_len (a
    one-line error naming max_seq_len, not an IndexError from its position table); with max_seq_len it
    scores each request as it would alone."""
    from tests.helpers.families import NoCacheLM
    from titanlite.tokenizer import build_byte_tokenizer

    tok = build_byte_tokenizer()
    model = NoCacheLM(vocab=tok.vocab_size, dim=8, positions=128).eval()
    with pytest.raises(ValueError, match="NoCacheLM takes is unknown .*: pass max_seq_len=N") as e:
        evaluate(model, tok, ["piqa"], data_dir, limit=2)
    assert "\n" not in str(e.value)
    got = evaluate(model, tok, ["arc_easy", "lambada_openai"], data_dir, limit=2, max_seq_len=128)
    want = per_request_logliks(model, tok, data_dir, ["arc_easy", "lambada_openai"], 2, 128)
    lls = [ll for name in ("arc_easy", "lambada_openai") for r in got[name]["items"] for ll in r["loglik"]]
    assert max(abs(a - b) for a, b in zip(lls, want)) <= 1e-5 and got["lambada_openai"]["num_truncated"] == 2


# ----------------------------------------------------------------------------- truncation


def test_items_longer_than_max_seq_len_are_truncated_from_the_left_and_counted(loaded, data_dir):
    """With 100 input tokens, HellaSwag's first item fits (69 tokens at most) and the next two do not
    (up to 114 and 279): their long requests keep their last 101 tokens, which a plain forward pass on
    exactly those tokens scores the same, and 2 items are counted."""
    tok, model, max_len = loaded.tokenizer, loaded.model, 100
    items = get_task("hellaswag").items(data_dir)[:3]
    out = evaluate(model, tok, ["hellaswag"], data_dir, limit=3, batch_size=16, max_seq_len=max_len)
    too_long = 0
    for item, rec in zip(items, out["hellaswag"]["items"]):
        context = tok.encode(item.context, bos=True)
        too_long += any(len(context) + len(tok.encode(c)) > max_len + 1 for c in item.choices)
        for choice, got in zip(item.choices, rec["loglik"]):
            cont = tok.encode(choice)
            ids = (context + cont)[-(max_len + 1) :]
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([ids[:-1]]))[0].double(), dim=-1)
            want = sum(logprobs[p, ids[p + 1]].item() for p in range(len(ids) - 1 - len(cont), len(ids) - 1))
            assert abs(got - want) <= 1e-5
    assert too_long == 2 and out["hellaswag"]["num_truncated"] == 2
    full = evaluate(model, tok, ["hellaswag"], data_dir, limit=3, batch_size=16)
    assert full["hellaswag"]["num_truncated"] == 0
    fits, cut = full["hellaswag"]["items"][0], out["hellaswag"]["items"][0]  # the item that fits: unchanged, up to
    assert {k: v for k, v in fits.items() if k != "loglik"} == {k: v for k, v in cut.items() if k != "loglik"}
    assert max(abs(a - b) for a, b in zip(fits["loglik"], cut["loglik"])) <= 1e-5  # its batch's other shapes
    assert full["hellaswag"]["items"][2]["loglik"] != out["hellaswag"]["items"][2]["loglik"]


class LongChoices(MultipleChoiceTask):
    name = "test_long_choices"
    files = ("long_choices.jsonl",)

    def item(self, row):
        return Item(row["q"], tuple(row["choices"]), row["answer"])


LONG_ITEMS = [
    {"q": "Question: pick one.", "choices": [" a choice far longer than the window", " no"], "answer": 1},
    {"q": "Q", "choices": [" yes", " no"], "answer": 0},  # fits: scored whole
]


def left_truncated_loglik(model, context: list[int], cont: list[int], max_len: int) -> float:
    """lm-eval's window written out: of context + choice, the last ``max_len + 1`` tokens; one plain forward over
    all but the last; the log-probability of each choice token in the window (the window's first token is only
    read), summed in float64."""
    ids = (context + cont)[-(max_len + 1) :]
    scored = min(len(cont), len(ids) - 1)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids[:-1]]))[0].double(), dim=-1)
    return sum(logprobs[p, ids[p + 1]].item() for p in range(len(ids) - 1 - scored, len(ids) - 1))


def test_a_choice_longer_than_max_seq_len_is_cut_from_the_left(tmp_path):
    """A choice of 35 tokens with max_seq_len 8 stopped the whole run with a message naming no task. It is cut as
    lm-eval cuts every request: the last 9 tokens of context + choice, 8 of them scored; the model's log-likelihood
    of that window, computed directly, is what evaluate reports (cached and plain batches). The cut is made before
    the forward pass; compiled scoring of cut requests: test_scores_eager_and_compiled_equal_the_per_request_logliks."""
    from tests.helpers.llama import tiny_args, titanlite_model
    from titanlite.tokenizer import build_byte_tokenizer

    if LongChoices.name not in task_names():
        register_task(LongChoices)
    write(tmp_path / "long_choices.jsonl", "".join(json.dumps(row) + "\n" for row in LONG_ITEMS))
    model, tok, max_len = titanlite_model(tiny_args()), build_byte_tokenizer(), 8
    out = evaluate(model, tok, [LongChoices.name], tmp_path, max_seq_len=max_len, batch_size=3)
    result = out[LongChoices.name]
    assert result["num_truncated"] == 1 and result["num_items"] == 2
    for row, record in zip(LONG_ITEMS, result["items"]):
        context = tok.encode(row["q"], bos=True)
        conts = [tok.encode(choice) for choice in row["choices"]]
        want = [left_truncated_loglik(model, context, cont, max_len) for cont in conts]
        assert max(abs(a - b) for a, b in zip(record["loglik"], want)) <= 1e-5, (record["loglik"], want)
        assert record["num_tokens"] == [min(len(c), max_len) for c in conts]
    assert len(tok.encode(LONG_ITEMS[0]["choices"][0])) > max_len and result["items"][0]["num_tokens"][0] == max_len


def test_a_choice_with_no_token_names_its_task(tmp_path):
    """The one error left in building requests names the task, the item and the choice."""
    from tests.helpers.llama import tiny_args, titanlite_model
    from titanlite.tokenizer import build_byte_tokenizer

    class DropsNo:  # a tokenizer that encodes " no" to nothing
        def __init__(self):
            self.inner = build_byte_tokenizer()

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def encode(self, text, bos=False):
            return [] if text == " no" else self.inner.encode(text, bos=bos)

    if LongChoices.name not in task_names():
        register_task(LongChoices)
    write(tmp_path / "long_choices.jsonl", "".join(json.dumps(row) + "\n" for row in LONG_ITEMS))
    with pytest.raises(ValueError) as e:
        evaluate(titanlite_model(tiny_args()), DropsNo(), [LongChoices.name], tmp_path, max_seq_len=8)
    assert str(e.value) == "test_long_choices: item 0 choice 1 (' no') encodes to no token to score"


# ----------------------------------------------------------------------------- data files


@pytest.mark.parametrize(
    "task, line, label, choices",
    [
        ("arc_easy", 1, 0, 4),  # letters, answer A
        ("arc_easy", 15, 1, 4),  # digits 1-4, answer "2"
        ("arc_easy", 94, 1, 3),  # 3 choices
        ("arc_easy", 501, 1, 5),  # 5 choices A-E
        ("arc_challenge", 386, 1, 3),  # 3 choices labelled with digits
    ],
)
def test_arc_labels(data_dir, task, line, label, choices):
    items = get_task(task).items(data_dir)
    row = json.loads((data_dir / get_task(task).files[0]).read_text().splitlines()[line - 1])
    item = items[line - 1]
    assert (item.label, len(item.choices)) == (label, choices)
    assert item.context == f"Question: {row['question']['stem']}\nAnswer:"
    assert item.choices[label] == " " + next(
        c["text"] for c in row["question"]["choices"] if c["label"] == row["answerKey"]
    )


def test_piqa_labels_come_from_the_labels_file(data_dir):
    items = get_task("piqa").items(data_dir)
    assert len(items) == 1838 and [i.label for i in items[:4]] == [0, 1, 1, 1]
    assert items[2].context == "Question: To fight Ivan Drago in Rocky for sega master system.\nAnswer:"
    assert items[2].choices[1] == " You have to defeat Apollo Creed and Clubber Lang first."


def test_item_counts_and_formats(data_dir):
    """The published item counts, and lm-eval's HellaSwag / LAMBADA rendering (more in test_eval_definitions.py)."""
    counts = {
        "hellaswag": 10042,
        "hellaswag_llmc": 10042,
        "arc_easy": 2376,
        "arc_challenge": 1172,
        "lambada_openai": 5153,
    }
    for name, n in counts.items():
        assert len(get_task(name).items(data_dir)) == n, name
    hs = get_task("hellaswag").items(data_dir)[0]
    assert hs.context == "Roof shingle removal: A man is sitting on a roof. He" and hs.label == 3
    assert hs.choices[3] == " starts pulling up roofing on a roof."
    lam = get_task("lambada_openai").items(data_dir)[0]
    assert lam.context.endswith("I don't care about") and lam.choices == (" signs",)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "rel, text, message",
    [
        ("arc/ARC-Easy-Test.jsonl", '{"question": {"stem": "q", "choices": []}}\n{oops\n', r"ARC-Easy-Test.jsonl:1: "),
        ("arc/ARC-Easy-Test.jsonl", "\n{oops\n", r"ARC-Easy-Test.jsonl:2: not a JSON object"),
        (
            "arc/ARC-Easy-Test.jsonl",
            '{"question": {"stem": "q", "choices": [{"text": "a", "label": "A"}, {"text": "c", "label": "C"}]}, '
            '"answerKey": "B"}\n',
            r"ARC-Easy-Test.jsonl:1: answerKey 'B' is none of the choice labels \['A', 'C'\]",
        ),
        ("lambada/lambada_test.jsonl", '{"txt": "a b"}\n', r"lambada_test.jsonl:1: missing field 'text'"),
        (
            "hellaswag/hellaswag_val.jsonl",
            '{"ctx": "c", "endings": ["x", "y"], "label": 3}\n',
            r"field 'label' is 3, which does not index the 2 endings",
        ),
    ],
)
def test_a_malformed_file_names_the_file_and_line(tmp_path, rel, text, message):
    path = write(tmp_path / rel, text)
    name = {"arc": "arc_easy", "lambada": "lambada_openai", "hellaswag": "hellaswag_llmc"}[rel.split("/")[0]]
    with pytest.raises(ValueError, match=message) as e:
        get_task(name).items(tmp_path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_piqa_label_file_problems(tmp_path):
    row = json.dumps({"goal": "g", "sol1": "a", "sol2": "b"}) + "\n"
    write(tmp_path / "piqa/valid.jsonl", row * 2)
    write(tmp_path / "piqa/valid-labels.lst", "0\n")
    with pytest.raises(ValueError, match=r"valid-labels.lst: 1 labels, but .*valid.jsonl has more questions"):
        get_task("piqa").items(tmp_path)
    write(tmp_path / "piqa/valid-labels.lst", "0\n2\n")
    with pytest.raises(ValueError, match=r"valid-labels.lst:2: expected a label 0 or 1, got '2'"):
        get_task("piqa").items(tmp_path)
    write(tmp_path / "piqa/valid-labels.lst", "0\n1\n1\n")
    with pytest.raises(ValueError, match=r"3 labels for the 2 questions"):
        get_task("piqa").items(tmp_path)
    (tmp_path / "piqa/valid-labels.lst").unlink()
    with pytest.raises(ValueError, match=r"valid-labels.lst: no such file \(the piqa task reads"):
        get_task("piqa").items(tmp_path)


def test_unknown_and_repeated_task_names(loaded, data_dir):
    with pytest.raises(
        ValueError, match=r"unknown eval task 'hellaswg' \(known: hellaswag, .*did you mean 'hellaswag'"
    ):
        get_task("hellaswg")
    with pytest.raises(ValueError, match="'piqa' is given more than once"):
        evaluate(loaded.model, loaded.tokenizer, ["piqa", "piqa"], data_dir, limit=1)


def test_a_task_of_ones_own_is_one_small_class(loaded, tmp_path):
    """The README's recipe: a registered subclass is scored like the built-ins (here a one-item
    multiple-choice task and a cloze task whose answers we know the log-likelihood ordering of)."""

    class Capitals(MultipleChoiceTask):
        name = "test_capitals"
        files = ("capitals.jsonl",)

        def item(self, row):
            return Item(row["q"], tuple(" " + c for c in row["choices"]), row["answer"])

    class Echo(ClozeTask):
        name = "test_echo"
        files = ("echo.jsonl",)

        def item(self, row):
            return Item(row["text"], (row["word"],), 0)

    if "test_capitals" not in task_names():
        register_task(Capitals)
        register_task(Echo)
    with pytest.raises(ValueError, match="an eval task named 'piqa' is already registered"):
        register_task(type("Other", (MultipleChoiceTask,), {"name": "piqa"}))
    write(tmp_path / "capitals.jsonl", json.dumps({"q": "x", "choices": ["a", "b"], "answer": 1}) + "\n")
    write(tmp_path / "echo.jsonl", json.dumps({"text": "abc", "word": "d"}) + "\n")
    out = evaluate(loaded.model, loaded.tokenizer, ["test_capitals", "test_echo"], tmp_path)
    rec = out["test_capitals"]["items"][0]
    assert rec["num_tokens"] == [2, 2] and rec["label"] == 1 and out["test_capitals"]["num_items"] == 1
    assert out["test_capitals"]["acc"] == float(rec["loglik"][1] > rec["loglik"][0])
    assert out["test_echo"]["perplexity"] == pytest.approx(math.exp(-out["test_echo"]["items"][0]["loglik"][0]))


# ----------------------------------------------------------------------------- the command line


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "titanlite.eval", *args]
    return run_python(cmd, cwd=REPO, env=env(), timeout=timeout)


def test_cli_writes_the_results_as_json(checkpoint, data_dir, tmp_path, loaded):
    out = tmp_path / "results.json"
    proc = run_cli(
        "--checkpoint",
        str(checkpoint),
        "--tasks",
        "arc_easy,lambada_openai",
        "--limit",
        "2",
        "--batch-size",
        "3",
        "--data-dir",
        str(data_dir),
        "--output",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["arc_easy", "lambada_openai"]
    assert "acc_norm" in lines[0] and "perplexity" in lines[1] and lines[0].endswith("(2 items)")
    data = json.loads(out.read_text())
    assert set(data) == {"arc_easy", "lambada_openai", "step", "checkpoint"}
    assert data["step"] == TRAIN_STEPS and data["checkpoint"] == str(checkpoint)
    mc = {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "num_items", "num_truncated", "items"}
    assert set(data["arc_easy"]) == mc and " ± " in lines[0]
    assert set(data["lambada_openai"]) == {"acc", "acc_stderr", "perplexity", "num_items", "num_truncated", "items"}
    assert set(data["arc_easy"]["items"][0]) == {"index", "label", "loglik", "num_tokens", "pred", "pred_norm"}
    lib = evaluate(loaded.model, loaded.tokenizer, ["arc_easy", "lambada_openai"], data_dir, limit=2, batch_size=3)
    assert data["arc_easy"] == lib["arc_easy"] and data["lambada_openai"] == lib["lambada_openai"]
    assert not [p for p in tmp_path.iterdir() if p.name != "results.json"]  # no temporary file left


def test_cli_bad_task_exits_2_with_one_line_naming_the_known_ones(data_dir):
    proc = run_cli("--checkpoint", "nowhere", "--tasks", "piqa,hellaswg", "--data-dir", str(data_dir), timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: unknown eval task 'hellaswg' (known: hellaswag, hellaswag_llmc, arc_easy, arc_challenge, piqa, "
        "lambada_openai); "
        "did you mean 'hellaswag'?"
    ]


def one_error_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and captured.out == "", captured
    return lines[0]


def test_cli_user_errors_are_one_line_and_leave_the_output_alone(capsys, checkpoint, data_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("TITANLITE_EVAL_DATA", raising=False)
    out = write(tmp_path / "old.json", '{"kept": true}')
    base = ["--checkpoint", str(checkpoint), "--tasks", "piqa", "--output", str(out)]
    assert "pass --data-dir or set $TITANLITE_EVAL_DATA" in one_error_line(capsys, base)
    partial = write(tmp_path / "data/piqa/valid.jsonl", "{}\n").parents[1]
    line = one_error_line(capsys, [*base, "--data-dir", str(partial)])
    assert f"{partial}/piqa/valid-labels.lst: no such file" in line
    empty = tmp_path / "empty"
    empty.mkdir()
    line = one_error_line(
        capsys, ["--checkpoint", str(empty), "--tasks", "piqa", "--data-dir", str(data_dir), "--output", str(out)]
    )
    assert "neither a titanlite checkpoint step folder nor a Hugging Face model folder" in line
    assert "--limit must be at least 1" in one_error_line(capsys, [*base, "--data-dir", str(data_dir), "--limit", "0"])
    assert "--batch-size: invalid int value" in one_error_line(
        capsys, [*base, "--data-dir", str(data_dir), "--batch-size", "x"]
    )
    assert "--max-seq-len must be at least 1" in one_error_line(
        capsys, [*base, "--data-dir", str(data_dir), "--max-seq-len", "0"]
    )
    assert "one of the arguments --checkpoint --watch is required" in one_error_line(capsys, ["--tasks", "piqa"])
    assert out.read_text() == '{"kept": true}'


def test_cli_max_seq_len_is_passed_to_evaluate(checkpoint, loaded, data_dir, tmp_path, capsys):
    out = tmp_path / "short.json"
    argv = ["--checkpoint", str(checkpoint), "--tasks", "hellaswag", "--limit", "2", "--data-dir", str(data_dir)]
    assert main([*argv, "--max-seq-len", "100", "--output", str(out)]) == 0
    lib = evaluate(loaded.model, loaded.tokenizer, ["hellaswag"], data_dir, limit=2, max_seq_len=100)
    assert json.loads(out.read_text())["hellaswag"] == lib["hellaswag"] and lib["hellaswag"]["num_truncated"] == 1


def test_cli_output_is_checked_before_scoring(capsys, checkpoint, data_dir, tmp_path, monkeypatch):
    """A run's own files are refused, and so is a folder that cannot be written, before the model is even loaded."""
    import titanlite.eval.cli as cli

    def no_scoring(*args, **kwargs):
        raise AssertionError("scoring started although --output is unusable")

    monkeypatch.setattr(cli, "load_model", no_scoring)
    dump = checkpoint.parents[1]  # the run's dump folder: metrics.jsonl, config.toml, the run lock
    metrics = (dump / "metrics.jsonl").read_bytes()
    notes = write(dump / "notes.txt", "my notes")
    base = ["--checkpoint", str(checkpoint), "--tasks", "piqa", "--data-dir", str(data_dir), "--output"]
    for out in (dump / "metrics.jsonl", dump / "summary.json", notes, dump / "checkpoint" / ".titanlite.lock"):
        line = one_error_line(capsys, [*base, str(out)])
        assert line.startswith(f"error: --output {out}: a file of the run folder {out.parent} that is not an eval"), (
            line
        )
    assert (dump / "metrics.jsonl").read_bytes() == metrics and notes.read_text() == "my notes"
    unwritable = Path("/sys/titanlite-eval.json")  # not writable even by root
    try:
        tempfile.NamedTemporaryFile(dir=unwritable.parent).close()
        pytest.skip("no unwritable folder here")
    except OSError:
        pass
    assert one_error_line(capsys, [*base, str(unwritable)]).startswith(f"error: --output {unwritable}: cannot write")
    earlier = write(dump / "eval.json", json.dumps({"step": 1, "checkpoint": str(checkpoint)}))
    cli.check_output(str(earlier))  # an earlier eval output in the run folder may be replaced
    cli.check_output(str(dump / "checkpoint" / "scores.json"))  # so may a new file there
    assert not [p for p in dump.rglob(".eval-output-check-*")]  # the write check leaves nothing behind
