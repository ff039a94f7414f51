"""HF tokenizer.json through tiktoken: ids identical to the HF ``tokenizers`` library's on the shared
corpora (special-token text included), one-line refusals for what tiktoken cannot represent, model
folders, the fingerprint, prepare_data -> Qwen3 training, and tokenizer files in HF exports."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import pytest

from tests.helpers.hf_tokenizers import NFC_TEXT, convert, corpora, edited, parity_texts, sprinkle, with_added_tokens
from tests.helpers.launch import run_python
from tests.helpers.shared_data import shared_file
from titanlite.tokenizer import build_tokenizer, tokenizer_fingerprint
from titanlite.tokenizer.hf import byte_level_alphabet, tokenizer_files

tokenizers = pytest.importorskip("tokenizers", reason="HF tokenizers (test extra, via transformers) not installed")
converter = pytest.importorskip("transformers.convert_slow_tokenizer", reason="transformers not installed")

REPO = Path(__file__).resolve().parents[2]
QWEN_PAT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def assert_same_ids(file: Path, texts: list[str]):
    """titanlite's ids == HF's: documents (added-token text as plain text) and with added tokens split out.
    Returns titanlite's tokenizer."""
    ours = build_tokenizer(str(file))
    hf = tokenizers.Tokenizer.from_file(str(file))
    for i, text in enumerate(texts):
        hf.encode_special_tokens = True  # HF then reads special-token text as plain text, as titanlite does
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False).ids, f"text {i}"
        hf.encode_special_tokens = False
        want = hf.encode(text, add_special_tokens=False).ids
        assert ours.encoding.encode(text, allowed_special="all") == want, f"text {i} (added tokens split out)"
    return ours


def train_bpe(out: Path, qwen_style: bool, vocab_size: int = 1500) -> Path:
    """A tiny byte-level BPE trained with HF ``tokenizers``: GPT-2 style, or Qwen style (NFC, Split regex)."""
    from tokenizers import Regex, models, normalizers, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.BPE(ignore_merges=qwen_style))
    if qwen_style:
        hf.normalizer = normalizers.NFC()
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(QWEN_PAT), "isolated"), pre_tokenizers.ByteLevel(False, use_regex=False)]
        )
    else:
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = shared_file("text/tinyshakespeare.txt").read_text(encoding="utf-8")
    hf.train_from_iterator([text[-200_000:], NFC_TEXT], trainer)
    out.mkdir(parents=True, exist_ok=True)
    hf.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


@pytest.fixture(scope="module")
def test_model_json(tmp_path_factory) -> Path:
    return convert(shared_file("tokenizers/test_tiktoken.model"), tmp_path_factory.mktemp("conv"))


@pytest.fixture(scope="module")
def qwen_json(tmp_path_factory) -> Path:
    return train_bpe(tmp_path_factory.mktemp("qwen"), qwen_style=True)


def test_byte_level_alphabet_is_gpt2s():
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    assert alphabet[ord(" ")] == "Ġ" and alphabet[ord("\n")] == "Ċ" and alphabet[ord("a")] == "a"


def test_converted_test_tiktoken_model_matches_hf_and_the_tiktoken_file(test_model_json):
    texts = corpora()
    assert_same_ids(test_model_json, texts)
    ours, ref = (
        build_tokenizer(str(test_model_json)),
        build_tokenizer(str(shared_file("tokenizers/test_tiktoken.model"))),
    )
    assert ours.vocab_size == ref.vocab_size == 2256 and (ours.bos_id, ours.eos_id) == (2000, 2001)
    assert ours.encode(texts[0], bos=True, eos=True) == ref.encode(texts[0], bos=True, eos=True)
    # same ids, same meaning: shards made with either are interchangeable
    assert tokenizer_fingerprint(ours) == tokenizer_fingerprint(ref)


@pytest.fixture(scope="module")
def cl100k_json(tmp_path_factory) -> Path:
    return convert(shared_file("tokenizers/cl100k_base.tiktoken"), tmp_path_factory.mktemp("cl100k"))


def test_converted_cl100k_matches_hf(cl100k_json):
    ours = assert_same_ids(cl100k_json, corpora()[:4] + corpora()[-3:])
    assert ours.encode("hello world") == [15339, 1917]


@pytest.mark.parametrize("qwen_style", [False, True], ids=["gpt2_bytelevel", "qwen_split_nfc"])
def test_trained_byte_level_bpe_matches_hf(tmp_path, qwen_style):
    file = train_bpe(tmp_path, qwen_style)
    assert_same_ids(file, corpora())
    tok = build_tokenizer(str(file))
    # no tokenizer_config.json, no BOS token: EOS is <|endoftext|> (trained into the vocab as id 0) and frames both ends
    assert (tok.bos_id, tok.eos_id) == (0, 0) and tok.vocab_size == 1500
    if qwen_style:  # NFC applies also where the data pipeline calls the encoding directly, and survives pickling
        assert tok.encoding.encode_ordinary("cafe\u0301") == tok.encoding.encode_ordinary("caf\u00e9")
        assert pickle.loads(pickle.dumps(tok.encoding)).encode_ordinary("cafe\u0301") == tok.encode("caf\u00e9")


def test_split_regex_gaps_are_kept_like_hf(tmp_path):
    """HF keeps the text between a Split regex's matches; tiktoken alone would drop it."""
    file = train_bpe(tmp_path, qwen_style=True)
    data = json.loads(file.read_text())
    data["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\p{L}+"
    file.write_text(json.dumps(data))
    text = "words, 12 digits!! and  spaces\n"
    assert_same_ids(file, [text] + corpora()[:1])
    assert build_tokenizer(str(file)).decode(build_tokenizer(str(file)).encode(text)) == text


def test_bos_eos_from_tokenizer_config(tmp_path, test_model_json):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(test_model_json.read_bytes())
    config = {"bos_token": None, "eos_token": {"content": "<|eot_id|>"}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = build_tokenizer(str(folder))  # a model folder: its tokenizer.json
    assert (tok.bos_id, tok.eos_id) == (2009, 2009) and tok.path == str(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<x>"}))
    with pytest.raises(ValueError, match=r"tokenizer_config.json: eos_token '<x>' is not an added token of "):
        build_tokenizer(str(folder))


def test_model_folder_with_original_tokenizer_model(tmp_path):
    (tmp_path / "original").mkdir()
    (tmp_path / "original" / "tokenizer.model").write_bytes(shared_file("tokenizers/test_tiktoken.model").read_bytes())
    tok, ref = build_tokenizer(str(tmp_path)), build_tokenizer(str(shared_file("tokenizers/test_tiktoken.model")))
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(ref)
    with pytest.raises(ValueError, match=r"a folder without tokenizer.json or original/tokenizer.model \(expected a"):
        build_tokenizer(str(tmp_path / "original"))


def test_shared_hf_test_asset_is_refused_because_hf_drops_bytes():
    """torchtitan's test tokenizer.json stores raw characters (" ", "\\x00", the text "\\x80"), not the
    byte-level alphabet: HF silently drops every byte it has no token for, which tiktoken cannot do."""
    folder = shared_file("tokenizers/hf_test/tokenizer.json").parent
    with pytest.raises(ValueError) as e:
        build_tokenizer(str(folder))
    assert str(e.value).startswith(f"{folder / 'tokenizer.json'}: vocab token '\\x00' (id 0) has ")
    assert "not in the byte-level alphabet" in str(e.value) and "\n" not in str(e.value)
    hf = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert hf.decode(hf.encode("a b\n", add_special_tokens=False).ids) == "ab"  # the space and newline are gone


def swap_first_merges(d):
    """The first and last merges trade places: the list is no longer in id order."""
    merges = d["model"]["merges"]
    merges[0], merges[-1] = merges[-1], merges[0]


REFUSED = {
    "unigram": (lambda d: d["model"].update(type="Unigram"), r"model type 'Unigram' cannot be represented"),
    "wordpiece": (lambda d: d["model"].update(type="WordPiece"), r"model type 'WordPiece' cannot be represented"),
    "lowercase": (lambda d: d.update(normalizer={"type": "Lowercase"}), r"normalizer Lowercase cannot be represented"),
    "nfkc_and_nfc": (
        lambda d: d.update(normalizer={"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "NFC"}]}),
        r"normalizer NFKC\+NFC cannot",
    ),
    "prefix_space": (
        lambda d: d["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True),
        r"ByteLevel add_prefix_space=true cannot be represented",
    ),
    "whitespace_pre_tokenizer": (
        lambda d: d.update(pre_tokenizer={"type": "Whitespace"}),
        r"pre-tokenizer Whitespace is not byte-level",
    ),
    "merge_order": (swap_first_merges, r"merge 0 \(.*\) makes id \d+ after|merge 1 \(.*\) makes id \d+ after"),
    "unmade_token": (
        lambda d: d["model"].update(
            merges=[m for m in d["model"]["merges"] if "".join(m) != "ances"], ignore_merges=False
        ),
        r"vocab token id \d+ is made by no merge and ignore_merges is false",
    ),
    "missing_byte": (lambda d: d["model"]["vocab"].pop("Ġ"), r"no single-byte token for 1 byte value\(s\) \(0x20\)"),
    "dropout": (lambda d: d["model"].update(dropout=0.1), r"BPE dropout=0.1 cannot be represented"),
    "lstrip": (
        lambda d: d["added_tokens"][0].update(lstrip=True),
        r"added token .<\|begin_of_text\|>. has lstrip/rstrip/single_word",
    ),
    "string_split_pattern": (
        lambda d: d["pre_tokenizer"]["pretokenizers"][0].update(pattern={"String": " "}),
        r"only a Split with a Regex pattern, behavior Isolated and invert=false",
    ),
    "normalizer_not_an_object": (lambda d: d.update(normalizer="NFC?"), r"normalizer NFC\? cannot be represented"),
    "bad_regex": (
        lambda d: d["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(Regex="(unclosed"),
        r"tiktoken cannot use its pre-tokenizer regex",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_tiktoken_cannot_represent_is_refused_in_one_line(tmp_path, test_model_json, case):
    edit, message = REFUSED[case]
    file = edited(test_model_json, tmp_path / "tokenizer.json", edit)
    with pytest.raises(ValueError, match=f"^{file}: ({message})") as e:
        build_tokenizer(str(file))
    assert "\n" not in str(e.value)


def test_refused_merge_order_really_changes_hf_ids(tmp_path, test_model_json):
    """The merge-order refusal is not pedantry: HF's ids for such a file differ from rank-order BPE's."""
    file = edited(test_model_json, tmp_path / "tokenizer.json", swap_first_merges)
    text = corpora()[0][:20000]
    hf = tokenizers.Tokenizer.from_file(str(file)).encode(text, add_special_tokens=False).ids
    assert hf != build_tokenizer(str(test_model_json)).encode(text)


@pytest.mark.parametrize(
    "content, message",
    [("{not json", r"not valid JSON \(line 1, column 2"), ("[]", "expected a JSON object, got list")],
)
def test_unreadable_json(tmp_path, content, message):
    file = tmp_path / "tokenizer.json"
    file.write_text(content)
    with pytest.raises(ValueError, match=f"^{file}: {message}"):
        build_tokenizer(str(file))


def test_prepare_data_then_qwen3_trains_and_exports_the_tokenizer(tmp_path, qwen_json, monkeypatch):
    """End to end: shards prepared with a tokenizer.json (CLI), a Qwen3 debug run on them, an HF export
    that carries the tokenizer files and works as a tokenizer folder itself."""
    import titanlite.train as train
    from tests.helpers.peaks import skip_peak_measurement
    from titanlite.checkpoint.hf_export import dcp_to_hf

    folder = qwen_json.parent
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|im_end|>"}))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(shared_file("text/tinyshakespeare.txt").read_text(encoding="utf-8")[:40_000])
    out = run_python(
        [sys.executable, "-m", "titanlite", "prepare", "--input", str(corpus), "--tokenizer", str(folder)]
        + ["--output", str(tmp_path / "shards"), "--workers", "1", "--txt-split", "paragraphs"],
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    tok = build_tokenizer(str(folder))
    assert manifest["tokenizer"]["fingerprint"] == tokenizer_fingerprint(tok)
    assert manifest["tokenizer"]["eos_id"] == tok.eos_id == 2  # <|im_end|>, trained in as id 2

    skip_peak_measurement(monkeypatch)
    argv = ["--config", str(REPO / "torchtitan_ext/configs/qwen3_debug.toml"), "--job.dump_folder", str(tmp_path / "o")]
    argv += ["--model.tokenizer_path", str(folder), "--training.dataset", "shards"]
    argv += ["--training.dataset_path", str(tmp_path / "shards"), "--training.steps", "2", "--training.seq_len", "32"]
    argv += ["--training.local_batch_size", "2", "--training.global_batch_size", "2", "--validation.enable", "false"]
    argv += ["--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1", "--model.n_layers", "1"]
    train.main(argv + ["--checkpoint.enable", "--checkpoint.interval", "2"])
    records = [json.loads(line) for line in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 2 and all(loss == loss for loss in losses)

    step = next((tmp_path / "o" / "checkpoint").glob("step-*"))
    export = dcp_to_hf(step, tmp_path / "hf", extensions=["torchtitan_ext.qwen3"])
    assert (export / "tokenizer.json").read_bytes() == qwen_json.read_bytes()
    assert (export / "tokenizer_config.json").read_bytes() == (folder / "tokenizer_config.json").read_bytes()
    assert tokenizer_fingerprint(build_tokenizer(str(export))) == tokenizer_fingerprint(tok)
    config = json.loads((export / "config.json").read_text())
    assert config["vocab_size"] == tok.vocab_size and config["eos_token_id"] == tok.eos_id


def test_tokenizer_files_for_an_export_rebuild_the_same_tokenizer(tmp_path, test_model_json):
    """What DCP -> HF export copies, laid out in a folder, is a tokenizer folder with the same fingerprint."""
    tiktoken_file = shared_file("tokenizers/test_tiktoken.model")
    assert tokenizer_files(str(tiktoken_file)) == {"original/tokenizer.model": str(tiktoken_file)}
    assert tokenizer_files(str(test_model_json)) == {"tokenizer.json": str(test_model_json)}
    assert tokenizer_files("") == tokenizer_files(str(tmp_path / "gone.json")) == {}
    for src in (tiktoken_file, test_model_json):
        out = tmp_path / src.name
        for name, file in tokenizer_files(str(src)).items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_bytes(Path(file).read_bytes())
        want = tokenizer_fingerprint(build_tokenizer(str(src)))
        assert tokenizer_fingerprint(build_tokenizer(str(out))) == want


def _absurd_id(where: str):
    def edit(d):
        if where == "vocab":
            token = next(t for t in d["model"]["vocab"] if len(t) > 1)
            d["model"]["vocab"][token] = 10**15
        else:
            d["added_tokens"][0]["id"] = 10**15

    return edit


@pytest.mark.parametrize("where", ["vocab", "added"])
def test_absurd_token_ids_are_one_line_errors(tmp_path, test_model_json, where):
    """An id of 1e15 (tiktoken's ranks are 32-bit) gave an OverflowError traceback."""
    file = edited(test_model_json, tmp_path / "tokenizer.json", _absurd_id(where))
    with pytest.raises(ValueError, match=rf"^{file}: .*integer.*in \[0, 2,147,483,647\]") as e:
        build_tokenizer(str(file))
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- what HF's engine means

# OpenAI's own cl100k_base pre-tokenizer regex (tiktoken_ext/openai_public.py), possessive quantifiers included
CL100K_PAT = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]"""
    r"""|\s+(?!\S)|\s"""
)


def assert_hf_parity(file: Path, texts: list[str]):
    """titanlite's ids (special-token text as text) == HF's with encode_special_tokens, batch-encoded; and
    titanlite's decode == HF's (special tokens kept). Returns titanlite's tokenizer."""
    ours = build_tokenizer(str(file))
    hf = tokenizers.Tokenizer.from_file(str(file))
    hf.encode_special_tokens = True
    want = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    got = ours.encode_batch(texts, num_threads=2)
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not bad, f"{len(bad)} of {len(texts)} texts differ, first: text {bad[0]} {texts[bad[0]][:80]!r}"
    for ids in want[-3:] + want[:3]:
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False)
    return ours


@pytest.fixture(scope="module")
def cl100k_openai_json(tmp_path_factory, cl100k_json) -> Path:
    """What ``convert(..., pattern=CL100K_PAT)`` writes (the converter's pattern is only the Split regex), made
    from the converted cl100k file without converting the 100k-token vocabulary again."""

    def edit(d):
        d["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = CL100K_PAT

    return edited(cl100k_json, tmp_path_factory.mktemp("cl100k_openai") / "tokenizer.json", edit)


def test_cl100k_with_openais_possessive_regex_matches_hf_on_1038_texts(cl100k_openai_json):
    """HF's engine (Oniguruma) reads ``\\p{N}{1,3}+`` as "1-3 digits, one or more times", not as a possessive
    1-3: "1234" is one piece for HF ("12" "34"), two for tiktoken run on the regex as written ("123" "4")."""
    texts = parity_texts()
    assert len(texts) == 1038
    assert assert_hf_parity(cl100k_openai_json, texts).encode("1234") == [717, 1958]


ADDED = [("<think>", False), ("</think>", False), ("<tool_call>", False), ("<tool", False), (" ab", False)]


def test_non_special_added_tokens_are_matched_in_text_like_hf(tmp_path, test_model_json):
    """Added tokens with "special": false (Qwen's <think>, <tool_call>) are cut out of ordinary text by HF,
    leftmost-longest ("<tool_call>" over "<tool"), also inside words: titanlite too, encode and decode,
    also through the data pipeline's encoding (and after pickling it)."""
    file = with_added_tokens(test_model_json, tmp_path / "added", ADDED)
    tok = build_tokenizer(str(file))
    ids = tok.encode("call <tool_call>")
    assert ids == tokenizers.Tokenizer.from_file(str(file)).encode("call <tool_call>", add_special_tokens=False).ids
    assert ids[-1] == tok.encoding.encode_single_token("<tool_call>") and tok.decode(ids) == "call <tool_call>"
    assert pickle.loads(pickle.dumps(tok.encoding)).encode_ordinary("x<think>y") == tok.encoding.encode_ordinary(
        "x<think>y"
    )
    assert_hf_parity(file, sprinkle(parity_texts(), [t for t, _ in ADDED] + ["<|eot_id|>"]))


def test_normalized_added_tokens_match_after_nfc_like_hf(tmp_path, qwen_json):
    """A "normalized": true added token is matched in the NFC-normalized text, a false one in the raw text."""
    composed = "caf\u00e9!"  # NFC of "cafe\u0301!"
    file = with_added_tokens(qwen_json, tmp_path / "nfc", [(composed, True), ("cafe\u0301?", False), ("<x>", True)])
    texts = ["a cafe\u0301! b", "cafe\u0301? c", "caf\u00e9? d <x><x>", *sprinkle(corpora()[:4], ["<x>", composed])]
    assert_hf_parity(file, texts)


@pytest.fixture(scope="module")
def qwen_400_json(tmp_path_factory) -> Path:
    return train_bpe(tmp_path_factory.mktemp("qwen_400"), qwen_style=True, vocab_size=400)


@pytest.mark.parametrize(
    "regex, text",
    [
        (r"\p{N}{2}+", "12345 1 123"),  # an interval then "+": repeated, not possessive
        (r"\p{N}{1,3}+?|\p{L}+", "12345 abc"),  # ... lazily repeated
        (r"(?:ab){1,2}+|\s+", "ababab abab"),
        (r"\s+$|\S+", "a  \nb  \n\n c  "),  # $ ends a line for HF's engine
        (r"^\s*\S+|\s+", "x\n  y z\nw"),  # ^ starts one
        (r"(?m:.)+?\n|\S+", "a b\nc\n"),  # Oniguruma's m: dot matches newline
        (r"\p{L}++|\s*+[\r\n]|[^\s\p{L}]++|\s", "possessive  and\n\natomic 99!"),
        (r"(?>\p{L}+)|[\d]{2}|\s", "atomic 1234 x"),
        (r"[\[\]{}]{1,2}+|[^\[\]{}]+", "a[[{}]]{{b"),  # braces in classes are no quantifiers
    ],
)
def test_oniguruma_constructs_split_like_hf(tmp_path, qwen_400_json, regex, text):
    def edit(d):
        d["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = regex

    file = edited(qwen_400_json, tmp_path / "tokenizer.json", edit)
    hf = tokenizers.Tokenizer.from_file(str(file))
    assert build_tokenizer(str(file)).encode(text) == hf.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize(
    "regex, construct",
    [("(?s:.)|x", r"'\(\?s:' at 0: the flag s is not Oniguruma's"), ("a(?~b)", r"'\(\?~' at 1"), ("(?x) a", "x")],
)
def test_regex_constructs_tiktoken_cannot_follow_are_refused_in_one_line(tmp_path, test_model_json, regex, construct):
    def edit(d):
        d["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = regex

    file = edited(test_model_json, tmp_path / "tokenizer.json", edit)
    with pytest.raises(ValueError, match=f"^{file}: pre-tokenizer regex construct .*{construct}") as e:
        build_tokenizer(str(file))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("special", [False, True], ids=["matched", "special"])
def test_an_added_token_renumbering_a_vocabulary_token_is_refused(tmp_path, test_model_json, special):
    """HF gives an added token whose text is in the vocabulary the vocabulary's id, not its own: titanlite
    cannot follow that with tiktoken's special tokens, so the file is refused in one line naming both ids."""
    data = json.loads(test_model_json.read_text(encoding="utf-8"))
    vocab_id = data["model"]["vocab"]["the"]
    own_id = 1 + max(*data["model"]["vocab"].values(), *(e["id"] for e in data["added_tokens"]))
    entry = {"id": own_id, "content": "the", "single_word": False, "lstrip": False, "rstrip": False}
    data["added_tokens"].append({**entry, "normalized": False, "special": special})
    file = tmp_path / "tokenizer.json"
    file.write_text(json.dumps(data), encoding="utf-8")
    hf = tokenizers.Tokenizer.from_file(str(file))
    assert hf.encode("bathe", add_special_tokens=False).ids[-1] == vocab_id  # what HF does: the vocabulary id
    with pytest.raises(ValueError) as e:
        build_tokenizer(str(file))
    msg = str(e.value)
    assert msg.startswith(f"{file}: added token 'the' has id {own_id} but is also vocabulary token id {vocab_id}")
    assert "\n" not in msg
