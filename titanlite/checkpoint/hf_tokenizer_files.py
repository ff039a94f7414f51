"""The tokenizer files of a Hugging Face export, so the folder loads whole in ``transformers``, lm-eval or vLLM
(docs/checkpoints.md): :func:`write_tokenizer_files` copies a tokenizer.json, or writes one from a tiktoken file's
or the byte tokenizer's ranks (:func:`tokenizer_json`), with a ``tokenizer_config.json`` (:func:`tokenizer_config`).

The written file is a byte-level BPE with ``ignore_merges`` (a piece that is a whole token is taken at once, as
tiktoken does) and the merges of every way to split a token in two, ordered by the rank of the token they make
(HF merges the lowest first, tiktoken's rule; where several make one token, the shorter left part first).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from titanlite.checkpoint import layout
from titanlite.errors import TokenizerError
from titanlite.tokenizer.hf import byte_level_alphabet, resolve_tokenizer_file, tokenizer_files

logger = logging.getLogger("titanlite.checkpoint")
BUILT_IN = ("", "bytes")  # tokenizer paths naming the built-in byte tokenizer: no file to record or check

# Llama 3's chat format (see titanlite.data.chat): BOS, then per message a header with the role, two
# newlines, the stripped content and <|eot_id|>; the generation prompt is the assistant's header.
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
CHAT_TOKENS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


def write_tokenizer_files(out: Path, recorded_path: str, tokenizer: Any, max_seq_len: int | None = None) -> list[str]:
    """Write the tokenizer files for ``tokenizer`` (built from ``recorded_path``, the path a checkpoint
    recorded; "" for the byte tokenizer) into the HF folder ``out``; returns the names written."""
    written = []
    for name, src in tokenizer_files(recorded_path).items():  # a tokenizer.json (+ config), or a tiktoken file
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, out / name)
        written.append(name)
    if "tokenizer.json" not in written:
        layout.write_json(out / "tokenizer.json", tokenizer_json(tokenizer))
        written.append("tokenizer.json")
    if "tokenizer_config.json" not in written:
        layout.write_json(out / "tokenizer_config.json", tokenizer_config(tokenizer, max_seq_len))
        written.append("tokenizer_config.json")
    return written


def special_tokens(tokenizer: Any) -> dict[str, int]:
    """``{text: id}`` of the tokenizer's special tokens, in id order."""
    enc = tokenizer.encoding
    return dict(sorted(((s, enc.encode_single_token(s)) for s in enc.special_tokens_set), key=lambda kv: kv[1]))


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.encoding.decode_single_token_bytes(token_id).decode("utf-8")


def tokenizer_config(tokenizer: Any, max_seq_len: int | None = None) -> dict[str, Any]:
    """``tokenizer_config.json``: the fast tokenizer class, BOS/EOS, no clean-up of decoded spaces (so a
    decode gives the text back), and Llama 3's chat template when the tokenizer has its tokens."""
    specials = special_tokens(tokenizer)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token_text(tokenizer, tokenizer.bos_id),
        "eos_token": token_text(tokenizer, tokenizer.eos_id),
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
    }
    if max_seq_len:
        config["model_max_length"] = max_seq_len
    if all(t in specials for t in CHAT_TOKENS) and config["bos_token"] == "<|begin_of_text|>":
        config["chat_template"] = LLAMA3_CHAT_TEMPLATE
    return config


def merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every split of every token into two tokens, ordered by the rank of the token made (then by the
    length of the left part)."""
    out = []
    for token in sorted(ranks, key=ranks.__getitem__):
        for cut in range(1, len(token)):
            if token[:cut] in ranks and token[cut:] in ranks:
                out.append((token[:cut], token[cut:]))
    return out


def tokenizer_json(tokenizer: Any) -> dict[str, Any]:
    """A byte-level BPE ``tokenizer.json`` with the ids of a tiktoken-based titanlite tokenizer (see the
    module docstring)."""
    enc = tokenizer.encoding
    specials = special_tokens(tokenizer)
    ranks = {enc.decode_single_token_bytes(i): i for i in range(enc.n_vocab) if i not in specials.values()}
    alphabet = byte_level_alphabet()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    bos = token_text(tokenizer, tokenizer.bos_id)
    added = [
        dict(id=i, content=s, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
        for s, i in specials.items()
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    # tiktoken keeps the regex it was built with (Llama 3's for tiktoken files and the byte tokenizer)
    split = {"type": "Split", "pattern": {"Regex": enc._pat_str}, "behavior": "Isolated", "invert": False}
    bos_piece = {"SpecialToken": {"id": bos, "type_id": 0}}
    post = {
        "type": "TemplateProcessing",
        "single": [bos_piece, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            bos_piece,
            {"Sequence": {"id": "A", "type_id": 0}},
            bos_piece,
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {bos: {"id": bos, "ids": [tokenizer.bos_id], "tokens": [bos]}},
    }
    model = {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": True,
        "vocab": {text(t): i for t, i in sorted(ranks.items(), key=lambda kv: kv[1])},
        "merges": [[text(a), text(b)] for a, b in merges(ranks)],
    }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, byte_level]},
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": model,
    }


def folder_tokenizer_path(hf_dir: Path) -> str:
    """The tokenizer an HF folder carries (its absolute path, for ``checkpoint.json``), or "" when none."""
    if not tokenizer_files(str(hf_dir)):
        return ""
    resolve_tokenizer_file(str(hf_dir))  # the folder is the path: it holds tokenizer.json or original/
    return os.path.abspath(hf_dir)


def check_tokenizer(tokenizer: Any, *, bos_id: Any, vocab_size: int | None, what: str, where: str) -> None:
    """A one-line ValueError when ``tokenizer`` cannot be the model's: it has more ids than the model's
    vocabulary, or its own BOS token (not an EOS standing in for one, as for Qwen) is not the
    ``bos_id`` that ``where`` records (None: not recorded)."""
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
        raise TokenizerError(
            f"{what} has {tokenizer.vocab_size} tokens but {where} gives the model a vocabulary of {vocab_size}: "
            "not this model's tokenizer"
        )
    if isinstance(bos_id, int) and tokenizer.bos_id != tokenizer.eos_id and tokenizer.bos_id != bos_id:
        raise TokenizerError(
            f"{what} has BOS id {tokenizer.bos_id} but {where} records {bos_id}: not this model's tokenizer"
        )


def tokenizer_sha256(path: str) -> str:
    """The SHA-256 of the file a tokenizer path names (an HF folder: its tokenizer.json or original/tokenizer.model)."""
    digest = hashlib.sha256()
    with open(resolve_tokenizer_file(path), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def tokenizer_record(path: str) -> dict[str, str]:
    """What ``checkpoint.json`` records of the tokenizer at ``path``: its absolute path and its file's SHA-256, so
    that a tool run from another folder, or after the file changed, finds it or refuses (the built-in byte
    tokenizer: its name only)."""
    if path in BUILT_IN:
        return {"path": path}
    absolute = os.path.abspath(os.path.expanduser(path))
    return {"path": absolute, "sha256": tokenizer_sha256(absolute)}


def verified_tokenizer_path(recorded: dict[str, Any], info_file: Path) -> str:
    """The tokenizer path ``info_file`` records, once its file is found with the recorded SHA-256 (a one-line
    ValueError otherwise); a record without a hash (older checkpoints) is used as it is, with a warning."""
    path, want = str(recorded.get("path") or ""), recorded.get("sha256")
    if path in BUILT_IN:
        return path
    if not isinstance(want, str):
        logger.warning("%s records tokenizer %s without its sha256 (an older checkpoint): unverified", info_file, path)
        return path
    try:
        got = tokenizer_sha256(path)
    except (OSError, ValueError):
        raise TokenizerError(
            f"{info_file}: the tokenizer it was trained with, {path}, is not found; restore it there or pass the "
            "tokenizer file (eval/generate: --tokenizer)"
        ) from None
    if got != want:
        raise TokenizerError(
            f"{info_file}: tokenizer {path} has sha256 {got[:16]}..., not the {want[:16]}... recorded at training: "
            "the file changed; restore the one it was trained with or pass it (eval/generate: --tokenizer)"
        )
    return path
