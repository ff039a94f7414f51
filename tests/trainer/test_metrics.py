"""FLOPs-per-token formula and peak table, checked by hand."""

import math
import types

import pytest
import torch

from tests.helpers.tiny import TINY_MODEL
from titanlite.models import build_model, get_model_spec, make_model_args
from titanlite.models.flops import num_params
from titanlite.models.registry import model_counts
from titanlite.trainer import peaks
from titanlite.trainer.metrics import MetricsHook
from titanlite.trainer.peaks import gpu_memory_bytes, matmul_dtype, peak_flops, peak_flops_for_name


def test_flops_per_token_1b_by_hand():
    args = make_model_args("llama3", "1B")
    n = num_params(build_model("llama3", "1B"))
    assert n == 1_235_814_400
    # tied: every parameter is a matmul parameter (embedding = output projection), no extra count
    attention = 12 * 16 * 32 * 64 * 2048
    assert model_counts(get_model_spec("llama3"), args, 2048) == (n, 6 * 1_235_814_400 + attention)


def test_flops_per_token_8b_by_hand():
    args = make_model_args("llama3", "8B")
    n = 8_030_261_248
    embed = 128256 * 4096
    attention = 12 * 32 * 32 * 128 * 8192
    assert model_counts(get_model_spec("llama3"), args, 8192) == (n, 6 * (n - embed) + attention)


@pytest.mark.parametrize("flavor, tied", [("1B", True), ("8B", False), ("debugmodel", False)])
def test_family_counts_equal_the_meta_model_count(flavor, tied):
    """A family without count functions is counted on its meta-built model; for Llama 3 that count
    equals the family's own formula, tied or not."""
    import dataclasses

    spec = get_model_spec("llama3")
    args = make_model_args("llama3", flavor)
    assert args.tie_word_embeddings == tied
    bare = dataclasses.replace(spec, num_params=None, flops_per_token=None)
    assert model_counts(bare, args, 4096) == model_counts(spec, args, 4096)


def test_peak_table():
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3", "bfloat16") == 989.5e12
    # datasheet: 1,513 TFLOPS bf16 *with sparsity* -> 756.5 dense (the table had 756)
    assert peak_flops_for_name("NVIDIA H100 PCIe", "bfloat16") == 756.5e12
    assert peak_flops_for_name("NVIDIA H200", "float8") == 1979e12
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB", "bfloat16") == 312e12
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB", "float8") is None  # no fp8 on Ampere
    assert peak_flops_for_name("Some Future GPU", "bfloat16") is None


def test_cpu_peak_is_measured():
    rate = peak_flops(torch.device("cpu"), "float32")
    assert 1e8 < rate < 1e14


@pytest.mark.parametrize("gflops,largest", [(1.0, 256), (100.0, 1024), (10_000.0, 2048)])
def test_cpu_peak_sizes_the_matmul_to_the_rate(monkeypatch, gflops, largest):
    """On a fake clock where a matmul costs 2 n^3 / rate: the size doubles from 256 while one matmul takes
    under 20 ms (bf16 without a native kernel stays small and cheap), and the peak is the rate."""
    clock, sizes = [0.0], []

    def fake_mm(a, b):
        sizes.append(a.shape[0])
        clock[0] += 2 * a.shape[0] ** 3 / (gflops * 1e9)

    monkeypatch.setattr(peaks, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(torch, "mm", fake_mm)
    rate = peaks.measure_cpu_matmul_peak.__wrapped__("bfloat16", threads=7)
    assert max(sizes) == largest and sizes[-1] == largest
    assert rate == pytest.approx(gflops * 1e9)


@pytest.mark.parametrize(
    "name,dtype,tflops",
    [
        ("NVIDIA H100 80GB HBM3", "float8", 1979.0),  # SXM: 3,958 sparse
        ("NVIDIA H100 NVL", "bfloat16", 835.5),  # 1,671 sparse
        ("NVIDIA H100 PCIe", "float8", 1513.0),  # 3,026 sparse
        ("NVIDIA H200", "bfloat16", 989.5),
        ("NVIDIA H200 NVL", "bfloat16", 835.5),
        ("NVIDIA GH200 480GB", "bfloat16", 989.5),
        ("NVIDIA H20", "bfloat16", 148.0),  # not mistaken for an H200
        ("NVIDIA B200", "bfloat16", 2250.0),  # HGX B200: 4.5 PF sparse
        ("NVIDIA B200", "float8", 4500.0),
        ("NVIDIA A100 80GB PCIe", "bfloat16", 312.0),
        ("NVIDIA L40S", "bfloat16", 362.05),  # 733 sparse
        ("NVIDIA L40S", "float8", 733.0),
        ("AMD Instinct MI300X", "bfloat16", 1307.4),  # 2,614.9 sparse
        ("AMD Instinct MI300X", "float8", 2614.9),
        ("NVIDIA H100 80GB HBM3", "tfloat32", 494.5),
        ("NVIDIA A100-SXM4-40GB", "float32", 19.5),
    ],
)
def test_peak_table_dense_figures(name, dtype, tflops):
    assert peak_flops_for_name(name, dtype) == pytest.approx(tflops * 1e12)


def test_unknown_devices_get_no_peak():
    for name in ("NVIDIA L40", "NVIDIA A10G", "NVIDIA GeForce RTX 4090", "NVIDIA H1000", "Tesla V100-SXM2-16GB"):
        assert peak_flops_for_name(name, "bfloat16") is None, name
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB", "float8") is None
    assert gpu_memory_bytes("NVIDIA H100 80GB HBM3") == 80e9
    assert gpu_memory_bytes("NVIDIA A100-PCIE-40GB") == 40e9
    assert gpu_memory_bytes("Some Future GPU") is None


def test_matmul_dtype_selects_the_peak():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert matmul_dtype("bfloat16", False, cuda) == "bfloat16"
    assert matmul_dtype("bfloat16", True, cuda) == "float8"  # float8 linears: the float8 peak
    assert matmul_dtype("bfloat16", True, cpu) == "bfloat16"  # no float8 on CPU
    assert matmul_dtype("float32", False, cuda) == ("tfloat32" if torch.backends.cuda.matmul.allow_tf32 else "float32")
    assert matmul_dtype("float32", False, cpu) == "float32"


TINY = [
    *TINY_MODEL,
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "4",
    "--training.steps",
    "1",
    "--lr_scheduler.warmup_steps",
    "0",
]


def test_mfu_by_hand(tmp_path):
    """MFU in a logged record = tokens/s per device x FLOPs/token / peak, FLOPs/token by hand."""
    from titanlite.models import load_config
    from titanlite.trainer import Trainer

    t = Trainer(load_config(TINY + ["--job.dump_folder", str(tmp_path / "a")]))
    d, L, V, F = 64, 2, 512, 256  # ffn: int(8 * 64 / 3) = 170, rounded up to a multiple of 256
    params = V * d + L * (2 * d * d + 2 * d * 32 + 3 * d * F + 2 * d) + d + V * d  # kv dim 2 x 16
    assert t.n_params == params
    assert t.flops_per_token == 6 * (params - V * d) + 12 * L * 4 * 16 * 32
    metrics = next(h for h in t.hooks if isinstance(h, MetricsHook))
    metrics.peak_flops = 1e15  # pretend a 1 PFLOP/s device (below achieved FLOP/s a CPU peak is re-measured)
    (r,) = t.train()
    assert r["mfu"] == pytest.approx(r["tokens_per_s"] * t.flops_per_token / 1e15)
    t2 = Trainer(load_config(TINY + ["--job.dump_folder", str(tmp_path / "b")]))
    next(h for h in t2.hooks if isinstance(h, MetricsHook)).peak_flops = None  # an unknown GPU: not guessed
    (r2,) = t2.train()
    assert r2["mfu"] is None and math.isfinite(r2["tokens_per_s"])


def test_validation_time_is_left_out_of_tokens_per_s(tmp_path, monkeypatch):
    """Evaluation hooks (validation, samples, downstream scores) run between steps: their time must not
    show up as a training slowdown in the next logged tokens/s."""
    import time

    from titanlite.models import load_config
    from titanlite.trainer import Trainer
    from titanlite.trainer.validation import ValidationHook

    args = [*TINY[:-4], "--training.steps", "4", "--metrics.log_freq", "2", "--validation.enable"]
    t = Trainer(load_config(args + ["--validation.freq", "1", "--job.dump_folder", str(tmp_path)]))
    hook = next(h for h in t.hooks if isinstance(h, ValidationHook))
    evaluate = hook.evaluate
    # a validation that takes 1000 s after every step, on a clock the validation moves forward (a real sleep would
    # make the check depend on how busy the machine is)
    real, skipped = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real() + skipped[0])
    hook.evaluate = lambda: (skipped.__setitem__(0, skipped[0] + 1000.0), evaluate())[1]
    records = [r for r in t.train() if "tokens_per_s" in r]
    assert [r["step"] for r in records] == [1, 2, 4]
    for r in records[1:]:  # windows of 2 steps, each followed by a 1000 s validation: >= 2000 s if it were counted
        assert 2 * 4 * 32 / r["tokens_per_s"] < 500.0, r
