"""``python -m titanlite.generate``: its arguments and :func:`main`. Bad input is one
:class:`~titanlite.errors.UsageError` line, not argparse's usage text."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import torch

from titanlite.checkpoint.load_model import load_model
from titanlite.data.chat import chat_prompt_ids, special_id
from titanlite.errors import UsageError, UserError, one_line
from titanlite.generate import generate
from titanlite.utils.argtypes import UsageErrorParser, number
from titanlite.utils.dtypes import DTYPES


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The parsed arguments and the prompts (``--prompt`` then ``--prompt-file``'s lines), checked."""
    a = _parser().parse_args(argv)
    prompts = _read_prompts(a)
    _check_numbers(a)
    return a, prompts


def _parser() -> argparse.ArgumentParser:
    p = UsageErrorParser(prog="python -m titanlite.generate", description="Continue prompts with a trained model.")
    p.add_argument("--checkpoint", required=True, help="a titanlite checkpoint step folder or a Hugging Face folder")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    p.add_argument("--prompt-file", help="a UTF-8 file with one prompt per line (empty lines skipped)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0: off (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="1: off (default)")
    seed = number(int, at_least=-(2**63), at_most=2**64 - 1)  # what torch.Generator.manual_seed takes
    p.add_argument("--seed", type=seed, default=0, help="the sampling generator's seed")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt and line")
    p.add_argument("--tokenizer", help="tokenizer path, or bytes for the built-in byte-level tokenizer")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--extensions", default="", metavar="MODULES", help="comma-separated modules registering a family")
    p.add_argument("--no-bos", action="store_true", help="do not start the prompts with BOS")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole prefix each step")
    p.add_argument("--compile", action="store_true", help="compile the one-token decode step (CUDA graphs on CUDA)")
    p.add_argument(
        "--context-window",
        type=int,
        metavar="N",
        help="predict from the last N tokens only (a sliding window; e.g. the trained training.seq_len)",
    )
    p.add_argument(
        "--chat", action="store_true", help="prompts are user turns of the Llama 3 chat template; stop at <|eot_id|>"
    )
    return p


def _read_prompts(a: argparse.Namespace) -> list[str]:
    prompts = list(a.prompt)
    if a.prompt_file is not None:
        try:
            with open(a.prompt_file, encoding="utf-8") as f:
                prompts += [line for line in f.read().splitlines() if line]
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--prompt-file {a.prompt_file}: cannot be read ({type(e).__name__}: {e})") from None
    if not prompts:
        raise UsageError("no prompt: pass --prompt TEXT or --prompt-file FILE")
    return prompts


def _check_numbers(a: argparse.Namespace) -> None:
    for flag, value in (("--max-new-tokens", a.max_new_tokens), ("--top-k", a.top_k)):
        if value < 0:
            raise UsageError(f"{flag} must be >= 0, got {value}")
    if a.context_window is not None and a.context_window < 1:
        raise UsageError(f"--context-window must be >= 1, got {a.context_window}")
    if not a.temperature >= 0:
        raise UsageError(f"--temperature must be >= 0 (0: greedy), got {a.temperature}")
    if not 0 < a.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {a.top_p}")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: CUDA is not available")


def _run(a: argparse.Namespace, prompts: list[str]) -> list[dict]:
    extensions = [m.strip() for m in a.extensions.split(",") if m.strip()]
    loaded = load_model(
        a.checkpoint, device=a.device, dtype=DTYPES[a.dtype], tokenizer_path=a.tokenizer, extensions=extensions
    )
    tok = loaded.tokenizer
    eos_ids = tuple(loaded.eos_ids)
    if a.chat:  # the rendering starts with <|begin_of_text|> itself; a reply ends with <|eot_id|>
        prompt_ids = [chat_prompt_ids(tok, p) for p in prompts]
        eos_ids += (special_id(tok, "<|eot_id|>"),)
    else:
        prompt_ids = [tok.encode(p, bos=not a.no_bos) for p in prompts]
    completions = generate(
        loaded.model,
        prompt_ids,
        max_new_tokens=a.max_new_tokens,
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        eos_ids=eos_ids,
        generator=torch.Generator(device=a.device).manual_seed(a.seed),
        use_cache=not a.no_cache,
        compile=a.compile,
        context_window=a.context_window,
        trained_seq_len=loaded.trained_seq_len,
    )
    records = []
    for text, ids, out in zip(prompts, prompt_ids, completions):
        body = out[:-1] if out and out[-1] in eos_ids else out
        records.append({"prompt": text, "completion": tok.decode(body), "prompt_ids": ids, "completion_ids": out})
    return records


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m titanlite.generate``; returns the exit status (2: bad input, with one ``error:`` line on stderr)."""
    try:
        a, prompts = parse_args(argv)
        records = _run(a, prompts)
    except UserError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return e.exit_code
    for i, r in enumerate(records):
        if a.json:
            print(json.dumps(r))
        else:
            print(("\n" if i else "") + r["prompt"] + r["completion"])
    return 0
