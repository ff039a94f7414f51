"""Command lines of the DCP <-> Hugging Face converters (``titanlite convert dcp-to-hf | hf-to-dcp``): wrong
inputs are one ``error: ...`` line naming the file and exit status 2, and nothing that existed is modified."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from titanlite.checkpoint.hf_export import dcp_to_hf
from titanlite.checkpoint.hf_import import hf_to_dcp
from titanlite.errors import UsageError, UserError, one_line
from titanlite.utils.dtypes import DTYPES, dtype_name


class _Printer:
    """One line per tensor (or nothing with --quiet), with running totals."""

    def __init__(self, quiet: bool):
        self.quiet, self.start, self.bytes = quiet, time.perf_counter(), 0

    def __call__(self, i: int, n: int, name: str, shape: tuple, dtype: torch.dtype) -> None:
        self.bytes += math.prod(shape) * dtype.itemsize
        if not self.quiet:
            totals = f"({self.bytes / 1e6:,.1f} MB, {time.perf_counter() - self.start:.1f} s)"
            print(f"[{i:>{len(str(n))}}/{n}] {name} {list(shape)} {dtype_name(dtype)} {totals}", flush=True)


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or a number of bytes; UsageError unless a finite size of at least a byte."""
    t = text.strip().upper().replace(" ", "").removesuffix("B")
    base, t = (1024, t[:-1]) if t.endswith("I") else (1000, t)
    power = "KMGT".find(t[-1:]) + 1  # 0 without a unit letter
    try:
        size = float(t[:-1] if power else t) * base**power
    except ValueError:  # not a number
        size = math.nan
    if not 1 <= size < math.inf:  # 1e400 is inf (int() of it overflowed), NaN fails too
        raise UsageError(f"{text!r} is not a size of at least one byte")
    return int(size)


def _error(msg: object) -> int:
    """Print ``error: <msg>`` as one line on stderr; the exit status 2."""
    print(f"error: {one_line(msg)}", file=sys.stderr)
    return 2


def _run(fn, a: argparse.Namespace, src: str, out: str, note: str = "", **kwargs) -> int:
    extensions = [m.strip() for m in a.extensions.split(",") if m.strip()]
    try:
        fn(src, out, progress=_Printer(a.quiet), extensions=extensions, **kwargs)
    except UserError as e:
        return _error(e)
    print(f"wrote {out}{note}")
    return 0


def _add_common_args(p: argparse.ArgumentParser, note: str) -> None:
    modules = "comma-separated modules that register the model family, as [job] extensions (e.g. torchtitan_ext.qwen3)"
    p.add_argument("--extensions", default="", metavar="MODULES", help=modules + note)
    p.add_argument("-q", "--quiet", action="store_true", help="no per-tensor progress lines")


def main_dcp_to_hf(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="titanlite convert dcp-to-hf",
        description=(
            "Convert a titanlite DCP checkpoint step folder (or a torchtitan v0.2 / 0.3.0 one of a Llama 3 "
            "model) into a Hugging Face folder (model.safetensors "
            "[sharded with an index past --max-shard-size], config.json, generation_config.json, and the recorded "
            "tokenizer as tokenizer.json + tokenizer_config.json). A family "
            "from an extension needs that extension in --extensions: the modules a checkpoint records are "
            "never imported on its word alone (a checkpoint is data, an import runs code)."
        ),
    )
    p.add_argument("dcp_step_dir", help="a checkpoint step folder, e.g. outputs/checkpoint/step-1000")
    p.add_argument("hf_out_dir", help="output folder (must not exist, or be empty)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="dtype of the written weights (default: as stored)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB (default 5GB)")
    p.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=(
            "a llama3 model arg for a torchtitan step folder (no checkpoint.json), e.g. n_heads=16; repeatable. "
            "Otherwise the shapes and torchtitan's llama3 flavors decide (see torchtitan_ext.compat.format)"
        ),
    )
    p.add_argument(
        "--no-tokenizer",
        action="store_true",
        help="export without tokenizer files (by default the recorded tokenizer is required, checked by its hash)",
    )
    _add_common_args(p, "; a checkpoint that needs one not given is refused with the module to pass")
    a = p.parse_args(argv)
    try:
        max_bytes = parse_size(a.max_shard_size)
    except UsageError as e:
        return _error(f"--max-shard-size: cannot read {a.max_shard_size!r} ({e})")
    try:
        model_args = dict(parse_model_arg(text) for text in a.model_arg)
    except UsageError as e:
        return _error(e)
    kwargs = dict(dtype=DTYPES.get(a.dtype), max_shard_bytes=max_bytes, model_args=model_args)
    kwargs.update(no_tokenizer=a.no_tokenizer)
    return _run(dcp_to_hf, a, a.dcp_step_dir, a.hf_out_dir, **kwargs)


def parse_model_arg(text: str) -> tuple[str, Any]:
    """``"n_heads=16"`` -> ``("n_heads", 16)``: the value as JSON (numbers, true/false, null),
    else as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise UsageError(f"--model-arg {text!r}: expected KEY=VALUE")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def main_hf_to_dcp(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="titanlite convert hf-to-dcp",
        description=(
            "Convert a Hugging Face model folder (config.json + safetensors; Llama, or a family from an "
            "extension, see --extensions) into a model-only titanlite DCP step folder, loadable with "
            "[checkpoint] initial_load_path under any parallel layout."
        ),
    )
    p.add_argument("hf_dir", help="a Hugging Face model folder")
    p.add_argument("dcp_out_dir", help="output folder (must not exist, or be empty)")
    _add_common_args(p, "; recorded in checkpoint.json for the way back")
    a = p.parse_args(argv)
    note = f" (use it with --checkpoint.initial_load_path {a.dcp_out_dir})"
    return _run(hf_to_dcp, a, a.hf_dir, a.dcp_out_dir, note)
