"""MoE benchmark: the debug MoE against the dense debug model of the same active size, and the MoE layer's time split.

``bench train --compare-moe`` runs the dense debug model and ``train_configs/debug_moe.toml`` (the same FFN FLOPs
per token) side by side (:mod:`titanlite.bench.compare`), then this layer split: one MoE layer of the config timed
piece by piece, forward and backward, on this rank: ``router``, ``permutation`` (sorting by expert, gathering, and
back), ``grouped_gemm`` (with ``loop``, the per-expert loop, for comparison), ``all_to_all`` (under ``torchrun``
with ``expert_parallel_degree > 1``), ``shared_experts``, and ``layer`` whose remainder is ``other``. Under
``torchrun --nproc-per-node 2 -m titanlite.bench.moe --parallelism.expert_parallel_degree 2`` it includes the
token exchange. Timings drift on a shared machine: compare side by side only.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch
import torch.distributed as dist

from titanlite.bench.common import REPO, emit, mean_seconds
from titanlite.config import parse_args_or_exit
from titanlite.models import model_schema
from titanlite.models.llama3.model import FeedForward
from titanlite.models.moe import MoE
from titanlite.models.moe.expert_parallel import AllToAll, regroup_index
from titanlite.models.moe.router import expert_counts
from titanlite.models.registry import model_args_for
from titanlite.parallel.distributed import init_distributed, main_then_exit, world_from_env
from titanlite.utils.dtypes import DTYPES

SPARSE = "train_configs/debug_moe.toml"


def backward(*outs: torch.Tensor) -> None:
    torch.autograd.backward([o for o in outs], [torch.ones_like(o) for o in outs])


def layer_split(moe: MoE, tokens: int, dim: int, steps: int, ep_group=None) -> dict:
    """Seconds per forward + backward of each piece of ``moe`` on ``tokens`` tokens (module docstring)."""
    torch.manual_seed(0)
    w = moe.router.gate.weight
    timed = functools.partial(mean_seconds, device=w.device)
    x = torch.randn(1, tokens, dim, device=w.device, dtype=w.dtype, requires_grad=True)
    flat = x.detach().reshape(-1, dim).requires_grad_()
    k, e = moe.cfg.top_k, moe.cfg.num_experts
    with torch.no_grad():
        routing = moe.router(flat)
    order = torch.argsort(routing.experts.reshape(-1), stable=True)
    counts = expert_counts(routing.experts, e)
    routed = flat.detach()[order // k].requires_grad_()
    weights = routing.weights.detach().requires_grad_()

    def permutation():
        idx = torch.argsort(routing.experts.reshape(-1), stable=True)
        y = flat[idx // k]  # stands for the experts' outputs: same shapes, same way back
        inverse = torch.empty_like(idx)
        inverse[idx] = torch.arange(idx.numel(), device=idx.device)
        backward((y[inverse].view(-1, k, dim) * weights.unsqueeze(-1)).sum(1))

    split = {
        "router": timed(lambda: backward(moe.router(flat).weights), steps),
        "permutation": timed(permutation, steps),
        "layer": timed(lambda: backward(moe(x)), steps),
    }
    if moe.shared_experts is not None:
        split["shared_experts"] = timed(lambda: backward(moe.shared_experts(flat)), steps)
    if ep_group is None:
        split["grouped_gemm"] = timed(lambda: backward(moe.experts(routed, counts)), steps)
        grouped, moe.experts.grouped_mm = moe.experts.grouped_mm, False
        split["loop"] = timed(lambda: backward(moe.experts(routed, counts)), steps)
        moe.experts.grouped_mm = grouped
    else:
        ep = dist.get_world_size(ep_group)
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=ep_group)
        recv = recv.view(ep, e // ep)
        ins, outs = counts.view(ep, -1).sum(1).tolist(), recv.sum(1).tolist()
        arrived = AllToAll.apply(routed.detach(), outs, ins, ep_group)
        local = arrived[regroup_index(recv)].detach().requires_grad_()
        split["grouped_gemm"] = timed(lambda: backward(moe.experts(local, recv.sum(0))), steps)

        def exchange():
            c = torch.empty_like(counts)
            dist.all_to_all_single(c, counts, group=ep_group)
            there = AllToAll.apply(routed, outs, ins, ep_group)
            backward(AllToAll.apply(there, ins, outs, ep_group))

        split["all_to_all"] = timed(exchange, steps)
    parts = sum(v for name, v in split.items() if name not in ("layer", "loop"))
    split["other"] = max(0.0, split["layer"] - parts)
    return split


def layer_bench(rest: list[str], steps: int) -> dict:
    """The time split of one MoE layer of the config (under torchrun with EP: expert-parallel, all-to-all timed)."""
    cfg = parse_args_or_exit(
        ["--config", str(REPO / SPARSE), *rest], prog="titanlite bench moe", model_schema=model_schema
    )
    world = world_from_env()
    args = model_args_for(cfg.model, 512)
    ep_group = None
    moe = MoE(args.dim, args.moe_config(), shared_cls=FeedForward)
    moe.init_weights(0.02)
    if torch.cuda.is_available():  # the grouped GEMM runs in bf16 on CUDA
        moe = moe.to(world.device, DTYPES[cfg.training.mixed_precision_param])
    if world.world_size > 1:
        from titanlite.models.moe.expert_parallel import shard_experts
        from titanlite.parallel.parallel_dims import ParallelDims

        init_distributed(world, 300)
        dims = ParallelDims.from_config(cfg.parallelism, world.world_size)
        dims.build_mesh("cpu")
        if dims.ep > 1:
            full = {n: p.detach().clone() for n, p in moe.experts.named_parameters()}
            shard_experts(moe.experts, dims.ep_mesh)
            with torch.no_grad():  # this rank's experts, from the full weights
                for n, p in moe.experts.named_parameters():
                    p.to_local().copy_(full[n].chunk(dims.ep, 0)[dims.ep_mesh.get_local_rank()])
            moe.ep_group = ep_group = dims.ep_mesh.get_group()
    tokens = cfg.training.local_batch_size * cfg.training.seq_len
    split = layer_split(moe.train(), tokens, args.dim, steps, ep_group)
    layer = split["layer"]
    return {
        "layer": f"MoE({args.dim}, {args.moe_num_experts} experts of {args.moe_hidden_dim}, top-{args.moe_top_k}, "
        f"{args.moe_num_shared_experts} shared)",
        "tokens": tokens,
        "processes": world.world_size,
        "expert_parallel_degree": 1 if ep_group is None else dist.get_world_size(ep_group),
        "device": str(next(moe.parameters()).device),
        "threads": torch.get_num_threads(),
        "seconds_per_layer_step": split,
        "fraction_of_layer": {k: v / layer for k, v in split.items() if k not in ("layer", "loop")},
        "grouped_gemm_speedup_over_loop": split["loop"] / split["grouped_gemm"] if "loop" in split else None,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="titanlite bench moe", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed repetitions of each piece")
    parser.add_argument("--json-out", default="")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    result = layer_bench(rest, args.steps)
    if world_from_env().is_main:
        emit(result, args.json_out)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main_then_exit(main)
