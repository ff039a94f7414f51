"""``titanlite``: one command for every tool of the package (also ``python -m titanlite``).

Each command runs one module's ``main(argv)`` with the remaining arguments, so its flags, output and exit status
are that module's (``titanlite <command> --help``); a module is imported only when its command runs. Under
torchrun keep ``torchrun -m titanlite.train``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import NamedTuple


class Tool(NamedTuple):
    module: str
    function: str
    help: str
    distributed: bool = False  # may run under torchrun: ended by main_then_exit (no finalization on many ranks)


BENCH = {
    "train": Tool("titanlite.bench.train", "main", "training throughput, MFU and time split of a config", True),
    "generate": Tool("titanlite.bench.generate", "main", "decode tokens/s: compiled, eager cache, recompute"),
    "eval": Tool("titanlite.bench.eval", "main", "scoring throughput of the downstream tasks"),
    "optimizer": Tool("titanlite.bench.optimizer", "main", "the optimizer step against its bandwidth floor"),
    "loss-chunks": Tool("titanlite.bench.loss_chunks", "main", "memory and time of [training] loss_chunks settings"),
    "context-parallel": Tool(
        "titanlite.bench.context_parallel", "main", "one attention layer's peak memory, cp 1 vs cp N"
    ),
    "moe": Tool("titanlite.bench.moe", "main", "the MoE layer's time split (grouped GEMM, all-to-all)", True),
    "encode": Tool("titanlite.bench.encode", "main", "prepare's process pool vs tiktoken threads, same chunks"),
    "data": Tool("titanlite.bench.data", "main", "tokenization, shard reading and integrity-check costs"),
    "checkpoint": Tool("titanlite.bench.checkpoint", "main", "how long a save blocks the loop, per async_mode"),
    "hf-baseline": Tool("titanlite.bench.hf_baseline", "main", "the transformers training loop at the same shape"),
    "hf-storage": Tool("titanlite.bench.hf_storage", "main", "DCP's HF storage reader/writer vs titanlite's own path"),
    "rows": Tool("titanlite.bench.rows", "main", "several bench train rows in one process, as JSON lines"),
    "table": Tool("titanlite.bench.table", "main", "the training benchmark's table from JSON lines"),
    "trace-summary": Tool(
        "titanlite.bench.trace_summary", "main", "a profiled step by kernel kind and part, vs floors"
    ),
}
CONVERT = {
    "dcp-to-hf": Tool("titanlite.checkpoint.convert_cli", "main_dcp_to_hf", "a DCP step folder to a Hugging Face one"),
    "hf-to-dcp": Tool("titanlite.checkpoint.convert_cli", "main_hf_to_dcp", "a Hugging Face folder to a DCP one"),
}
COMMANDS: dict[str, Tool | dict[str, Tool]] = {
    "train": Tool("titanlite.train", "main", "train with a TOML config and --section.key overrides", True),
    "generate": Tool("titanlite.generate.cli", "main", "continue prompts with a trained model"),
    "eval": Tool("titanlite.eval.cli", "main", "downstream benchmarks (HellaSwag, ARC, ...) of a checkpoint"),
    "convert": CONVERT,
    "prepare": Tool("titanlite.data.prepare", "main", "tokenize text into binary shards (or --verify them)"),
    "estimate": Tool("titanlite.tools.estimate", "main", "plan a run: parameters, FLOPs, time, cost, memory"),
    "plot": Tool("titanlite.tools.plot", "main", "plot runs' metrics.jsonl curves, overlaid"),
    "bench": BENCH,
}
GROUP_HELP = {"convert": "checkpoint conversion: dcp-to-hf, hf-to-dcp", "bench": "benchmarks: " + ", ".join(BENCH)}


def usage(prog: str, table: dict) -> str:
    width = max(map(len, table)) + 2
    lines = [f"usage: {prog} <command> [args ...]", "", "commands:"]
    for name, entry in table.items():
        text = entry.help if isinstance(entry, Tool) else GROUP_HELP[name]
        lines.append(f"  {name:<{width}}{text}")
    lines += ["", f"`{prog} <command> --help` shows a command's own options."]
    return "\n".join(lines)


def run(tool: Tool, argv: list[str]) -> int:
    main = getattr(importlib.import_module(tool.module), tool.function)

    def call() -> None:
        code = main(argv)  # benchmarks return their result (a dict or list): success
        if isinstance(code, int) and code:
            raise SystemExit(code)

    if tool.distributed:
        from titanlite.parallel.distributed import main_then_exit

        main_then_exit(call)
    call()
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "titanlite", table: dict | None = None) -> int:
    """Exit status: the command's; 2 with one ``error:`` line for an unknown command, 0 after ``--help``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    table = COMMANDS if table is None else table
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(prog, table), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    entry = table.get(name)
    if entry is None:
        print(f"{prog}: error: unknown command {name!r} (choose from {', '.join(table)})", file=sys.stderr)
        return 2
    if isinstance(entry, dict):
        return main(rest, f"{prog} {name}", entry)
    return run(entry, rest)


if __name__ == "__main__":
    raise SystemExit(main())
