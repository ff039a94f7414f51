"""Hugging Face pre-tokenizer regexes (Oniguruma, Ruby syntax) rewritten for tiktoken's engine (fancy-regex), for
:mod:`titanlite.tokenizer.hf`."""

from __future__ import annotations

import re
import string

from titanlite.errors import TokenizerError


def oniguruma_to_tiktoken(path: str, regex: str) -> str:
    """A Split regex as HF's engine (Oniguruma, Ruby syntax) reads it, rewritten for tiktoken's (fancy-regex),
    where the two differ (each checked against ``tokenizers``):

    - ``X{n,m}+`` (also ``{n}+``, ``{n,}+``, ``{,m}+``): possessive for fancy-regex, but for Oniguruma the
      interval repeated one or more times, so OpenAI's cl100k ``\\p{N}{1,3}+`` keeps ``"1234"`` in one
      piece for HF. Rewritten ``(?:X{n,m})+`` (a lazy ``+?`` after it stays lazy).
    - ``^`` and ``$`` outside classes: line anchors for Oniguruma, text anchors for fancy-regex; rewritten
      ``(?m:^)``, ``(?m:$)``.
    - The inline flag ``m``: "dot matches newline" for Oniguruma, so it becomes fancy-regex's ``s``.

    Possessive ``?+``, ``*+``, ``++`` and atomic groups ``(?>...)`` mean the same to both and are kept.
    Refused in one line naming the construct: the flag ``s`` (not Oniguruma's: HF cannot load the file),
    the flag ``x`` (free spacing), the absent operator ``(?~...)`` and conditionals ``(?(...)...)``.
    """
    out: list[str] = []
    groups: list[int] = []  # where each open group starts in ``out``
    last: int | None = None  # where the atom a quantifier would apply to starts in ``out``
    i, n = 0, len(regex)

    def refuse(construct: str, why: str) -> TokenizerError:
        return TokenizerError(f"{path}: pre-tokenizer regex construct {construct!r} at {i}: {why}")

    while i < n:
        c = regex[i]
        if c == "\\":
            j = _escape_end(regex, i)
            last = len(out)
            out.append(regex[i:j])
            i = j
            continue
        if c == "[":
            j = _class_end(path, regex, i)
            last = len(out)
            out.append(regex[i:j])
            i = j
            continue
        if c == "(":
            head, j = _group_head(regex, i)
            if head.startswith(("(?~", "(?(")):
                raise refuse(head, "HF's engine reads it, tiktoken's cannot")
            flags = (
                head[2:-1] if head[:2] == "(?" and head[-1] in ":)" and head[2:-1].replace("-", "").isalpha() else None
            )
            if flags is not None:
                if "s" in flags:
                    raise refuse(head, "the flag s is not Oniguruma's (HF cannot load this regex)")
                if "x" in flags:
                    raise refuse(head, "free-spacing mode (x) is not supported")
                head = head[:2] + flags.replace("m", "s") + head[-1]
            if head.endswith(")"):  # a flag switch for the rest of the group: no atom
                out.append(head)
                i = j
                continue
            groups.append(len(out))
            out.append(head)
            last, i = None, j
            continue
        if c == ")":
            last = groups.pop() if groups else None
            out.append(c)
            i += 1
            continue
        quantifier = _quantifier(regex, i)
        if quantifier:
            j = i + len(quantifier)
            interval = quantifier.startswith("{")
            if interval and j < n and regex[j] == "+" and last is not None:
                out[last:] = ["(?:" + "".join(out[last:]) + quantifier + ")"]
                quantifier, j = "+", j + 1
            out.append(quantifier)
            if j < n and regex[j] in "?+" and not (interval and regex[j] == "+"):  # lazy or possessive
                out.append(regex[j])
                j += 1
            i = j
            continue
        last = len(out)
        out.append({"^": "(?m:^)", "$": "(?m:$)"}.get(c, c))
        if c == "|":
            last = None
        i += 1
    return "".join(out)


_INTERVAL = re.compile(r"\{(?:\d+(?:,\d*)?|,\d+)\}")


def _quantifier(regex: str, i: int) -> str:
    """The quantifier starting at ``regex[i]`` (``*``, ``+``, ``?`` or an interval ``{n,m}``), or ""."""
    if regex[i] in "*+?":
        return regex[i]
    m = _INTERVAL.match(regex, i) if regex[i] == "{" else None
    return m.group() if m else ""


def _escape_end(regex: str, i: int) -> int:
    """Where the escape sequence at ``regex[i] == "\\"`` ends (``\\p{..}``, ``\\x{..}``, ``\\xHH``,
    ``\\uHHHH``, ``\\k<..>`` as one)."""
    kind = regex[i + 1 : i + 2]
    if kind in ("p", "P", "x", "o") and regex[i + 2 : i + 3] == "{":
        close = regex.find("}", i + 3)
        return len(regex) if close < 0 else close + 1
    if kind in ("k", "g") and regex[i + 2 : i + 3] in ("<", "'"):
        close = regex.find(">" if regex[i + 2] == "<" else "'", i + 3)
        return len(regex) if close < 0 else close + 1
    width = {"x": 2, "u": 4}.get(kind, 0)
    j = i + 2
    while j < i + 2 + width and j < len(regex) and regex[j] in string.hexdigits:
        j += 1
    return min(j, len(regex))


def _class_end(path: str, regex: str, i: int) -> int:
    """Where the character class opening at ``regex[i] == "["`` closes (classes nest in Oniguruma)."""
    depth, j = 1, i + 1
    if regex[j : j + 1] == "^":
        j += 1
    if regex[j : j + 1] == "]":  # a "]" first in a class is literal
        j += 1
    while j < len(regex):
        c = regex[j]
        if c == "\\":
            j = _escape_end(regex, j)
            continue
        depth += {"[": 1, "]": -1}.get(c, 0)
        j += 1
        if depth == 0:
            return j
    raise TokenizerError(f"{path}: pre-tokenizer regex has an unclosed character class at {i}")


def _group_head(regex: str, i: int) -> tuple[str, int]:
    """The opening of the group at ``regex[i] == "("``: ``(``, ``(?:``, ``(?>``, ``(?=``, ``(?<name>``,
    a flag group ``(?i:`` or switch ``(?i)`` ...; and where it ends."""
    if regex[i + 1 : i + 2] != "?":
        return "(", i + 1
    m = re.compile(r"\(\?(?:[:>=!~(]|<[=!]|<\w+>|'\w+'|P<\w+>|#[^)]*\)|[a-zA-Z-]*[:)])").match(regex, i)
    if m is None:
        return "(?", i + 2
    return m.group(), m.end()
