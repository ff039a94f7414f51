"""The built-in eval tasks against lm-evaluation-harness's own definitions, pinned as data.

``fixtures/lm_eval/definitions.json`` holds, for a few items of each task (the first ones and edge
cases: WikiHow headers, an empty ``ctx_b``, endings that clean to a leading space, 3- and 5-choice
and digit-labelled ARC items, LAMBADA passages with double spaces), the requests lm-eval 0.4.13
builds from its shipped task YAML files, the lengths its ``acc_norm`` divides by, the gold index, and
its ``process_results`` on made-up log-likelihoods (``make_definitions.py`` beside it wrote it; lm-eval
is not needed here). titanlite's items and per-item verdicts must equal them, so a change on either
side shows up as a failing test. Also: llm.c's HellaSwag variant, the metrics' standard errors, the
renamed LAMBADA task, and the type checks on eval files (issue 27, item 11).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from tests.helpers.shared_data import shared_file
from titanlite.config import parse_config
from titanlite.eval import get_task
from titanlite.eval.tasks import Item

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "lm_eval" / "definitions.json"
DEFINITIONS = json.loads(FIXTURE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def data_dir() -> Path:
    return shared_file("eval/README.md").parent


def pinned(task: str) -> list[dict]:
    return DEFINITIONS["tasks"][task]


def test_the_pinned_definitions_cover_every_built_in_lm_eval_task():
    assert DEFINITIONS["lm_eval_version"] == "0.4.13"
    assert set(DEFINITIONS["tasks"]) == {"hellaswag", "arc_easy", "arc_challenge", "piqa", "lambada_openai"}


@pytest.mark.parametrize("task", sorted(DEFINITIONS["tasks"]))
def test_prompts_targets_and_normalizers_are_lm_evals(data_dir, task):
    """Context and continuation strings (lm-eval moves a context's trailing spaces into the continuation
    before encoding: none of these contexts has any, so the strings are the scored ones), the lengths
    acc_norm divides by, and the gold index."""
    items = get_task(task).items(data_dir)
    for want in pinned(task):
        item = items[want["index"]]
        assert item.context == want["context"], (task, want["index"])
        assert list(item.choices) == want["continuations"], (task, want["index"])
        assert item.context == item.context.rstrip()
        if "gold" in want:
            assert item.label == want["gold"] and list(item.lengths()) == want["norm_lengths"], (task, want["index"])


@pytest.mark.parametrize("task", sorted(set(DEFINITIONS["tasks"]) - {"lambada_openai"}))
def test_acc_and_acc_norm_verdicts_are_lm_evals(data_dir, task):
    """lm-eval's process_results on given log-likelihoods vs titanlite's record on the same numbers."""
    chosen, items = get_task(task), get_task(task).items(data_dir)
    for want in pinned(task):
        item, lls = items[want["index"]], want["logliks"]
        record = chosen.record(want["index"], item, lls, [1] * len(lls), [False] * len(lls))
        got = {"acc": float(record["pred"] == item.label), "acc_norm": float(record["pred_norm"] == item.label)}
        assert got == want["lm_eval_results"], (task, want["index"])


def test_hellaswag_llmc_keeps_llm_cs_rendering_and_per_token_normalization(data_dir):
    row = json.loads((data_dir / "hellaswag/hellaswag_val.jsonl").read_text(encoding="utf-8").splitlines()[0])
    task = get_task("hellaswag_llmc")
    item = task.items(data_dir)[0]
    assert item.context == row["ctx"] == "A man is sitting on a roof. he"
    assert item.choices == tuple(" " + e for e in row["endings"]) and item.label == row["label"] == 3
    # per token: -6/2 = -3 beats -4/1; per character (lm-eval's) the other way round
    record = task.record(0, item, [-4.0, -6.0, -50.0, -50.0], [1, 2, 9, 9], [False] * 4)
    assert record["pred"] == 0 and record["pred_norm"] == 1
    lm_eval_style = get_task("hellaswag").record(0, item, [-4.0, -6.0, -50.0, -50.0], [1, 2, 9, 9], [False] * 4)
    lengths = [len(e) for e in row["endings"]]
    assert lm_eval_style["pred_norm"] == max(range(4), key=lambda i: [-4.0, -6.0, -50.0, -50.0][i] / lengths[i])


def test_metrics_carry_lm_evals_names_and_standard_errors():
    records = [dict(pred=p, pred_norm=q, label=1, loglik=[-1.0]) for p, q in [(1, 1), (0, 1), (1, 0), (1, 1), (0, 0)]]
    metrics = get_task("piqa").metrics(records)
    acc, acc_norm = [float(r["pred"] == 1) for r in records], [float(r["pred_norm"] == 1) for r in records]
    assert metrics["acc"] == statistics.mean(acc) and metrics["acc_norm"] == statistics.mean(acc_norm)
    assert math.isclose(metrics["acc_stderr"], statistics.stdev(acc) / math.sqrt(5), rel_tol=1e-12)
    assert math.isclose(metrics["acc_norm_stderr"], statistics.stdev(acc_norm) / math.sqrt(5), rel_tol=1e-12)
    cloze = get_task("lambada_openai").metrics([dict(r, loglik=[-2.0 * (i + 1)]) for i, r in enumerate(records)])
    assert set(cloze) == {"acc", "acc_stderr", "perplexity", "num_items"} and cloze["perplexity"] == math.exp(6.0)
    assert get_task("piqa").metrics(records[:1])["acc_stderr"] is None  # one item: no spread to measure


def test_an_unknown_task_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown eval task 'lambada' \(known: .*lambada_openai"):
        get_task("lambada")
    cfg = parse_config(["--eval.enable", "--eval.data_dir", "x"])
    assert cfg.eval.tasks == ["hellaswag", "arc_easy", "arc_challenge", "piqa", "lambada_openai"]


# ----------------------------------------------------------------------------- type-checked eval files

HS = {"activity_label": "A", "ctx_a": "a", "ctx_b": "b", "ctx": "a b", "endings": ["w", "x", "y", "z"], "label": 1}
ARC_CHOICES = [{"text": "t", "label": "A"}, {"text": "u", "label": "B"}]
ARC = {"question": {"stem": "q", "choices": ARC_CHOICES}, "answerKey": "A"}


def line(base: dict, **changes) -> str:
    return json.dumps({**base, **changes}) + "\n"


BAD_FILES = {
    "endings_a_string": (
        "hellaswag",
        line(HS, endings="xy"),
        r":1: field 'endings' must be a list of strings, got str",
    ),
    "endings_not_strings": ("hellaswag", line(HS, endings=["a", 2]), r":1: field 'endings' must be a list of strings"),
    "label_a_float": ("hellaswag", line(HS, label=1.7), r":1: field 'label' must be an integer, got float 1.7"),
    "label_a_bool": ("hellaswag", line(HS, label=True), r":1: field 'label' must be an integer, got bool True"),
    "label_out_of_range": ("hellaswag", line(HS, label=4), r":1: field 'label' is 4, which does not index the 4"),
    "llmc_label_a_float": ("hellaswag_llmc", line(HS, label=0.0), r":1: field 'label' must be an integer, got float"),
    "ctx_not_text": ("hellaswag", line(HS, ctx_b=None), r":1: field 'ctx_b' must be a string, got NoneType"),
    "one_ending": ("hellaswag", line(HS, endings=["w"], label=0), r":1: 1 choice\(s\); a multiple-choice item needs"),
    "arc_duplicate_labels": (
        "arc_easy",
        line(ARC, question={"stem": "q", "choices": [{"text": "t", "label": "A"}, {"text": "u", "label": "A"}]}),
        r":1: field 'question.choices' repeats a label: \['A', 'A'\]",
    ),
    "arc_single_choice": (
        "arc_easy",
        line(ARC, question={"stem": "q", "choices": ARC_CHOICES[:1]}),
        r":1: field 'question.choices' must be a list of at least 2",
    ),
    "arc_text_not_a_string": (
        "arc_easy",
        line(ARC, question={"stem": "q", "choices": [{"text": 5, "label": "A"}, ARC_CHOICES[1]]}),
        r":1: field 'text' must be a string, got int",
    ),
    "lambada_one_word": ("lambada_openai", line({"text": "word"}), r":1: field 'text' must be a passage of several"),
    "lambada_not_text": ("lambada_openai", line({"text": ["a", "b"]}), r":1: field 'text' must be a string"),
    "empty_file": ("arc_challenge", "", r": no items \(the file holds no JSON lines\)"),
    "blank_lines_only": ("lambada_openai", "\n  \n", r": no items"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_eval_files_are_type_checked_in_one_line_naming_file_line_and_field(tmp_path, case):
    task, text, message = BAD_FILES[case]
    path = tmp_path / get_task(task).files[0]
    path.parent.mkdir(parents=True)
    path.write_text(line(HS) + text if task.startswith("hellaswag") else text)  # a good line 1, the bad line 2
    if task.startswith("hellaswag"):
        message = message.replace(":1:", ":2:")
    with pytest.raises(ValueError, match=f"^{path}{message}") as e:
        get_task(task).items(tmp_path)
    assert "\n" not in str(e.value)


def test_piqa_fields_and_an_empty_piqa_are_checked(tmp_path):
    (tmp_path / "piqa").mkdir()
    (tmp_path / "piqa/valid.jsonl").write_text(line({"goal": "g", "sol1": "a", "sol2": ["b"]}))
    (tmp_path / "piqa/valid-labels.lst").write_text("0\n")
    with pytest.raises(ValueError, match=r"valid.jsonl:1: field 'sol2' must be a string, got list"):
        get_task("piqa").items(tmp_path)
    (tmp_path / "piqa/valid.jsonl").write_text("")
    (tmp_path / "piqa/valid-labels.lst").write_text("")
    with pytest.raises(ValueError, match=r"valid.jsonl: no items"):
        get_task("piqa").items(tmp_path)


def test_a_custom_item_with_a_bool_or_float_label_is_refused(tmp_path):
    class Flags(type(get_task("piqa"))):
        def item(self, row, label):
            return Item("q", (" a", " b"), row["x"])

    (tmp_path / "piqa").mkdir()
    (tmp_path / "piqa/valid.jsonl").write_text(line({"x": True}))
    (tmp_path / "piqa/valid-labels.lst").write_text("0\n")
    with pytest.raises(ValueError, match=r"valid.jsonl:1: label True does not index its 2 choices"):
        Flags().items(tmp_path)
