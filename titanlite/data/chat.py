"""Chat data: the Llama 3 chat template, the assistant-only loss mask, and chat datasets (docs/recipes.md).

:func:`render_conversation` turns ``{"role", "content"}`` messages into ids through the tokenizer's own special
tokens (never by tokenizing template text, so user text that looks like ``<|eot_id|>`` stays ordinary bytes)::

    <|begin_of_text|> ( <|start_header_id|> role <|end_header_id|> "\\n\\n" content.strip() <|eot_id|> )*

with a mask of 1 on each assistant message's content and its ``<|eot_id|>`` (so the model learns to stop).
:func:`encode_conversations` makes one token stream of every conversation's rendering + EOS (the in-memory
``"chat"`` dataset); :func:`load_chat_data` gives the same for prepared chat shards.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from titanlite.config.toml_io import decode_utf8
from titanlite.data.sources import list_files
from titanlite.errors import DataError
from titanlite.utils.nesting import loads_json

ROLES = ("system", "user", "assistant", "tool", "ipython")
SPECIAL_TOKENS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


def special_id(tokenizer: Any, token: str) -> int:
    """The id of special ``token`` in ``tokenizer``; a one-line error naming both when it has none."""
    try:
        return tokenizer.encoding.encode_single_token(token)
    except KeyError:
        name = getattr(tokenizer, "path", "") or getattr(tokenizer, "name", "tokenizer")
        raise DataError(
            f"tokenizer {name!r} has no special token {token} (needed by the Llama 3 chat template)"
        ) from None


def check_messages(messages: Any, where: str = "conversation") -> None:
    """A one-line ``ValueError("<where>: ...")`` unless ``messages`` is a non-empty list of
    ``{"role": <known role>, "content": <str>}``."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(f"{where}: messages[{i}] must be an object with 'role' and 'content'")
        if m.get("role") not in ROLES:
            raise DataError(f"{where}: messages[{i}] has role {m.get('role')!r}, expected one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise DataError(f"{where}: messages[{i}] ('{m['role']}') needs a string 'content'")


def render_conversation(
    tokenizer: Any, messages: Sequence[dict], add_generation_prompt: bool = False, where: str = "conversation"
) -> tuple[list[int], list[int]]:
    """``(ids, mask)`` of ``messages`` in the Llama 3 chat template (see the module docstring); with
    ``add_generation_prompt`` the assistant header + ``"\\n\\n"`` the model's reply continues from."""
    check_messages(messages, where)
    bot, start, end, eot = (special_id(tokenizer, t) for t in SPECIAL_TOKENS)
    newlines = tokenizer.encoding.encode_ordinary("\n\n")

    def header(role: str) -> list[int]:
        return [start, *tokenizer.encoding.encode_ordinary(role), end, *newlines]

    ids, mask = [bot], [0]
    for m in messages:
        head = header(m["role"])
        body = tokenizer.encoding.encode_ordinary(m["content"].strip()) + [eot]
        ids += head + body
        mask += [0] * len(head) + [int(m["role"] == "assistant")] * len(body)
    if add_generation_prompt:
        head = header("assistant")
        ids += head
        mask += [0] * len(head)
    return ids, mask


def iter_conversations(path: str | os.PathLike) -> Iterator[tuple[str, list[dict]]]:
    """``("<file>:<line>", messages)`` for every conversation in a JSONL file or folder of them."""
    for file in list_files(path):
        with open(file, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                line = decode_utf8(raw, file, lineno)  # bytes that are not UTF-8: an error naming file and line
                if not line.strip():
                    continue
                where = f"{file}:{lineno}"
                try:
                    record = loads_json(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: not JSON ({e.msg})") from None
                if not isinstance(record, dict) or "messages" not in record:
                    raise DataError(f"{where}: expected an object with a 'messages' list")
                check_messages(record["messages"], where)
                yield where, record["messages"]


def encode_conversations(tokenizer: Any, path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """``(tokens int64, mask uint8, doc_offsets int64 [D+1])``: every conversation of ``path`` as its
    rendering + EOS (mask 0), one document each. An input with no conversation is an error."""
    ids: list[int] = []
    mask: list[int] = []
    offsets = [0]
    for where, messages in iter_conversations(path):
        i, m = render_conversation(tokenizer, messages, where=where)
        ids += i + [tokenizer.eos_id]
        mask += m + [0]
        offsets.append(len(ids))
    if len(offsets) == 1:
        raise DataError(f'{path}: no conversations found (expected JSONL lines {{"messages": [...]}})')
    return (
        torch.tensor(ids, dtype=torch.int64),
        torch.tensor(mask, dtype=torch.uint8),
        np.asarray(offsets, dtype=np.int64),
    )


def chat_prompt_ids(tokenizer: Any, prompt: str | Sequence[dict]) -> list[int]:
    """The ids a chat model continues from: ``prompt`` (a user message's text, or a list of messages)
    rendered with the assistant generation header."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return render_conversation(tokenizer, messages, add_generation_prompt=True)[0]


def load_chat_data(kind: str, path: str | os.PathLike, split: str, tokenizer: Any) -> tuple[Any, Any, np.ndarray]:
    """``(tokens store, mask store, doc_offsets)`` of chat data: ``kind == "chat"`` reads raw JSONL
    conversations (``split`` is not used: the path is the split); ``kind == "shards"`` opens a folder
    prepared with ``--format chat`` (its ``split``)."""
    if kind == "chat":
        return encode_conversations(tokenizer, path)
    if kind == "shards":
        from titanlite.data.shards import ShardedTokens

        store = ShardedTokens(path, split, tokenizer)  # refuses shards made with another tokenizer
        return store, store.masks(), store.doc_offsets()
    raise DataError(f"dataset kind {kind!r} has no loss masks: expected 'chat' or prepared chat 'shards'")
