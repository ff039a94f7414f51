"""The optimizer step alone, against its memory-bandwidth floor: an unfused clip next to titanlite's merged one.

A titanlite model of the flavor's shape gets random gradients and the ``[optimizer]`` AdamW; three ways to step are
timed in rotation (median over ``--steps`` rounds): ``clip_then_step`` (``clip_grad_norm_`` as its own pass, then
the step), ``merged`` (the training step's way: the clip factor inside the fused kernel, or one multi-tensor
multiply for foreach) and ``step_only``. ``max_norm`` sits just under the gradients' norm, so the clip acts every
step. The floor is ``titanlite.optim.bandwidth``'s (28 bytes per fp32 parameter over the measured copy bandwidth).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from titanlite.bench.common import add_flavor_args, device_name, emit, flavor_args, interleaved, seconds
from titanlite.config.sections import Optimizer
from titanlite.optim import build_optimizer
from titanlite.optim.bandwidth import measure_copy_bandwidth, update_bytes
from titanlite.parallel.grad_clip import WorldLayout, clip_coefficient, clip_grad_norm_, grad_square_sum, scale_grads_


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="titanlite bench optimizer", description=__doc__.split("\n")[0])
    add_flavor_args(p)
    p.add_argument("--implementation", default="auto", choices=["auto", "fused", "foreach"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json-out", default="")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    spec, model_args = flavor_args(args)
    with torch.device(device):
        model = spec.model_cls(model_args)
    model.init_weights()  # no uninitialized memory (NaN or subnormal values slow a CPU down)
    params = [q for q in model.parameters() if q.requires_grad]
    g = torch.Generator(device=device).manual_seed(0)
    for q in params:
        q.grad = torch.randn(q.shape, generator=g, device=device) * 1e-3
    optimizer = build_optimizer(model, Optimizer(implementation=args.implementation))
    world = WorldLayout(None)
    max_norm = 0.999 * clip_grad_norm_(params, 0.0).item()

    def clip_then_step() -> None:
        clip_grad_norm_(params, max_norm)
        optimizer.step()

    def merged() -> None:
        factor = clip_coefficient(grad_square_sum(params, world).sqrt(), max_norm)
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            optimizer.grad_scale = factor.reciprocal()
        else:
            scale_grads_(params, factor)
        optimizer.step()
        optimizer.__dict__.pop("grad_scale", None)

    ways = {"clip_then_step": clip_then_step, "merged": merged, "step_only": optimizer.step}
    # warm-up (state allocation, kernel loads), then the ways in rotation
    times = interleaved(list(ways), args.steps, lambda name: seconds(ways[name], device), lambda name: ways[name]())
    bandwidth = measure_copy_bandwidth(device)
    floor_s = update_bytes(optimizer) / bandwidth
    return emit(
        {
            "device": device_name(device),
            "flavor": args.flavor,
            "params": sum(q.numel() for q in params),
            "implementation": "fused" if optimizer.defaults.get("fused") else "foreach",
            "update_bytes": update_bytes(optimizer),
            "copy_bandwidth_gb_s": bandwidth / 1e9,
            "floor_s": floor_s,
            **{f"{name}_s": statistics.median(ts) for name, ts in times.items()},
            **{f"{name}_floor_ratio": statistics.median(ts) / floor_s for name, ts in times.items()},
        },
        args.json_out,
    )


if __name__ == "__main__":
    main()
