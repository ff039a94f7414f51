"""Chat data (``titanlite.data.chat``) and chat prompts (``titanlite.generate --chat``, ``[sampling] chat``).

References, independent of the code under test:

- transformers' own chat-template renderer (``render_jinja_template``, what ``apply_chat_template`` runs)
  with a Llama-3-format jinja template written here, its ``{% generation %}`` spans marking the assistant
  text; the rendered string tokenized by tiktoken with the special tokens allowed must give the same ids,
  and the character spans the same mask, for the byte tokenizer and a real BPE (cl100k);
- a checkpoint whose output always picks ``<|eot_id|>`` (a constant residual direction): ``--chat`` stops
  after one token, plain generation runs to ``--max-new-tokens``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tiktoken
import torch
import torch.distributed.checkpoint as dcp

from tests.helpers.dist import REPO
from tests.helpers.shared_data import shared_file
from titanlite.checkpoint import layout
from titanlite.data.chat import chat_prompt_ids, encode_conversations, load_chat_data, render_conversation
from titanlite.data.prepare import main as prepare_main
from titanlite.data.shards import ShardedTokens, ShardIntegrityError, is_chat_folder
from titanlite.generate.cli import main
from titanlite.models.llama3 import Llama3ModelArgs, Transformer
from titanlite.tokenizer import Tokenizer, build_byte_tokenizer, build_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ m['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
TRICKY = [
    [{"role": "system", "content": "  Be brief.\n"}, {"role": "user", "content": "Héllo, wörld? 12345"}],
    [
        {"role": "user", "content": "Say:\n\n  indented\tcode()"},
        {"role": "assistant", "content": "\n  indented\tcode()  \n"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "-7 ... !!"},
    ],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "日本語 and emoji 🙂"}],
    [{"role": "user", "content": "call it"}, {"role": "tool", "content": '{"x": 1}'}],
]


def reference(tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool = False):
    """``(ids, mask)`` from transformers' renderer + tiktoken (special tokens allowed in the string)."""
    render = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    (text,), (spans,) = render(
        [messages],
        chat_template=TEMPLATE,
        return_assistant_tokens_mask=True,
        add_generation_prompt=add_generation_prompt,
        bos_token="<|begin_of_text|>",
    )

    def encode(s: str) -> list[int]:
        return tokenizer.encoding.encode(s, allowed_special="all")

    ids = encode(text)
    mask = [0] * len(ids)
    for start, end in spans:  # each span ends at a special token, so token boundaries fall on its ends
        mask[len(encode(text[:start])) : len(encode(text[:end]))] = [1] * (
            len(encode(text[:end])) - len(encode(text[:start]))
        )
    return ids, mask


def fixture_conversations(name: str = "train.jsonl") -> list[list[dict]]:
    with open(f"{FIXTURES}/{name}", encoding="utf-8") as f:
        return [json.loads(line)["messages"] for line in f if line.strip()]


@pytest.fixture(params=["bytes", "cl100k"])
def tokenizer(request):
    if request.param == "bytes":
        return build_byte_tokenizer()
    return build_tokenizer(str(shared_file("tokenizers/cl100k_base.tiktoken")))


def test_rendering_equals_transformers_chat_template(tokenizer):
    conversations = fixture_conversations()[:60] + TRICKY
    for messages in conversations:
        for gen in (False, True):
            assert render_conversation(tokenizer, messages, gen) == reference(tokenizer, messages, gen), messages


def test_mask_covers_assistant_content_and_eot_only():
    tok = build_byte_tokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " ok "}]
    ids, mask = render_conversation(tok, messages)
    eot = tok.encoding.encode_single_token("<|eot_id|>")
    assert [i for i, m in zip(ids, mask) if m] == [*b"ok", eot]
    assert ids[0] == tok.bos_id and ids.count(eot) == 2


def test_template_looking_text_stays_ordinary_bytes():
    tok = build_byte_tokenizer()
    ids, _ = render_conversation(tok, [{"role": "user", "content": "<|eot_id|>"}])
    assert ids.count(tok.encoding.encode_single_token("<|eot_id|>")) == 1  # only the real end of the turn
    assert bytes(i for i in ids if i < 256).endswith(b"<|eot_id|>")


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"messages": []}', "'messages' must be a non-empty list"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "role 'robot', expected one of system, user"),
        ('{"messages": [{"role": "user"}]}', "messages[0] ('user') needs a string 'content'"),
        ('{"messages": [{"role": "user", "content": 3}]}', "needs a string 'content'"),
        ('{"text": "hello"}', "expected an object with a 'messages' list"),
        ("{not json", "not JSON"),
    ],
)
def test_bad_conversations_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "c.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "ok"}]}\n\n' + line + "\n")
    with pytest.raises(ValueError) as e:
        encode_conversations(build_byte_tokenizer(), path)
    text = str(e.value)
    assert text.startswith(f"{path}:3: ") and message in text and "\n" not in text


def test_empty_input_is_an_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no conversations found"):
        encode_conversations(build_byte_tokenizer(), tmp_path)


def test_a_tokenizer_without_the_chat_tokens_is_refused_by_name():
    enc = tiktoken.Encoding(
        "plain",
        pat_str=r"\S+|\s+",
        mergeable_ranks={bytes([i]): i for i in range(256)},
        special_tokens={"<|begin_of_text|>": 256, "<|end_of_text|>": 257},
    )
    with pytest.raises(ValueError, match=r"tokenizer 'plain' has no special token <\|start_header_id\|>"):
        render_conversation(Tokenizer(enc, name="plain"), [{"role": "user", "content": "x"}])


def test_encode_conversations_is_each_rendering_plus_eos(tmp_path):
    tok = build_byte_tokenizer()
    convs = fixture_conversations("val.jsonl")
    (tmp_path / "b").mkdir()
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs[:5]))
    (tmp_path / "b" / "c.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs[5:]))
    tokens, mask, offsets = encode_conversations(tok, tmp_path)  # a folder: files in sorted order
    assert tokens.dtype == torch.int64 and mask.dtype == torch.uint8 and offsets.dtype.name == "int64"
    assert len(offsets) == len(convs) + 1 and offsets[0] == 0 and offsets[-1] == len(tokens) == len(mask)
    for i, messages in enumerate(convs):
        ids, m = render_conversation(tok, messages)
        a, b = offsets[i], offsets[i + 1]
        assert tokens[a:b].tolist() == ids + [tok.eos_id] and mask[a:b].tolist() == m + [0]


def test_fixture_set_is_small_and_mostly_prompt():
    tok = build_byte_tokenizer()
    for name, n in (("train.jsonl", 320), ("val.jsonl", 40)):
        tokens, mask, offsets = encode_conversations(tok, f"{FIXTURES}/{name}")
        assert len(offsets) - 1 == n
        assert 0.05 < mask.float().mean().item() < 0.2  # assistant replies are short: most tokens carry no loss


# ----------------------------------------------------------------------------- chat prompts


def eot_model(path, tok: Tokenizer) -> None:
    """A tiny Llama 3 checkpoint that always predicts <|eot_id|>: every embedding has one huge constant
    coordinate, the blocks add nothing (zero output projections), so the normed hidden state points
    along that coordinate, and only the <|eot_id|> row of the output layer reads it."""
    torch.manual_seed(0)
    args = Llama3ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=64, max_seq_len=256)
    model = Transformer(args)
    model.init_weights()
    eot = tok.encoding.encode_single_token("<|eot_id|>")
    with torch.no_grad():
        model.tok_embeddings.weight[:, 0] = 1000.0
        for layer in model.layers.values():
            layer.attention.wo.weight.zero_()
            layer.feed_forward.w2.weight.zero_()
        model.output.weight[:, 0] = 0.0
        model.output.weight[eot, 0] = 10.0
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(path), no_dist=True)
    model_info = {"name": "llama3", "flavor": None, "args": dataclasses.asdict(args)}
    info = {"step": 1, "model_only": True, "dtype": "float32", "model": model_info}
    layout.write_info(path, {**info, "tokenizer": {"bos_id": tok.bos_id, "eos_id": tok.eos_id}})


def test_generate_chat_feeds_the_rendering_and_stops_at_eot(tmp_path, capsys):
    tok = build_byte_tokenizer()
    eot_model(tmp_path / "step-1", tok)
    base = ["--checkpoint", str(tmp_path / "step-1"), "--tokenizer", "bytes", "--prompt", "What is 2 + 2?"]
    base += ["--max-new-tokens", "5", "--json"]
    assert main([*base, "--chat"]) == 0
    chat = json.loads(capsys.readouterr().out)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert chat["prompt_ids"] == render_conversation(tok, messages, add_generation_prompt=True)[0]
    assert chat["prompt_ids"] == chat_prompt_ids(tok, "What is 2 + 2?") == chat_prompt_ids(tok, messages)
    eot = tok.encoding.encode_single_token("<|eot_id|>")
    assert chat["completion_ids"] == [eot] and chat["completion"] == ""
    assert main(base) == 0  # without --chat <|eot_id|> is an ordinary token: runs to --max-new-tokens
    plain = json.loads(capsys.readouterr().out)
    assert plain["prompt_ids"] == tok.encode("What is 2 + 2?", bos=True) and plain["completion_ids"] == [eot] * 5


def test_sampling_hook_chat_prompts(tmp_path):
    from titanlite.checkpoint.load_model import load_model
    from titanlite.trainer.runtime import Runtime
    from titanlite.trainer.sampling import SamplingHook

    tok = build_byte_tokenizer()
    eot_model(tmp_path / "step-1", tok)
    model = load_model(str(tmp_path / "step-1"), device="cpu", tokenizer_path="bytes").model

    @dataclasses.dataclass
    class Section:
        chat: bool
        prompts: tuple = ("Reverse: cat",)
        max_new_tokens: int = 4
        temperature: float = 0.0
        top_k: int = 0
        top_p: float = 1.0
        seed: int = 0

    hook = SamplingHook(Section(chat=True), model, tok, Runtime(torch.device("cpu")))
    assert hook.prompt_ids == [chat_prompt_ids(tok, "Reverse: cat")]
    assert hook.sample() == [{"prompt": "Reverse: cat", "completion": ""}]  # stopped at <|eot_id|>, dropped
    plain = SamplingHook(Section(chat=False), model, tok, Runtime(torch.device("cpu")))
    assert plain.prompt_ids == [tok.encode("Reverse: cat", bos=True)]
    assert plain.sample() == [{"prompt": "Reverse: cat", "completion": "<|eot_id|>" * 4}]


# ----------------------------------------------------------------------------- prepared chat shards


def docs_of(tokens, mask, offsets) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [
        (tuple(tokens[a:b].tolist()), tuple(mask[a:b].tolist()))
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())
    ]


def folder_bytes(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix in (".bin", ".json")}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("chat") / "shards"
    argv = ["--input", str(FIXTURES / "train.jsonl"), "--output", str(out), "--format", "chat"]
    assert prepare_main([*argv, "--val-fraction", "0.2", "--shard-tokens", "4000", "--quiet"]) == 0
    return out


def test_prepared_shards_hold_each_rendering_plus_eos_and_its_mask(prepared):
    tok = build_byte_tokenizer()
    reference = docs_of(*encode_conversations(tok, FIXTURES / "train.jsonl"))  # input order, rendering + EOS
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["content"] == "chat" and is_chat_folder(prepared)
    assert all(e["mask"]["name"] == e["name"].replace(".bin", ".mask.bin") for e in manifest["shards"])
    assert manifest["totals"]["train"]["shards"] >= 3  # resumption below cuts between shards
    splits = {s: docs_of(*load_chat_data("shards", prepared, s, tok)) for s in ("train", "val")}
    assert 0 < len(splits["val"]) < len(splits["train"])
    assert sorted(splits["train"] + splits["val"]) == sorted(reference)
    for docs in splits.values():  # each split keeps the input order
        assert docs == [d for d in reference if d in set(docs)]
    assert all(d[0][0] == tok.bos_id and d[0][1] != tok.bos_id and d[0][-1] == tok.eos_id for d in reference)


def test_raw_chat_kind_is_the_in_memory_encoding():
    tok = build_byte_tokenizer()
    got, want = (
        load_chat_data("chat", FIXTURES / "val.jsonl", "train", tok),
        encode_conversations(tok, FIXTURES / "val.jsonl"),
    )
    assert docs_of(*got) == docs_of(*want)


def test_interrupted_chat_prepare_resumes_to_identical_files(prepared, tmp_path):
    out = tmp_path / "out"
    argv = ["--input", str(FIXTURES / "train.jsonl"), "--output", str(out), "--format", "chat"]
    argv += ["--val-fraction", "0.2", "--shard-tokens", "4000", "--quiet"]
    assert prepare_main(argv) == 0
    full = folder_bytes(prepared)
    assert folder_bytes(out) == full  # a second folder: the same bytes
    # Interrupted while writing train shard 2: its mask shard was renamed, the token shard was not.
    (out / "manifest.json").unlink()
    for p in sorted(out.glob("train-0000[2-9].bin")):
        p.unlink()
    for p in sorted(out.glob("train-0000[3-9].mask.bin")):
        p.unlink()
    (out / "train-00002.bin.tmp").write_bytes(b"TLSHARD\0 half written")
    (out / "train-00001.mask.bin").write_bytes(b"TLSHARD\0 damaged")  # a bad mask: its shard is rewritten too
    assert prepare_main(argv) == 0
    assert folder_bytes(out) == full and not list(out.glob("*.tmp"))


def test_verify_checks_the_mask_shards(prepared, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    assert prepare_main(["--verify", str(copy), "--quiet"]) == 0
    mask = copy / "train-00001.mask.bin"
    data = bytearray(mask.read_bytes())
    data[-1] ^= 1  # a mask bit flipped: the tokens are untouched
    mask.write_bytes(bytes(data))
    capsys.readouterr()
    assert prepare_main(["--verify", str(copy), "--quiet"]) == 1
    assert f"{mask}: checksum" in capsys.readouterr().err
    masks = ShardedTokens(copy, "train").masks()  # headers fine: opens; the first read of the shard refuses
    with pytest.raises(ShardIntegrityError, match="train-00001.mask.bin: checksum"):
        masks[: len(masks)]


def test_masks_of_a_text_folder_is_a_one_line_error(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("hello world\n")
    out = tmp_path / "text"
    assert prepare_main(["--input", str(src), "--output", str(out), "--quiet"]) == 0
    assert not is_chat_folder(out)
    with pytest.raises(ValueError, match=r"manifest.json: has no loss-mask stream \(not chat data"):
        ShardedTokens(out).masks()
    with pytest.raises(ValueError, match="dataset kind 'text' has no loss masks"):
        load_chat_data("text", src, "train", build_byte_tokenizer())


def test_chat_manifest_without_mask_entries_is_refused(prepared, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["shards"][0]["mask"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"shard entry 0 \(train-00000.bin\): chat data needs a 'mask' entry"):
        ShardedTokens(copy)


def test_bad_conversation_stops_prepare_with_exit_2(tmp_path, capsys):
    src = tmp_path / "c.jsonl"
    src.write_text(
        '{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [{"role": "bot", "content": "x"}]}\n'
    )
    assert prepare_main(["--input", str(src), "--output", str(tmp_path / "o"), "--format", "chat", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"prepare_data: error: {src}:2: messages[0] has role 'bot'") and "\n" not in err


def test_killed_chat_prepare_reruns_to_identical_files(tmp_path):
    """A real SIGKILL while shards are being written (not a simulation): the rerun gives the same bytes."""
    lines = (FIXTURES / "train.jsonl").read_text().splitlines(keepends=True)
    src = tmp_path / "big.jsonl"
    src.write_text("".join(lines * 20))
    args = ["--input", str(src), "--format", "chat", "--val-fraction", "0.1", "--shard-tokens", "3000", "--quiet"]
    assert prepare_main([*args, "--output", str(tmp_path / "full")]) == 0
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "titanlite.data.prepare", *args, "--output", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            journal = out / "prepare_journal.jsonl"
            if journal.exists() and journal.read_bytes().count(b"\n") >= 5:
                break
            time.sleep(0.005)
        proc.kill()
    finally:
        proc.wait(timeout=30)
    killed_early = not (out / "manifest.json").exists()
    assert prepare_main([*args, "--output", str(out)]) == 0
    assert folder_bytes(out) == folder_bytes(tmp_path / "full")
    if not killed_early:
        pytest.skip("the run finished before the kill (machine too fast for this input): nothing was resumed")


def test_sampling_chat_with_a_tokenizer_without_chat_tokens_names_the_key():
    from titanlite.trainer.runtime import Runtime
    from titanlite.trainer.sampling import SamplingHook

    enc = tiktoken.Encoding(
        "plain",
        pat_str=r"\S+|\s+",
        mergeable_ranks={bytes([i]): i for i in range(256)},
        special_tokens={"<|begin_of_text|>": 256, "<|end_of_text|>": 257},
    )
    section = type("Section", (), {"chat": True, "prompts": ["hi"], "max_new_tokens": 4})()
    with pytest.raises(
        ValueError, match=r"^sampling.chat: tokenizer 'plain' has no special token <\|start_header_id\|>"
    ):
        SamplingHook(section, None, Tokenizer(enc, name="plain"), Runtime(torch.device("cpu")))
