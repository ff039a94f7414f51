#!/usr/bin/env python
"""titanlite's HF conversion paths against torch.distributed.checkpoint's ``HuggingFaceStorageReader`` /
``HuggingFaceStorageWriter``: bitwise equality of the results, time and peak RSS, side by side in one run.

For each model (``tiny``: 2 layers, tied, fp32 stored; ``100m``: a 126M-parameter Llama 3 in bf16, 3 safetensors
shards) it writes a model-only step folder, then runs each variant in a fresh process (peak RSS during it minus
just before, Linux only): ``export`` (:func:`~titanlite.checkpoint.hf_export.dcp_to_hf` vs ``dcp.save`` with
``HuggingFaceStorageWriter`` fed lazily, DCP's best case), ``import`` (:func:`~titanlite.checkpoint.hf_import.hf_to_dcp`
vs ``dcp.load`` with ``HuggingFaceStorageReader``, the adapter, then ``dcp.save``) and ``load`` (every tensor read
whole then ``set_model_state_dict``, vs :func:`~titanlite.checkpoint.hf_import.load_hf_weights`). Each pair's
tensors are compared bitwise. The machine may be shared: read the ratios (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from titanlite.checkpoint import hf_export, hf_import, layout, safe_load
from titanlite.checkpoint.hf_export import dcp_to_hf
from titanlite.checkpoint.hf_import import hf_to_dcp
from titanlite.models.llama3 import Llama3ModelArgs, Transformer

SIZES = {
    "tiny": dict(
        args=dict(
            dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=256, tie_word_embeddings=True
        ),
        stored=torch.float32,
        export=torch.bfloat16,
        shard_bytes=5 * 1000**3,
    ),
    "100m": dict(
        args=dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=32000, multiple_of=256),
        stored=torch.bfloat16,
        export=None,
        shard_bytes=100 * 1000**2,
    ),
}


def make_step(size: str, folder: Path) -> Path:
    spec = SIZES[size]
    args = Llama3ModelArgs(**spec["args"], max_seq_len=128)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    state = {k: v.to(spec["stored"]) for k, v in model.state_dict().items()}
    step = folder / f"{size}-step"
    dcp.save({"model": state}, checkpoint_id=str(step), no_dist=True)
    info = {"step": 1, "model_only": True, "dtype": str(spec["stored"]).removeprefix("torch.")}
    info["model"] = {"name": "llama3", "flavor": None, "args": dataclasses.asdict(args)}
    layout.write_info(step, {**info, "tokenizer": {"bos_id": 256, "eos_id": 257}})
    return step


def dcp_export(step: Path, out: Path, dtype: torch.dtype | None, shard_bytes: int) -> None:
    """DCP step folder -> HF with HuggingFaceStorageWriter, tensors produced lazily as the writer asks."""
    metadata = safe_load.read_metadata(step)
    spec, args = hf_export.model_from_info(layout.read_info(step), step)
    adapter, stored = spec.hf_adapter(args), metadata.state_dict_metadata
    reader = safe_load.SafeFileSystemReader(str(step))
    out_dtype = dtype or stored["model.tok_embeddings.weight"].properties.dtype
    shapes = {adapter.to_hf_name(n): s for n, s in adapter.expected_shapes().items()}
    sizes = {n: torch.Size(s).numel() * out_dtype.itemsize for n, s in shapes.items()}
    index = {n: i for i, shard in enumerate(hf_export._plan_shards(sizes, shard_bytes), 1) for n in shard}

    def load(name: str) -> torch.Tensor:
        key = f"model.{name}" if f"model.{name}" in stored else "model.tok_embeddings.weight"  # tied output
        tensor = hf_export._load_tensor(step, metadata, reader, key, stored[key])
        (_, hf_tensor), *_ = adapter.to_hf_tensors(name, tensor)
        return hf_tensor.to(out_dtype).contiguous()

    loaders = {adapter.to_hf_name(n): (lambda n=n: load(n)) for n in adapter.expected_shapes()}
    metas = {n: torch.empty(s, dtype=out_dtype, device="meta") for n, s in shapes.items()}
    writer = HuggingFaceStorageWriter(str(out), fqn_to_index_mapping=index)
    dcp.save(metas, storage_writer=writer, planner=hf_import._LazySavePlanner(loaders), no_dist=True)


def dcp_import(hf: Path, out: Path) -> None:
    """HF -> DCP step folder through HuggingFaceStorageReader (the full state read, then written)."""
    spec, args = hf_import.hf_seed(hf)
    adapter = spec.hf_adapter(args)
    reader = HuggingFaceStorageReader(str(hf))
    stored = reader.read_metadata().state_dict_metadata
    state = {n: torch.empty(md.size, dtype=md.properties.dtype) for n, md in stored.items()}
    dcp.load(state, storage_reader=reader, no_dist=True)
    native = {}
    for hf_name, tensor in state.items():
        name = adapter.from_hf_name(hf_name)
        native[name] = adapter.from_hf_parts(name, [tensor]).contiguous()
    dcp.save({"model": native}, storage_writer=dcp.FileSystemWriter(str(out), single_file_per_rank=False), no_dist=True)


def status_kib(key: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process (KiB), from ``/proc/self/status`` (``ru_maxrss`` would carry the
    parent's peak over the fork)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(key + ":"))
    return int(line.split()[1])


def reset_peak() -> int:
    """Reset the peak RSS to the current RSS (``clear_refs`` 5); returns the current RSS (KiB)."""
    Path("/proc/self/clear_refs").write_text("5")
    return status_kib("VmRSS")


def child(variant: str, size: str, folder: Path) -> dict:
    """Run one variant; its wall time and peak RSS above the RSS after the imports (MiB)."""
    spec, step, hf = SIZES[size], folder / f"{size}-step", folder / f"{size}-hf-titanlite"
    out = folder / f"{size}-{variant}"
    base, t0 = reset_peak(), time.perf_counter()
    if variant == "export-titanlite":
        dcp_to_hf(step, out, dtype=spec["export"], max_shard_bytes=spec["shard_bytes"])
    elif variant == "export-dcp":
        dcp_export(step, out, spec["export"], spec["shard_bytes"])
    elif variant == "import-titanlite":
        hf_to_dcp(hf, out)
    elif variant == "import-dcp":
        dcp_import(hf, out)
    else:  # the model's own storage is allocated before the baseline: only what reading adds is counted
        with torch.device("meta"):
            model = Transformer(Llama3ModelArgs(**spec["args"], max_seq_len=128))
        model = model.to(spec["export"] or spec["stored"]).to_empty(device="cpu")
        base, t0 = reset_peak(), time.perf_counter()
        if variant == "load-titanlite":  # every tensor read whole, then set_model_state_dict
            hf_seed = hf_import.hf_seed(hf)
            state = hf_import.hf_state_dict(hf, hf_seed[0].hf_adapter(hf_seed[1]))
            state.setdefault("output.weight", state["tok_embeddings.weight"])
            set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
        else:
            hf_import.load_hf_weights(hf, model)
        state = model.state_dict()
    wall, peak = time.perf_counter() - t0, (status_kib("VmHWM") - base) / 1024
    if variant.startswith("load"):
        torch.save(state, out.with_suffix(".pt"))  # for the bitwise comparison, after the measurement
    return {"s": wall, "peak_mib": peak}


def run_child(variant: str, size: str, folder: Path) -> dict:
    cmd = [sys.executable, "-m", "titanlite.bench.hf_storage", "--child", variant, "--sizes", size]
    proc = subprocess.run([*cmd, "--folder", str(folder)], capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{variant} {size} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def tensors_of_hf(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def tensors_of_dcp(step: Path) -> dict[str, torch.Tensor]:
    stored = safe_load.read_metadata(step).state_dict_metadata
    state = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in stored.items() if hasattr(md, "size")}
    safe_load.load(state, step, no_dist=True)
    return state


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="titanlite bench hf-storage", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="tiny,100m")
    p.add_argument("--folder", default="")
    p.add_argument("--child", default="")
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.sizes, Path(a.folder))))
        return 0
    with tempfile.TemporaryDirectory(dir=a.folder or None) as tmp:
        folder = Path(tmp)
        for size in a.sizes.split(","):
            make_step(size, folder)
            row = {v: run_child(v, size, folder) for v in ("export-titanlite", "export-dcp")}
            (folder / f"{size}-export-titanlite").rename(folder / f"{size}-hf-titanlite")
            row.update({v: run_child(v, size, folder) for v in ("import-titanlite", "import-dcp")})
            row.update({v: run_child(v, size, folder) for v in ("load-titanlite", "load-dcp")})
            hf_t, hf_d = tensors_of_hf(folder / f"{size}-hf-titanlite"), tensors_of_hf(folder / f"{size}-export-dcp")
            dcp_t = tensors_of_dcp(folder / f"{size}-import-titanlite")
            dcp_d = tensors_of_dcp(folder / f"{size}-import-dcp")
            load_t = torch.load(folder / f"{size}-load-titanlite.pt", weights_only=True)
            load_d = torch.load(folder / f"{size}-load-dcp.pt", weights_only=True)
            files = sorted(f.name for f in (folder / f"{size}-export-dcp").iterdir())
            print(f"== {size}: export files (DCP writer): {', '.join(files)}")
            print(
                f"   bitwise equal: export {same(hf_t, hf_d)}, import {same(dcp_t, dcp_d)}, load {same(load_t, load_d)}"
            )
            for what in ("export", "import", "load"):
                t, d = row[f"{what}-titanlite"], row[f"{what}-dcp"]
                print(
                    f"   {what:6s}  titanlite {t['s']:.2f} s, peak +{t['peak_mib']:.0f} MiB   "
                    f"DCP {d['s']:.2f} s, peak +{d['peak_mib']:.0f} MiB   (DCP/titanlite: time {d['s'] / t['s']:.2f}x, "
                    f"peak {d['peak_mib'] / max(t['peak_mib'], 1e-9):.2f}x)"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
