"""Dry run: check a config's parallel layout at its real scale on a machine without GPUs (what it does and prints
for a user: docs/scale.md, "Dry run without GPUs").

``python -m titanlite.train --config FILE --job.dry_run true`` joins a *fake* process group of the config's world
size as rank 0 (``FakeStore`` + the ``fake`` backend: every collective is a no-op, no other process exists),
builds the model on the meta device with the family's ``parallelize_fn`` exactly as a real run does, and counts
every rank's parameters from each parameter's DTensor placements at that rank's mesh coordinate. With pipeline
parallelism it builds the stages of *every* pp rank (on a view of the mesh whose ``pp_rank`` is that rank: as
rank 0 of the fake group only pp rank 0 would be seen); the worst stage decides the verdict. Nothing is
allocated; :func:`dry_run` returns the printed facts as a dict.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import re
from collections.abc import Callable
from typing import Any

import torch

from titanlite.errors import ConfigError
from titanlite.utils import torch_compat

GB = 1e9


def resolve_world_size(cfg) -> tuple[int, str]:
    """``(world size, where it came from)``: ``job.dry_run_world_size``, else ``job.world_size`` (the size the
    config is tuned for), else the product of the explicit parallel degrees; ValueError when nothing states it."""
    job, par = cfg.job, cfg.parallelism
    if job.dry_run_world_size > 0:
        return job.dry_run_world_size, "job.dry_run_world_size"
    if job.world_size > 0:
        return job.world_size, "job.world_size"
    if par.data_parallel_shard_degree > 0:
        n = par.data_parallel_replicate_degree * par.data_parallel_shard_degree * par.tensor_parallel_degree
        return n, "the product of the parallel degrees"
    raise ConfigError(
        "dry run: the world size is not stated; pass --job.dry_run_world_size N (or set [job] world_size, "
        "or an explicit parallelism.data_parallel_shard_degree)"
    )


def _placement_text(p) -> str:
    from torch.distributed.tensor import Replicate, Shard

    if type(p).__name__ == "_StridedShard":  # FSDP's shard of a TP shard (same tensor dim)
        return f"StridedShard({p.dim},sf={p.split_factor})"
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Replicate):
        return "Replicate"
    return str(p)


_FLATTENED = {"dp_shard_cp": ("dp_shard", "cp")}  # the flattened mesh dims a parameter may be placed on


def _coordinate(name: str, coord: tuple[int, ...], sizes: dict[str, int], where: dict[str, int]) -> int | None:
    """A global rank's coordinate (``coord`` on the world mesh's dims: ``sizes`` by name, ``where`` their index)
    along mesh dim ``name``, a flattened one too (row-major over its dims); None for a dim it does not know."""
    if name in where:
        return coord[where[name]]
    if name not in _FLATTENED or not set(_FLATTENED[name]) <= set(where):
        return None
    index = 0
    for part in _FLATTENED[name]:
        index = index * sizes[part] + coord[where[part]]
    return index


def _local_numel_fn(sizes: dict[str, int]) -> Callable:
    """``fn(param, global_coord) -> local numel`` for a (DTensor or plain) parameter (``sizes``: the world mesh's
    dims and their sizes)."""
    from torch.distributed.tensor import DTensor

    local_shape = torch_compat.local_shape_fn()
    where = {name: i for i, name in enumerate(sizes)}
    cache: dict = {}

    def fn(p: torch.Tensor, coord: tuple[int, ...]) -> int:
        if not isinstance(p, DTensor):
            return p.numel()
        mesh, names = p.device_mesh, p.device_mesh.mesh_dim_names or ()
        sub = tuple(_coordinate(n, coord, sizes, where) for n in names)
        sub = None if None in sub else sub
        key = (tuple(p.shape), tuple(mesh.shape), tuple(map(str, p.placements)), sub)
        if key not in cache:
            if sub is None or local_shape is None:
                shape = p.to_local().shape  # fallback: this rank's shard for every rank
            else:
                shape = local_shape(tuple(p.shape), tuple(mesh.shape), list(sub), p.placements, skip_offset=True)[0]
            cache[key] = math.prod(shape)
        return cache[key]

    return fn


def _stage_memory(cfg: Any, shape: Any, world_size: int, stage: Any) -> dict[str, Any]:
    """The modelled memory of one seq_len stage: its length, micro-batch and accumulation."""
    from titanlite.plan.memory import RunSetup, pipeline_memory

    c = copy.deepcopy(cfg)
    c.training.seq_len, c.training.local_batch_size = stage.seq_len, stage.local_batch_size
    dp = RunSetup.from_config(cfg, world_size).dp_degree
    c.training.global_batch_size = stage.local_batch_size * dp * stage.grad_accum_steps
    return max(pipeline_memory(shape, RunSetup.from_config(c, world_size)), key=lambda m: m["total"])


def dry_run(cfg, world_size: int | None = None, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the dry run for ``cfg`` (see module docstring); prints through ``out``, returns a report."""
    import torch.distributed as dist

    from titanlite.models import get_model_spec
    from titanlite.models.flops import ModelShape, active_param_count, param_count
    from titanlite.models.registry import model_args_for, model_counts
    from titanlite.parallel.parallel_dims import MESH_DIMS, ParallelDims
    from titanlite.parallel.pipeline import PipelinePlan
    from titanlite.parallel.policies import Policies
    from titanlite.plan.memory import RunSetup, pipeline_memory
    from titanlite.plan.planner import all_to_all_volume, usable_memory
    from titanlite.plan.run_plan import plan_steps
    from titanlite.trainer.peaks import gpu_memory_bytes
    from titanlite.trainer.step import grad_accum_steps

    world_size, source = resolve_world_size(cfg) if world_size is None else (world_size, "argument")
    t, par, ac, f8 = cfg.training, cfg.parallelism, cfg.activation_checkpoint, cfg.quantize_linear_float8
    dims = ParallelDims.from_config(par, world_size)
    accum = grad_accum_steps(t.global_batch_size, t.local_batch_size, dims.dp_degree)
    spec = get_model_spec(cfg.model.name)
    vocab, vocab_note = _vocab_size(cfg, spec)
    args = model_args_for(cfg.model, vocab)
    plan = PipelinePlan.from_config(par, args.n_layers, t.local_batch_size) if dims.pp_enabled else None
    kw = dict(seq_len=t.seq_len, local_batch_size=t.local_batch_size, grad_accum_steps=accum, dp_degree=dims.dp_degree)
    stages = plan_steps(steps=t.steps, tokens=t.tokens, schedule=t.seq_len_schedule, **kw).stages

    if world_size > 1:
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError("dry run: a process group already exists in this process; run the dry run on its own")
        dist.init_process_group("fake", rank=0, world_size=world_size, store=torch_compat.fake_store())
    try:
        dims.build_mesh("cpu")
        dims.check_tp_divides(**{"training.seq_len (sequence parallelism)": t.seq_len})
        for i, st in enumerate(stages):
            dims.check_tp_divides(**{f"training.seq_len_schedule[{i}].seq_len": st.seq_len})
        policies = Policies.from_config(par, t, ac, cfg.compile, f8)
        report = _inspect(_models_on_meta(spec, args, dims, policies, plan), dims, world_size, MESH_DIMS)
    finally:
        if world_size > 1:  # the fake process group created above
            dist.destroy_process_group()

    shape = ModelShape.from_args(args, num_params=model_counts(spec, args, t.seq_len)[0])
    setup = RunSetup.from_config(cfg, world_size, plan.stage_sizes if plan else ())
    stage_memory = pipeline_memory(shape, setup)
    memory = max(stage_memory, key=lambda m: m["total"])
    if t.seq_len_schedule:  # the seq_len stage with the largest modelled peak decides
        memory = max([memory] + [_stage_memory(cfg, shape, world_size, st) for st in stages], key=lambda m: m["total"])
    gpu_bytes = gpu_memory_bytes(cfg.job.dry_run_gpu)
    usable = None if gpu_bytes is None else usable_memory(gpu_bytes)
    report |= {
        "model": f"{cfg.model.name}/{cfg.model.flavor}",
        "world_size": world_size,
        "world_size_source": source,
        "degrees": {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": dims.tp}
        | ({"cp": dims.cp} if dims.cp > 1 else {})
        | ({"ep": dims.ep} if dims.ep > 1 else {}),  # EP: a factor of dp_shard (x cp), no ranks of its own
        "grad_accum": accum,
        "global_batch": t.local_batch_size * dims.dp_degree * accum,
        "tokens_per_step": t.local_batch_size * dims.dp_degree * accum * t.seq_len,
        "planner_params": param_count(shape),
        "active_params": active_param_count(shape),  # per token (MoE: the routed top-k and shared experts)
        "all_to_all_bytes": all_to_all_volume(shape, setup),  # per GPU per optimizer step (expert parallelism)
        "memory": memory,
        "gpu": cfg.job.dry_run_gpu,
        "usable_bytes": usable,
        "fits": None if usable is None else memory["total"] <= usable,
        "vocab_note": vocab_note,
        "pipeline": None if plan is None else _pipeline_report(plan, report, stage_memory, usable),
    }
    for line in format_report(report, cfg):
        out(line)
    return report


def _models_on_meta(spec, args, dims, policies, plan) -> list[torch.nn.Module]:
    """The parallelized meta model; with a pipeline, every pp rank's stages (each rank's as one ModelParts under
    the full model's names), copied from one meta model."""
    from titanlite.parallel.build import parallelize_on_meta

    if plan is None:
        return [parallelize_on_meta(spec, args, dims, policies)[0]]
    with torch.device("meta"):
        whole = spec.model_cls(args)  # copied into each rank's stages, itself unchanged
    return [
        parallelize_on_meta(spec, args, dims, policies, pipeline=plan, pp_rank=k, model=whole)[0]
        for k in range(dims.pp)
    ]


def _layer_ranges(names: list[str]) -> list[str]:
    """``["tok_embeddings", "layers.0", ..., "layers.15"]`` -> ``["tok_embeddings", "layers.0-15"]``."""
    out, run = [], []
    for name in [*names, ""]:
        m = re.fullmatch(r"layers\.(\d+)", name)
        if m and (not run or int(m.group(1)) == run[-1] + 1):
            run.append(int(m.group(1)))
            continue
        if run:
            out.append(f"layers.{run[0]}" + (f"-{run[-1]}" if len(run) > 1 else ""))
            run = []
        if m:
            run = [int(m.group(1))]
        elif name:
            out.append(name)
    return out


def _pipeline_report(plan, report: dict[str, Any], stage_memory: list[dict], usable: float | None) -> dict[str, Any]:
    """Per pp rank: its stages and their modules, its parameters (all, and per GPU) and the planner's memory."""
    ranks = []
    for k, (mem, params) in enumerate(zip(stage_memory, report["stage_params"])):
        stages = plan.stage_ids(k)
        per_gpu = report["per_rank"][
            k * len(report["per_rank"]) // plan.degree : (k + 1) * len(report["per_rank"]) // plan.degree
        ]
        ranks.append(
            {
                "pp_rank": k,
                "stages": stages,
                "modules": {s: ", ".join(_layer_ranges(plan.stage_modules(s))) for s in stages},
                "params": params,
                "per_gpu_min": min(per_gpu),
                "per_gpu_max": max(per_gpu),
                "memory": mem,
                "fits": None if usable is None else mem["total"] <= usable,
            }
        )
    return {
        "degree": plan.degree,
        "schedule": plan.schedule,
        "num_stages": plan.num_stages,
        "stage_sizes": list(plan.stage_sizes),
        "n_microbatches": plan.n_microbatches,
        "bubble": plan.bubble_fraction(),
        "ranks": ranks,
    }


def _vocab_size(cfg, spec) -> tuple[int, str]:
    """The tokenizer's vocabulary when it can be read here, else the flavor's (with a note)."""
    if "vocab_size" in cfg.model.overrides:
        return cfg.model.overrides["vocab_size"], ""
    path = cfg.model.tokenizer_path
    if path == "" or os.path.exists(path):
        tok = spec.tokenizer_builder(path) if spec.tokenizer_builder is not None else None
        if tok is not None:
            return tok.vocab_size, ""
    flavor_vocab = spec.flavors[cfg.model.flavor].vocab_size
    return flavor_vocab, (f"tokenizer {path} is not on this machine: using the flavor's vocab_size {flavor_vocab:,}")


def _inspect(models: list[torch.nn.Module], dims, world: int, mesh_names: tuple[str, ...]) -> dict[str, Any]:
    """Parameter counts of every global rank (from each parameter's placements at the rank's mesh coordinate)
    and the parameter groups; ``models[k]`` is what pp rank ``k`` holds (one model without pipelining)."""
    from torch.distributed.tensor import DTensor

    mesh_shape = (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    coords = list(itertools.product(*map(range, mesh_shape)))  # of every global rank (row-major)
    numel = _local_numel_fn(dict(zip(mesh_names, mesh_shape)))
    per_rank = [0] * world
    groups: dict[tuple, dict] = {}
    stage_params = []
    for k, model in enumerate(models):
        params = list(model.named_parameters())  # shared (tied) parameters once
        stage_params.append(sum(p.numel() for _, p in params))
        for name, p in params:
            for r, c in enumerate(coords):
                if c[0] == k:
                    per_rank[r] += numel(p, c)
            if isinstance(p, DTensor):
                names = p.device_mesh.mesh_dim_names or ()
                placement = " ".join(f"{n}:{_placement_text(pl)}" for n, pl in zip(names, p.placements))
                local = list(p.to_local().shape)
            else:
                placement, local = "replicated (plain tensor)", list(p.shape)
            key = (re.sub(r"^layers\.\d+\.", "layers.*.", name), tuple(p.shape), placement)  # all blocks in one group
            new = dict(group=key[0], count=0, shape=list(p.shape), placements=placement, rank0_shape=local, numel=0)
            g = groups.setdefault(key, new)
            g["count"] += 1
            g["numel"] += p.numel()
    return {
        "params": sum(stage_params),
        "stage_params": stage_params,
        "per_rank": per_rank,
        "min_rank": min(range(world), key=per_rank.__getitem__),
        "max_rank": max(range(world), key=per_rank.__getitem__),
        "groups": list(groups.values()),
        "mesh_dims": dict(zip(mesh_names, mesh_shape)),
    }


def _rank_runs(per: list[int], limit: int = 8) -> str:
    """``ranks 0-3: N; ranks 4-7: M`` (consecutive ranks with equal counts), else min and max."""
    runs = [(n, list(ranks)) for n, ranks in itertools.groupby(range(len(per)), key=per.__getitem__)]
    if len(runs) <= limit:
        return "; ".join(f"ranks {g[0]}-{g[-1]}: {n:,}" if len(g) > 1 else f"rank {g[0]}: {n:,}" for n, g in runs)
    lo, hi = min(range(len(per)), key=per.__getitem__), max(range(len(per)), key=per.__getitem__)
    return f"min {per[lo]:,} (rank {lo}), max {per[hi]:,} (rank {hi})"


def _sharding_layout(d: dict[str, int]) -> list[str]:
    """The layout line's FSDP and CP parts (FSDP spans dp_shard x cp)."""
    cp = d.get("cp", 1)
    parts = (
        [f"FSDP over {d['dp_shard']}" + (f" x cp {cp}" if cp > 1 else "")]
        if d["dp_replicate"] * d["dp_shard"] * cp > 1
        else []
    )
    return parts + ([f"CP {cp} (each sequence over {cp} ranks, K/V all-gathered)"] if cp > 1 else [])


def format_report(r: dict[str, Any], cfg) -> list[str]:
    d, t, ac, w = r["degrees"], cfg.training, cfg.activation_checkpoint, r["world_size"]
    per, lo, hi, m = r["per_rank"], r["min_rank"], r["max_rank"], r["memory"]
    pl = r.get("pipeline")
    layout = [f"PP {pl['degree']} ({pl['schedule']}, {pl['num_stages']} stages)"] if pl else []
    layout += [f"HSDP replicas {d['dp_replicate']}"] if d["dp_replicate"] > 1 else []
    pp_dim, cp_dim = f"pp {pl['degree']} x " if pl else "", f"cp {d['cp']} x " if "cp" in d else ""
    worst = f", worst stage (pp rank {m['pp_rank']})" if pl else ""
    layout += _sharding_layout(d)
    if d.get("ep", 1) > 1:
        layout.append(
            f"EP {d['ep']} (experts over dp_shard {d['dp_shard']} = {d['dp_shard'] // d['ep']} x ep {d['ep']})"
        )
    if d["tp"] > 1:
        lp = "loss parallel" if cfg.parallelism.enable_loss_parallel else "logits gathered"
        layout.append(f"TP {d['tp']} ({lp})")
    spread = f"{per[hi]:,} on every rank" if per[lo] == per[hi] else _rank_runs(per)
    lines = [
        f"dry run: {r['model']} on {w} rank{'s' if w != 1 else ''} ({r['world_size_source']}); "
        f"{'fake process group, ' if w > 1 else ''}meta device, nothing allocated",
        f"mesh       {pp_dim}dp_replicate {d['dp_replicate']} x dp_shard {d['dp_shard']} x "
        f"{cp_dim}tp {d['tp']} = {w}"
        f" | {', '.join(layout) or 'single process, no sharding'}",
        f"training   AC {ac.mode}{' (' + ac.selective_ac_option + ')' if ac.mode == 'selective' else ''}"
        f", compile {'on' if cfg.compile.enable else 'off'}, float8 "
        f"{'on' if cfg.quantize_linear_float8.enable else 'off'}, compute {t.mixed_precision_param}, "
        f"reduce {t.mixed_precision_reduce}",
        f"batch      {t.local_batch_size} seq/rank x dp {d['dp_replicate'] * d['dp_shard']} x accumulation "
        f"{r['grad_accum']} = {r['global_batch']} sequences x {t.seq_len} = {r['tokens_per_step']:,} tokens "
        "per optimizer step",
        f"params     {r['params']:,} in the model ({r['params'] / 1e9:.3f} B); per rank: {spread} "
        f"= 1/{r['params'] / max(per[hi], 1):.1f} of the model",
    ]
    if r.get("active_params", r["params"]) != r["planner_params"]:
        lines.append(
            f"active     {r['active_params']:,} parameters per token ({r['active_params'] / 1e9:.3f} B: the routed "
            "top-k and shared experts of each MoE block); FLOPs and MFU count these"
        )
    if r.get("all_to_all_bytes"):
        lines.append(
            f"all2all    {r['all_to_all_bytes'] / GB:.2f} GB sent per GPU per optimizer step (expert parallelism: "
            "tokens to their experts and back, forward and backward; planner estimate)"
        )
    if r["planner_params"] != r["params"]:
        lines.append(
            f"note       the planner's count is {r['planner_params']:,}: its memory estimate below is for that shape"
        )
    if r.get("vocab_note"):
        lines.append(f"note       {r['vocab_note']}")
    if pl:
        lines += _pipeline_lines(pl, r, cfg)
    return lines + [
        "sharding   parameter group                              count  global shape        placements"
        "                                   rank-0 shard",
        *(
            f"           {g['group']:<44} {g['count']:>5}  {str(g['shape']):<19} {g['placements']:<44} "
            f"{g['rank0_shape']}"
            for g in r["groups"]
        ),
        f"memory     planner per GPU (GB = 1e9 B){worst}: parameters {m['parameters'] / GB:.2f}, gradients "
        f"{m['gradients'] / GB:.2f}, optimizer {m['optimizer'] / GB:.2f}, activations "
        f"{m['activations'] / GB:.2f}, logits {m['logits'] / GB:.2f} -> total {m['total'] / GB:.2f}",
        "           fp32 weights + gradients + AdamW state of the largest rank, from the sharded model: "
        f"{16 * per[hi] / GB:.2f} GB",
        f"verdict    unknown GPU {r['gpu']!r}: no memory verdict (set job.dry_run_gpu)"
        if r["usable_bytes"] is None
        else f"verdict    {'FITS' if r['fits'] else 'DOES NOT FIT'}: {m['total'] / GB:.1f} GB of "
        f"{r['usable_bytes'] / GB:.1f} GB usable on a {r['gpu']}",
        "dry run complete: no weights were allocated; exiting",
    ]


def _pipeline_lines(pl: dict[str, Any], r: dict[str, Any], cfg) -> list[str]:
    """The pipeline section: the split, the schedule's microbatches and bubble, and one line per pp rank."""
    mb = cfg.parallelism.pipeline_parallel_microbatch_size
    usable = r["usable_bytes"]
    lines = [
        f"pipeline   {pl['schedule']} over {pl['degree']} pp ranks, {pl['num_stages']} stages of "
        f"{_sizes_text(pl['stage_sizes'])} blocks; {pl['n_microbatches']} microbatches of {mb} sequence"
        f"{'s' if mb != 1 else ''} per local batch; bubble {pl['bubble']:.1%} (planner estimate)"
    ]
    for k in pl["ranks"]:
        m = k["memory"]
        modules = "; ".join(f"stage {s}: {k['modules'][s]}" for s in k["stages"])
        per_gpu = (
            f"{k['per_gpu_max']:,}"
            if k["per_gpu_min"] == k["per_gpu_max"]
            else (f"{k['per_gpu_min']:,}-{k['per_gpu_max']:,}")
        )
        verdict = "" if usable is None else (" FITS" if k["fits"] else " DOES NOT FIT")
        lines.append(
            f"  pp {k['pp_rank']:<3}  {modules} | {k['params']:,} params, {per_gpu} per GPU | "
            f"{m['in_flight']} microbatches in flight | memory {m['total'] / GB:.1f} GB (sharded weights+grads+AdamW "
            f"{(m['parameters'] + m['gradients'] + m['optimizer']) / GB:.1f}, unsharded stage weights+grads "
            f"{m['pipeline_fsdp_buffers'] / GB:.1f}, receive buffers {m['pipeline_receive_buffers'] / GB:.1f}, "
            f"activations {m['activations'] / GB:.1f}, logits {m['logits'] / GB:.1f}){verdict}"
        )
    return lines


def _sizes_text(sizes: list[int]) -> str:
    """``[16, 16, 16]`` -> ``"16"``; uneven sizes listed."""
    return str(sizes[0]) if len(set(sizes)) == 1 else "/".join(map(str, sizes))
