"""Float8 all-gather for FSDP2 (titanlite.parallel.float8_fsdp) against the plain float8 path.

The reference is the same FSDP 2 float8 run without ``enable_fsdp_float8_all_gather``: FSDP gathers the weights in
the parameter dtype and each matmul casts them. With the option each rank casts its shard with the global
tensorwise scale and FSDP gathers float8, which must give bit for bit the same float8 weights, hence the same
losses, gradient norms and parameters (the check is exact equality). Validation is not bitwise: it runs the
linears in high precision, and with float8 all-gather there is no high-precision unsharded weight, so it sees the
float8-rounded weights (close, within float8 rounding).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_workers
from tests.helpers.tiny import TINY_MODEL
from titanlite.config import ConfigError
from titanlite.models import load_config

STEPS = 4


def all_gather_worker(args: dict) -> dict:
    import tempfile

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    from titanlite.parallel import float8_fsdp
    from titanlite.parallel.float8 import Float8GatheredWeight, float8_modules
    from titanlite.trainer import Trainer

    seen = {"pre_all_gather": 0, "own_all_reduce": 0, "gathered_in_forward": 0, "float8_inputs": 0}
    original = float8_fsdp.Float8ShardedWeight.fsdp_pre_all_gather

    def counting(self, mesh, outer_size, outer_stride, module, mp_policy):  # FSDP reads the signature
        seen["pre_all_gather"] += 1
        seen["own_all_reduce"] += self.scale is None
        inputs, metadata = original(self, mesh, outer_size, outer_stride, module, mp_policy)
        seen["float8_inputs"] += all(t.dtype == torch.float8_e4m3fn for t in inputs)
        return inputs, metadata

    float8_fsdp.Float8ShardedWeight.fsdp_pre_all_gather = counting
    out = {}
    for gather in ("false", "true"):
        with tempfile.TemporaryDirectory() as dump:
            cfg = load_config(
                [*TINY_MODEL, "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.seed", "3"]
                + ["--training.steps", str(STEPS), "--job.dump_folder", dump, "--metrics.log_freq", "1"]
                + ["--parallelism.data_parallel_shard_degree", "2", "--quantize.linear.float8.enable", "true"]
                + ["--quantize.linear.float8.enable_fsdp_float8_all_gather", gather, *args["extra"]]
                + ["--validation.enable", "true", "--validation.freq", str(STEPS), "--validation.steps", "1"]
            )
            trainer = Trainer(cfg)
            probe = trainer.model.layers["0"].attention.wq

            def gathered(module, inputs):
                seen["gathered_in_forward"] += isinstance(module.weight, Float8GatheredWeight)

            probe.register_forward_pre_hook(gathered)
            records = trainer.train()
            for m in trainer.model.modules():  # validation left the last group gathered
                if hasattr(m, "reshard"):
                    m.reshard()
            state = get_model_state_dict(trainer.model)
            out[gather] = {
                "loss": [r["loss"] for r in records if "loss" in r],
                "grad_norm": [r["grad_norm"] for r in records if "grad_norm" in r],
                "val_loss": [r["val_loss"] for r in records if "val_loss" in r],
                "params": {n: p.full_tensor() for n, p in trainer.model.named_parameters()},
                "plain_state": all(
                    type(v.to_local()) is torch.Tensor for v in state.values() if isinstance(v, DTensor)
                ),
                "float8_weights": sum(1 for _ in float8_modules(trainer.model)),
                "seen": dict(seen),
            }
            seen.update(dict.fromkeys(seen, 0))
    dist.barrier()
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_float8_all_gather_equals_the_plain_float8_path(dtype):
    """FSDP 2 on gloo, 4 steps, FSDP's parameter dtype fp32 or bf16: identical losses, gradient norms and
    parameters; FSDP gathered float8 shards and the forward saw the gathered float8 weight; after the first
    forward every weight's scale came from the one all-reduce after the optimizer step; the state dict holds
    plain tensors (checkpoints); validation within float8 rounding of the plain path."""
    extra = ["--training.mixed_precision_param", dtype]
    results = run_workers(all_gather_worker, 2, {"extra": extra}, timeout=240)
    for rank, res in enumerate(results):
        plain, gathered = res["false"], res["true"]
        assert gathered["loss"] == plain["loss"] and gathered["grad_norm"] == plain["grad_norm"], rank
        for name, p in plain["params"].items():
            assert torch.equal(gathered["params"][name], p), (rank, name)
        assert plain["seen"]["pre_all_gather"] == 0 and plain["seen"]["gathered_in_forward"] == 0
        seen, n = gathered["seen"], gathered["float8_weights"]
        # forward and backward of every step, and the validation forward
        assert seen["pre_all_gather"] == seen["float8_inputs"] == n * (2 * STEPS + 1), seen
        assert seen["own_all_reduce"] == n, seen  # the first forward only: later scales were precomputed
        assert seen["gathered_in_forward"] == STEPS + 1, seen
        assert gathered["plain_state"]
        assert gathered["val_loss"] == pytest.approx(plain["val_loss"], rel=1e-2)
        assert gathered["val_loss"] != plain["val_loss"]  # it did see float8-rounded weights
        assert gathered["loss"][-1] < gathered["loss"][0]


def test_float8_all_gather_is_refused_where_it_cannot_work():
    """Rowwise (backward recasts the weight along its other dimension, from the high-precision weight) and
    tensor parallelism: one-line errors."""
    from titanlite.models import build_model
    from titanlite.models.llama3 import parallelize as par
    from titanlite.parallel import float8
    from titanlite.parallel.parallel_dims import ParallelDims
    from titanlite.parallel.policies import Policies

    with pytest.raises(ConfigError, match="enable_fsdp_float8_all_gather needs recipe_name = 'tensorwise'"):
        load_config(
            ["--quantize.linear.float8.enable_fsdp_float8_all_gather", "--quantize.linear.float8.recipe_name=rowwise"]
        )
    policies = Policies(float8=float8.Float8Policy(enable=True, enable_fsdp_float8_all_gather=True))
    with pytest.raises(
        ValueError, match="enable_fsdp_float8_all_gather is not supported with tensor_parallel_degree=2"
    ):
        par.parallelize_llama(build_model("llama3", "debugmodel"), ParallelDims(tp=2, world_size=2), policies)
