"""Hugging Face ``tokenizer.json`` files (byte-level BPE) read into tiktoken's terms, exactly or not at all
(docs/extensions.md, "Tokenizers"), without the ``tokenizers`` library.

The vocabulary's strings (GPT-2's byte-to-character alphabet) map back to bytes for the ranks. tiktoken merges
the adjacent pair whose concatenation has the lowest id, HF the pair first in its merge list: :func:`_check_merges`
refuses lists on which the two would differ. Anything else tiktoken cannot represent exactly (Unigram, a
lowercasing normalizer, a prefix space, missing byte tokens, ...) is a one-line error naming the file.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field

from titanlite.errors import TokenizerError
from titanlite.tokenizer.hf_regex import oniguruma_to_tiktoken
from titanlite.utils.nesting import load_json

# GPT-2's pre-tokenization regex: what a bare ByteLevel(use_regex=true) pre-tokenizer splits with.
GPT2_PAT_STR = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Bytes that can occur in UTF-8 text; a byte-level vocabulary needs a token for each.
_UTF8_BYTES = [b for b in range(0xF5) if b not in (0xC0, 0xC1)]
# Normalizers that change nothing (None, an empty Sequence) or that titanlite applies itself (NFC).
_NORMALIZERS = {"NFC"}


@dataclass
class HFTokenizerSpec:
    """What a tokenizer.json (+ tokenizer_config.json) says, in tiktoken's terms."""

    ranks: dict[bytes, int]
    pat_str: str
    special_tokens: dict[str, int]
    bos_token: str | None
    eos_token: str | None
    normalizer: str | None  # "NFC" or None
    # added tokens with "special": false, which HF matches in ordinary text: content -> "normalized" flag
    # (matched after the normalizer when true, in the raw text when false)
    matched: dict[str, bool] = field(default_factory=dict)


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character map (printable bytes stand for themselves, the rest for U+0100 onwards), in which
    byte-level BPE vocabularies store each token's bytes."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}


def byte_level_bytes(text: str) -> bytes:
    """The bytes HF's ByteLevel decoder gives for ``text``: a character of the byte-level alphabet is its
    byte, any other character its UTF-8."""
    decode = _alphabet_inverse()
    return b"".join(bytes([decode[c]]) if c in decode else c.encode() for c in text)


@functools.cache
def _alphabet_inverse() -> dict[str, int]:
    return {c: b for b, c in byte_level_alphabet().items()}


def resolve_tokenizer_file(path: str) -> str:
    """The file a ``[model] tokenizer_path`` names: the path itself, or in an HF model folder its
    ``tokenizer.json``, else ``original/tokenizer.model`` (Meta's tiktoken file)."""
    if not os.path.isdir(path):
        return path
    for name in ("tokenizer.json", os.path.join("original", "tokenizer.model")):
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    raise TokenizerError(
        f"{path}: tokenizer path is a folder without tokenizer.json or original/tokenizer.model "
        "(expected a tiktoken file, a tokenizer.json or an HF model folder)"
    )


def is_hf_tokenizer_file(path: str) -> bool:
    """A ``*.json`` file is read as a tokenizer.json, anything else as a tiktoken file: by name, so a JSON Lines
    corpus passed by mistake gets the tiktoken reader's error naming its first line."""
    return path.endswith(".json")


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = load_json(f)
    except FileNotFoundError:
        raise TokenizerError(f"{path}: tokenizer file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: cannot read tokenizer file: {e}") from None
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def load_hf_tokenizer(path: str) -> HFTokenizerSpec:
    """Read a byte-level BPE tokenizer.json (and tokenizer_config.json beside it, when present)."""
    data = _read_json(path)
    model = data.get("model")
    if not isinstance(model, dict) or model.get("type", "BPE" if "merges" in (model or {}) else None) != "BPE":
        kind = model.get("type") if isinstance(model, dict) else model
        raise TokenizerError(f"{path}: model type {kind!r} cannot be represented by tiktoken (only byte-level BPE)")
    normalizer = _normalizer(path, data.get("normalizer"))
    pat_str = _pattern(path, data.get("pre_tokenizer"))
    _check_bpe_options(path, model)
    specials, matched = _added_tokens(path, data.get("added_tokens") or [])
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not vocab:
        raise TokenizerError(f"{path}: model.vocab must be a non-empty object of token -> id")
    _refuse_renumbered_added_tokens(path, specials, vocab)
    # A special token trained into the vocabulary (same text, same id) is only a special token.
    ranks = _ranks(path, {t: i for t, i in vocab.items() if specials.get(t) != i})
    if clash := sorted(set(ranks.values()) & set(specials.values())):
        raise TokenizerError(f"{path}: id {clash[0]} is both a vocab token and an added token with other text")
    _check_merges(path, model, ranks)
    bos, eos = _bos_eos(path, specials)
    return HFTokenizerSpec(ranks, pat_str, specials, bos, eos, normalizer, matched)


def _normalizer(path: str, spec) -> str | None:
    """None or "NFC" (which titanlite applies before tiktoken); anything else is refused."""
    if spec is None:
        return None
    steps = spec.get("normalizers") if isinstance(spec, dict) and spec.get("type") == "Sequence" else [spec]
    kinds = [n.get("type") if isinstance(n, dict) else n for n in steps or []]
    if not kinds:
        return None
    if len(kinds) == 1 and kinds[0] in _NORMALIZERS:
        return kinds[0]
    raise TokenizerError(f"{path}: normalizer {'+'.join(map(str, kinds))} cannot be represented by tiktoken")


def _pattern(path: str, spec) -> str:
    """The regex tiktoken splits with: ByteLevel's own (GPT-2) or the Split regex in front of ByteLevel."""
    steps = spec.get("pretokenizers") if isinstance(spec, dict) and spec.get("type") == "Sequence" else [spec]
    steps = steps if isinstance(steps, list) else [steps]
    kinds = [s.get("type") if isinstance(s, dict) else None for s in steps]
    byte_level = steps[-1] if kinds and kinds[-1] == "ByteLevel" else None
    if byte_level is None or len(steps) > 2 or (len(steps) == 2 and kinds[0] != "Split"):
        shown = "+".join(map(str, kinds))
        raise TokenizerError(
            f"{path}: pre-tokenizer {shown} is not byte-level ([Split +] ByteLevel); tiktoken cannot run it"
        )
    if byte_level.get("add_prefix_space"):
        raise TokenizerError(f"{path}: ByteLevel add_prefix_space=true cannot be represented by tiktoken")
    if len(steps) == 1:
        if not byte_level.get("use_regex", True):
            raise TokenizerError(f"{path}: ByteLevel without a regex leaves text unsplit; tiktoken cannot do that")
        return GPT2_PAT_STR
    split = steps[0]
    if byte_level.get("use_regex", True):
        raise TokenizerError(
            f"{path}: a Split followed by ByteLevel(use_regex=true) splits twice; tiktoken splits once"
        )
    pattern = split.get("pattern")
    regex = pattern.get("Regex") if isinstance(pattern, dict) else None
    if not isinstance(regex, str) or split.get("behavior") != "Isolated" or split.get("invert"):
        raise TokenizerError(
            f"{path}: only a Split with a Regex pattern, behavior Isolated and invert=false is supported"
        )
    regex = oniguruma_to_tiktoken(path, regex)
    # HF keeps the text between matches as pieces of their own; tiktoken would drop it. The second branch
    # takes such a gap: characters where the regex does not match, up to where it matches again.
    return f"(?:{regex})|(?:(?!(?:{regex}))(?s:.))+"


def _check_bpe_options(path: str, model: dict) -> None:
    """BPE options that change what HF produces in ways tiktoken has no counterpart for."""
    neutral = {
        "dropout": (None, 0, 0.0),
        "continuing_subword_prefix": (None, ""),
        "end_of_word_suffix": (None, ""),
        "byte_fallback": (None, False),
    }
    for key, off in neutral.items():
        if model.get(key) not in off:
            raise TokenizerError(f"{path}: BPE {key}={model.get(key)!r} cannot be represented by tiktoken")


MAX_ID = 2**31 - 1  # tiktoken's ranks are 32-bit, and no vocabulary comes near (an id of 1e15 overflowed)


def _is_id(i) -> bool:
    return isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_ID


def _ranks(path: str, vocab: dict) -> dict[bytes, int]:
    """The vocabulary mapped back from byte-level strings to bytes: tiktoken's mergeable ranks."""
    decode = _alphabet_inverse()
    ranks: dict[bytes, int] = {}
    for token, i in vocab.items():
        if not _is_id(i):
            raise TokenizerError(f"{path}: vocab id of {token!r} must be an integer in [0, {MAX_ID:,}], got {i!r}")
        try:
            ranks[bytes(decode[c] for c in token)] = i
        except KeyError:
            bad = next(c for c in token if c not in decode)
            raise TokenizerError(
                f"{path}: vocab token {token!r} (id {i}) has {bad!r}, which is not in the byte-level alphabet; "
                "not a byte-level BPE vocabulary"
            ) from None
    if len(set(ranks.values())) != len(ranks):
        raise TokenizerError(f"{path}: vocab gives the same id to two tokens")
    check_every_byte(path, ranks, "HF would drop such bytes, tiktoken cannot")
    return ranks


def check_every_byte(path: str, ranks: dict[bytes, int], why: str) -> None:
    """ValueError (one line) unless every byte that UTF-8 text can hold has a single-byte token."""
    if missing := [b for b in _UTF8_BYTES if bytes([b]) not in ranks]:
        shown = ", ".join(f"0x{b:02x}" for b in missing[:8]) + (", ..." if len(missing) > 8 else "")
        raise TokenizerError(f"{path}: no single-byte token for {len(missing)} byte value(s) ({shown}); {why}")


def _added_tokens(path: str, added) -> tuple[dict[str, int], dict[str, bool]]:
    """Every added token as a tiktoken special token, and the non-special ones (``"special": false``), which
    HF matches in ordinary text, with their ``normalized`` flag. Special tokens are never matched in
    documents: titanlite's choice (HF's ``encode_special_tokens=True``)."""
    if not isinstance(added, list) or not all(isinstance(e, dict) for e in added):
        raise TokenizerError(f"{path}: added_tokens must be a list of objects")
    out: dict[str, int] = {}
    matched: dict[str, bool] = {}
    for entry in added:
        content, i = entry.get("content"), entry.get("id")
        if not isinstance(content, str) or not _is_id(i) or content in out or i in out.values():
            raise TokenizerError(
                f"{path}: added token {entry!r} needs a unique 'content' string and an integer 'id' in [0, {MAX_ID:,}]"
            )
        if any(entry.get(k) for k in ("lstrip", "rstrip", "single_word")):
            raise TokenizerError(f"{path}: added token {content!r} has lstrip/rstrip/single_word, which tiktoken lacks")
        out[content] = i
        if not entry.get("special", False):
            if not content:
                raise TokenizerError(f"{path}: added token id {i} is empty; HF cannot match it in text")
            matched[content] = bool(entry.get("normalized", True))
    return out, matched


def _refuse_renumbered_added_tokens(path: str, specials: dict[str, int], vocab: dict) -> None:
    """An added token whose text is also a vocabulary token under another id: HF ``tokenizers`` then encodes the
    text as the vocabulary id and drops the added one, which tiktoken's special tokens cannot express: refused."""
    for content, i in specials.items():
        if _is_id(other := vocab.get(content)) and other != i:
            raise TokenizerError(
                f"{path}: added token {content!r} has id {i} but is also vocabulary token id {other}, which HF "
                f"tokenizers encodes it as instead; expected each added token's id to be its vocabulary id "
                f"(set it to {other}) or its text to be absent from model.vocab"
            )


def _merge_pairs(path: str, merges) -> list[tuple[str, str]]:
    pairs = []
    for n, m in enumerate(merges or []):
        pair = tuple(m.split(" ")) if isinstance(m, str) else tuple(m) if isinstance(m, list) else ()
        if len(pair) != 2 or not all(isinstance(p, str) and p for p in pair):
            raise TokenizerError(f"{path}: merge {n} is {m!r}, expected 'left right' or [left, right]")
        pairs.append(pair)
    return pairs


def _check_merges(path: str, model: dict, ranks: dict[bytes, int]) -> None:
    """Refuse a merge list that tiktoken's rank-order BPE cannot follow: (1) every merge makes a vocab token from
    two, with ids never decreasing along the list ("lowest merge first" = "lowest id first"); (2) without
    ``ignore_merges`` every multi-byte token is made by some merge. Not checked, as it depends on which pieces can
    meet: splits the list lacks, whole-piece tokens, merges competing on overlapping pieces. Requiring those would
    refuse every HF-trained BPE (~1,500 unlisted splits in a tiny one's 3,000 tokens) although its ids match; the
    parity tests compare converted and trained files with HF on real text.
    """
    decode = _alphabet_inverse()
    made: set[bytes] = set()
    last = -1
    for n, (left, right) in enumerate(_merge_pairs(path, model.get("merges"))):
        try:
            lb, rb = bytes(decode[c] for c in left), bytes(decode[c] for c in right)
        except KeyError:
            raise TokenizerError(f"{path}: merge {n} ({left} {right}) is not byte-level text") from None
        rank = ranks.get(lb + rb)
        if lb not in ranks or rb not in ranks or rank is None:
            raise TokenizerError(f"{path}: merge {n} ({left} {right}) uses or makes a token not in the vocab")
        if rank < last:
            raise TokenizerError(
                f"{path}: merge {n} ({left} {right}) makes id {rank} after a merge made id {last}; tiktoken merges "
                "in id order, so its ids would differ from HF's"
            )
        last = rank
        made.add(lb + rb)
    if not model.get("ignore_merges"):
        for token, i in ranks.items():
            if len(token) > 1 and token not in made:
                raise TokenizerError(
                    f"{path}: vocab token id {i} is made by no merge and ignore_merges is false: HF never outputs "
                    "it, tiktoken would"
                )


def _config_token(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _bos_eos(path: str, specials: dict[str, int]) -> tuple[str | None, str | None]:
    """BOS/EOS token text: from tokenizer_config.json beside the file, else Llama 3's / GPT-2's names."""
    config_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    if os.path.isfile(config_path):
        config = _read_json(config_path)
        bos, eos = _config_token(config.get("bos_token")), _config_token(config.get("eos_token"))
        for key, tok in (("bos_token", bos), ("eos_token", eos)):
            if tok is not None and tok not in specials:
                raise TokenizerError(f"{config_path}: {key} {tok!r} is not an added token of {path}")
        if eos is not None:
            return bos, eos
    if "<|end_of_text|>" in specials:
        return ("<|begin_of_text|>" if "<|begin_of_text|>" in specials else None), "<|end_of_text|>"
    if "<|endoftext|>" in specials:
        return None, "<|endoftext|>"
    raise TokenizerError(
        f"{path}: no EOS token: tokenizer_config.json has no eos_token and no known end token is added"
    )


def tokenizer_files(path: str) -> dict[str, str]:
    """The files that make up the tokenizer at ``path``, as ``{name in an HF model folder: source file}``: a
    tokenizer.json with its tokenizer_config.json, a tiktoken file as ``original/tokenizer.model``; empty for the
    built-in tokenizer or a path that no longer exists."""
    if path in ("", "bytes") or not os.path.exists(path):
        return {}
    try:
        file = resolve_tokenizer_file(path)
    except ValueError:
        return {}
    if not is_hf_tokenizer_file(file):
        return {os.path.join("original", "tokenizer.model"): file}
    files = {"tokenizer.json": file}
    config = os.path.join(os.path.dirname(file), "tokenizer_config.json")
    if os.path.isfile(config):
        files["tokenizer_config.json"] = config
    return files
