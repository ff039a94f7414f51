"""The plain ``transformers`` baseline of the training benchmark: ``LlamaForCausalLM`` at a titanlite flavor's shape.

    titanlite bench hf-baseline --flavor 1B --vocab-size 128256 --batch 4 --seq-len 2048 [--compile] \
        [--n-layers 4] [--warmup 5] [--steps 20] [--json-out FILE]

What a transformers user would write, so that ``bench train``'s figures have a reference measured side by side:
the model built from the same shape (the HF config comes from titanlite's own converter for the flavor, with
``--n-layers`` / ``--vocab-size`` applied), fp32 weights, ``torch.autocast`` in bf16 (``--dtype``), SDPA attention,
``model(input_ids, labels=input_ids).loss`` (transformers shifts the labels), gradient clipping at 1.0 with
``torch.nn.utils.clip_grad_norm_``, ``torch.optim.AdamW(fused=True)`` (foreach off CUDA); ``--compile`` wraps the
whole model in ``torch.compile``. Random tokens (the speed does not depend on them).

One JSON line, with the keys ``bench train`` uses for the same quantities: ``tokens_per_s_per_device``,
``step_time_s``, ``mfu`` (titanlite's FLOPs per token of the same shape over the device's dense bf16 peak),
``peak_memory_gib`` and ``time_split_frac`` (forward+backward / optimizer / other, each region ending with a
device sync). ``transformers`` is a test extra of titanlite, never a run-time dependency.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from titanlite.dtypes import DTYPES
from titanlite.models import get_model_spec
from titanlite.models.registry import model_counts
from titanlite.trainer.peaks import memory_stats, peak_flops


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="titanlite bench hf-baseline", description=__doc__.split("\n")[0])
    p.add_argument("--flavor", default="1B", help="llama3 flavor whose shape to build (debugmodel, 1B, 8B, ...)")
    p.add_argument("--n-layers", type=int, default=0, help="override the flavor's layer count (0: keep)")
    p.add_argument("--vocab-size", type=int, default=128256, help="vocabulary (Llama 3's 128256 by default)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--compile", action="store_true", help="torch.compile the whole model")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="autocast dtype")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json-out", default="")
    args = p.parse_args(argv)
    if args.warmup < 0 or args.steps < 1:
        p.error("--warmup must be >= 0 and --steps >= 1")
    return args


def build(args):
    """``(model, model_args, spec)``: LlamaForCausalLM of the flavor's shape on ``args.device``, fp32."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        sys.exit("error: titanlite bench hf-baseline needs transformers (pip install -e '.[test]')")
    spec = get_model_spec("llama3")
    model_args = spec.flavors[args.flavor]
    overrides = {"vocab_size": args.vocab_size} | ({"n_layers": args.n_layers} if args.n_layers else {})
    model_args = dataclasses.replace(model_args, **overrides)
    config = spec.hf_adapter(model_args).hf_config(dtype=torch.float32)
    config = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    config._attn_implementation = "sdpa"
    with torch.device(args.device):
        model = LlamaForCausalLM(config)
    return model, model_args, spec


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model, model_args, spec = build(args)
    model.train()
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    step_fn = torch.compile(model) if args.compile else model
    dtype = DTYPES[args.dtype]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    g = torch.Generator(device="cpu").manual_seed(0)
    split = {"forward_backward": 0.0, "optimizer": 0.0}
    losses, start = [], None
    for i in range(args.warmup + args.steps):
        timed = i >= args.warmup
        if i == args.warmup:
            sync()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
        tokens = torch.randint(0, args.vocab_size, (args.batch, args.seq_len), generator=g).to(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = step_fn(input_ids=tokens, labels=tokens).loss
        loss.backward()
        if timed:
            sync()
            split["forward_backward"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if timed:
            sync()
            split["optimizer"] += time.perf_counter() - t0
        losses.append(loss.detach())
    sync()
    elapsed = time.perf_counter() - start
    step_s = elapsed / args.steps
    n_params, flops_per_token = model_counts(spec, model_args, args.seq_len)
    tps = args.batch * args.seq_len / step_s
    peak = peak_flops(device, "bfloat16" if dtype == torch.bfloat16 else "float32")
    split = {k: v / args.steps for k, v in split.items()}
    split["other"] = max(0.0, step_s - sum(split.values()))
    mem = memory_stats(device)
    result = {
        "model": f"transformers LlamaForCausalLM ({args.flavor} shape)",
        "params": n_params,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "compile": args.compile,
        "autocast": args.dtype,
        "optimizer": "AdamW fused" if fused else "AdamW foreach",
        "seq_len": args.seq_len,
        "local_batch_size": args.batch,
        "n_layers": model_args.n_layers,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "step_time_s": step_s,
        "tokens_per_s_per_device": tps,
        "flops_per_token": flops_per_token,
        "mfu": None if peak is None else tps * flops_per_token / peak,
        "peak_memory_gib": mem.get("mem_peak_gib", mem.get("mem_peak_rss_gib")),
        "time_split_s": split,
        "time_split_frac": {k: v / step_s for k, v in split.items()},
        "loss_first": losses[0].item(),
        "loss_last": losses[-1].item(),
    }
    line = json.dumps(result)
    print(line, flush=True)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(line + "\n")
    return result


if __name__ == "__main__":
    main()
