"""Muon's cost on the Shakespeare model of benchmarks/muon_shakespeare.sh (one CPU thread): the Newton-Schulz FLOPs
as a fraction of the training step's FLOPs, and the measured time of the optimizer step (Muon + AdamW against AdamW
alone) beside the measured forward + backward. Prints one JSON object."""

from __future__ import annotations

import json
import time

import torch

from titanlite.config.sections import Optimizer
from titanlite.models import build_model
from titanlite.optim import build_optimizer
from titanlite.optim.muon import build_muon
from titanlite.optim.muon_math import newton_schulz_flops
from titanlite.optim.muon_split import split_params

BATCH, SEQ, REPEATS = 12, 64, 20


def timed(fn, repeats: int = REPEATS) -> float:
    fn()  # warm-up (the optimizer's state is created)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(
        "llama3", "debugmodel", device="cpu", dim=128, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=512
    )
    tokens = torch.randint(0, 512, (BATCH, SEQ + 1))

    def fwd_bwd() -> None:
        model.zero_grad(set_to_none=False)
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()

    fwd_bwd_s = timed(fwd_bwd)
    params = sum(p.numel() for p in model.parameters())
    step_flops = 6 * params * BATCH * SEQ  # the matmuls' forward + backward (attention's own FLOPs aside)
    ns_flops = sum(newton_schulz_flops(tuple(p.shape), 5) for _, p in split_params(model)[0])
    out = {
        "params": params,
        "ns_flops": ns_flops,
        "step_flops_6nd": step_flops,
        "ns_flops_fraction": ns_flops / step_flops,
    }
    out["fwd_bwd_s"] = fwd_bwd_s
    for name in ("AdamW", "muon"):
        cfg = Optimizer(name=name, ns_dtype="float32", implementation="foreach")
        opt = build_muon(model, cfg) if name == "muon" else build_optimizer(model, cfg)
        out[f"{name}_step_s"] = timed(opt.step)
    out["muon_extra_s_per_step"] = out["muon_step_s"] - out["AdamW_step_s"]
    out["muon_time_overhead"] = out["muon_extra_s_per_step"] / (fwd_bwd_s + out["AdamW_step_s"])
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
