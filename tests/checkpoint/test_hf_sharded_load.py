"""Loading an HF folder into an FSDP-sharded model (``[checkpoint] initial_load_path``) reads only each rank's
slices of the tensors the adapter only renames (through DCP's ``HuggingFaceStorageReader``) and only the HF rows
its q/k rows come from, and gives exactly the weights the folder was exported from (bitwise, gathered back to full
tensors), as a single-process load does, tied embeddings included."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from tests.helpers.dist import run_workers
from titanlite.checkpoint import layout
from titanlite.checkpoint.hf_export import dcp_to_hf
from titanlite.models.llama3 import Llama3ModelArgs, Transformer

pytestmark = pytest.mark.usefixtures("one_thread")

ARGS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=64, max_seq_len=64)


def load_worker(args: dict) -> dict:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from titanlite.checkpoint import hf_import

    dist.init_process_group("gloo")
    requested, rows_read = [], []

    class CountingReader(hf_import.HuggingFaceStorageReader):
        def read_data(self, plan, planner):
            requested.extend((item.storage_index.fqn, math.prod(item.lengths)) for item in plan.items)
            return super().read_data(plan, planner)

    read_tensor = hf_import._read_tensor

    def counting_read(file, hf_name, index=None):
        tensor = read_tensor(file, hf_name, index)
        rows_read.append((hf_name, tensor.numel()))
        return tensor

    hf_import.HuggingFaceStorageReader, hf_import._read_tensor = CountingReader, counting_read
    torch.manual_seed(1 + dist.get_rank())  # other weights than the folder's, and different on each rank
    model = Transformer(Llama3ModelArgs(**args["model"]))
    mesh = init_device_mesh("cpu", (2,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    hf_import.load_hf_weights(args["hf"], model)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    expected = torch.load(args["expected"], weights_only=True)
    same = sorted(full) == sorted(expected) and all(torch.equal(full[k], expected[k]) for k in expected)
    dist.destroy_process_group()
    return {"same": same, "requested": requested, "rows_read": rows_read}


# n_kv_heads=2: each rank's half of wk is one whole head; n_kv_heads=1: the ranks' halves cut the one head
@pytest.mark.parametrize("tied,kv_heads", [(False, 2), (True, 1)])
def test_each_rank_reads_only_its_slices_and_gets_the_exported_weights(tied, kv_heads, tmp_path):
    from titanlite.checkpoint.hf_import import load_hf_weights

    model_args = {**ARGS, "tie_word_embeddings": tied, "n_kv_heads": kv_heads}
    torch.manual_seed(0)
    model = Transformer(Llama3ModelArgs(**model_args))
    model.init_weights()
    state = model.state_dict()
    step = tmp_path / "step"
    dcp.save({"model": state}, checkpoint_id=str(step), no_dist=True)
    info = {"step": 1, "model_only": True, "model": {"name": "llama3", "args": dataclasses.asdict(model.args)}}
    layout.write_info(step, {**info, "tokenizer": {"bos_id": 256, "eos_id": 257}})
    hf = dcp_to_hf(step, tmp_path / "hf", max_shard_bytes=100_000)  # several files and an index
    assert len(list(hf.glob("*.safetensors"))) > 1
    if tied:  # as transformers saves a tied model: no lm_head.weight
        index = json.loads((hf / "model.safetensors.index.json").read_text())
        file = hf / index["weight_map"].pop("lm_head.weight")
        save_file({k: v for k, v in load_file(file).items() if k != "lm_head.weight"}, file, metadata={"format": "pt"})
        (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    torch.save({k: v.clone() for k, v in state.items()}, tmp_path / "expected.pt")
    single = Transformer(Llama3ModelArgs(**model_args))  # the single-process load gives the same weights
    load_hf_weights(hf, single)
    assert all(torch.equal(v, state[k]) for k, v in single.state_dict().items())
    args = {"model": model_args, "hf": str(hf), "expected": str(tmp_path / "expected.pt")}
    results = run_workers(load_worker, 2, args, timeout=180)
    assert results[0]["same"]  # gathered on rank 0 (cpu_offload)
    # the DCP reads: the renamed-only tensors (all but q/k), each element read by exactly one rank
    direct = {n: v.numel() for n, v in state.items() if not n.endswith(("attention.wq.weight", "attention.wk.weight"))}
    per_rank = [sum(n for _, n in r["requested"]) for r in results]
    assert sum(per_rank) == sum(direct.values())  # a tied output reads the embedding's HF tensor once more
    assert all(n < sum(direct.values()) * 0.6 for n in per_rank), per_rank  # about half each (FSDP rows)
    names = {name for r in results for name, _ in r["requested"]}
    assert "lm_head.weight" not in names if tied else "lm_head.weight" in names
    assert not any(n.endswith(("q_proj.weight", "k_proj.weight")) for n in names)  # reordered: read by rows
    # q/k: each rank reads the HF rows its native rows come from (native row 2j + i of a head is HF row j + i * 8)
    for proj, native in (("q_proj", "wq"), ("k_proj", "wk")):
        for layer in range(ARGS["n_layers"]):
            numel = state[f"layers.{layer}.attention.{native}.weight"].numel()
            hf_name = f"model.layers.{layer}.self_attn.{proj}.weight"
            read = [sum(n for name, n in r["rows_read"] if name == hf_name) for r in results]
            if proj == "k_proj" and kv_heads == 1:  # rank 0's rows 0-7 are HF rows 0-3 and 8-11: rows 0-11 read
                assert read == [numel * 12 // 16] * 2, read
            else:  # a rank's rows are whole heads: exactly its half
                assert read == [numel // 2] * 2, read
    assert {name for r in results for name, _ in r["rows_read"]} == {
        f"model.layers.{i}.self_attn.{p}.weight" for i in range(ARGS["n_layers"]) for p in ("q_proj", "k_proj")
    }


def test_only_a_pure_row_reordering_is_read_by_rows():
    from titanlite.checkpoint.hf_import import _row_order
    from titanlite.models.llama3.hf_adapter import Llama3HFAdapter

    class Convert:  # an adapter whose conversion is ``fn``
        def __init__(self, fn):
            self.from_hf_parts = lambda name, parts: fn(parts[0])

    w = torch.randn(8, 3)
    flip = _row_order(Convert(lambda t: t.flip(0)), "w", w)
    assert torch.equal(w.flip(0), w[flip])
    for not_rows in (lambda t: t * 2, lambda t: t.flip(1), lambda t: t[:4], lambda t: t[[0, 0, 1, 2, 3, 4, 5, 6]]):
        assert _row_order(Convert(not_rows), "w", w) is None
    adapter = Llama3HFAdapter(Llama3ModelArgs(**ARGS))
    wq = torch.randn(64, 64)
    order = _row_order(adapter, "layers.0.attention.wq.weight", wq)
    assert torch.equal(adapter.from_hf_parts("layers.0.attention.wq.weight", [wq]), wq[order])
