"""Command lines of the DCP <-> Hugging Face converters (``scripts/convert_*.py``).

Wrong inputs print one ``error: ...`` line on stderr and exit with status 2; nothing that existed
before is modified (outputs are written to a new folder and renamed into place at the end).
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Optional, Sequence

import torch

from titanlite.checkpoint.hf import DTYPES, dcp_to_hf, hf_to_dcp
from titanlite.checkpoint.safetensors_stream import parse_size


class _Printer:
    """One line per tensor (or nothing with --quiet), with running totals."""

    def __init__(self, quiet: bool):
        self.quiet, self.start, self.bytes = quiet, time.perf_counter(), 0

    def __call__(self, i: int, n: int, name: str, shape: tuple, dtype: torch.dtype) -> None:
        numel = 1
        for s in shape:
            numel *= s
        self.bytes += numel * torch.empty((), dtype=dtype).element_size()
        if not self.quiet:
            print(f"[{i:>{len(str(n))}}/{n}] {name} {list(shape)} {str(dtype).removeprefix('torch.')} "
                  f"({self.bytes / 1e6:,.1f} MB, {time.perf_counter() - self.start:.1f} s)", flush=True)


def _run(fn, *args, **kwargs) -> int:
    try:
        fn(*args, **kwargs)
    except (ValueError, KeyError, FileNotFoundError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {' '.join(str(msg).split())}", file=sys.stderr)
        return 2
    return 0


def _add_extensions_arg(p: argparse.ArgumentParser, note: str) -> None:
    p.add_argument("--extensions", default="", metavar="MODULES",
                   help="comma-separated modules that register the model family, as [job] extensions "
                        f"(e.g. torchtitan_ext.qwen3){note}")


def _modules(value: str) -> list[str]:
    return [m.strip() for m in value.split(",") if m.strip()]


def main_dcp_to_hf(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="convert_dcp_to_hf.py", description=(
        "Convert a titanlite DCP checkpoint step folder into a Hugging Face folder (model.safetensors "
        "[sharded with an index past --max-shard-size], config.json, generation_config.json). A family "
        "from an extension is found through the extensions recorded in the checkpoint."))
    p.add_argument("dcp_step_dir", help="a checkpoint step folder, e.g. outputs/checkpoint/step-1000")
    p.add_argument("hf_out_dir", help="output folder (must not exist, or be empty)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="dtype of the written weights (default: as stored in the checkpoint)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB (default 5GB)")
    _add_extensions_arg(p, " (needed only for checkpoints that do not record them)")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-tensor progress lines")
    a = p.parse_args(argv)
    try:
        max_bytes = parse_size(a.max_shard_size)
    except ValueError:
        p.error(f"--max-shard-size: cannot read {a.max_shard_size!r}")
    rc = _run(dcp_to_hf, a.dcp_step_dir, a.hf_out_dir, dtype=DTYPES[a.dtype] if a.dtype else None,
              max_shard_bytes=max_bytes, progress=_Printer(a.quiet), extensions=_modules(a.extensions))
    if rc == 0:
        print(f"wrote {a.hf_out_dir}")
    return rc


def main_hf_to_dcp(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="convert_hf_to_dcp.py", description=(
        "Convert a Hugging Face model folder (config.json + safetensors; Llama, or a family from an "
        "extension, see --extensions) into a model-only titanlite DCP step folder, loadable with "
        "[checkpoint] initial_load_path under any parallel layout."))
    p.add_argument("hf_dir", help="a Hugging Face model folder")
    p.add_argument("dcp_out_dir", help="output folder (must not exist, or be empty)")
    _add_extensions_arg(p, "; recorded in checkpoint.json for the way back")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-tensor progress lines")
    a = p.parse_args(argv)
    rc = _run(hf_to_dcp, a.hf_dir, a.dcp_out_dir, progress=_Printer(a.quiet), extensions=_modules(a.extensions))
    if rc == 0:
        print(f"wrote {a.dcp_out_dir} (use it with --checkpoint.initial_load_path {a.dcp_out_dir})")
    return rc
