"""The plain ``transformers`` baseline of the training benchmark: ``LlamaForCausalLM`` at a titanlite flavor's shape.

What a transformers user would write, measured beside ``bench train``: the HF config from titanlite's converter for
the flavor (``--n-layers`` / ``--vocab-size`` applied), fp32 weights under bf16 autocast, SDPA,
``model(input_ids, labels=input_ids).loss``, ``clip_grad_norm_`` at 1.0, ``AdamW(fused=True)`` (foreach off CUDA);
``--compile`` wraps the whole model. One JSON line with ``bench train``'s keys for the same quantities (MFU from
titanlite's FLOPs per token of the shape). ``transformers`` is a test extra, never a run-time dependency.
"""

from __future__ import annotations

import argparse
import sys

import torch

from titanlite.bench import common
from titanlite.models.registry import model_counts
from titanlite.trainer.peaks import peak_flops
from titanlite.utils.dtypes import DTYPES


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="titanlite bench hf-baseline", description=__doc__.split("\n")[0])
    common.add_flavor_args(p)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--compile", action="store_true", help="torch.compile the whole model")
    common.add_device_args(p, dtypes=("bfloat16", "float32"), default="bfloat16", help="autocast dtype")
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
    spec, model_args = common.flavor_args(args)
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
    g = torch.Generator(device="cpu").manual_seed(0)
    timer, losses = common.StepTimer(device, args.warmup), []
    for _ in range(args.warmup + args.steps):
        timer.begin_step()
        tokens = torch.randint(0, args.vocab_size, (args.batch, args.seq_len), generator=g).to(device)
        with timer.region("forward_backward"):
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = step_fn(input_ids=tokens, labels=tokens).loss
            loss.backward()
        with timer.region("optimizer"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    step_s = timer.elapsed() / args.steps
    n_params, flops_per_token = model_counts(spec, model_args, args.seq_len)
    tps = args.batch * args.seq_len / step_s
    peak = peak_flops(device, "bfloat16" if dtype == torch.bfloat16 else "float32")
    result = {
        "model": f"transformers LlamaForCausalLM ({args.flavor} shape)",
        "params": n_params,
        "device": common.device_name(device),
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
        "peak_memory_gib": common.peak_memory_gib(device),
        **timer.split_report(args.steps, step_s, ("forward_backward", "optimizer")),
        "loss_first": losses[0].item(),
        "loss_last": losses[-1].item(),
    }
    return common.emit(result, args.json_out)


if __name__ == "__main__":
    main()
