"""FLOPs-per-token formula and peak table, checked by hand."""
import pytest
import torch

from titanlite.metrics import flops_per_token, peak_flops, peak_flops_for_name
from titanlite.models import build_model, make_model_args
from titanlite.metrics import num_params


def test_flops_per_token_1b_by_hand():
    args = make_model_args("llama3", "1B")
    n = num_params(build_model("llama3", "1B"))
    assert n == 1_235_814_400
    # tied: every parameter is a matmul parameter (embedding = output projection), no extra count
    attention = 12 * 16 * 32 * 64 * 2048
    assert flops_per_token(args, n, 2048) == 6 * 1_235_814_400 + attention


def test_flops_per_token_8b_by_hand():
    args = make_model_args("llama3", "8B")
    n = 8_030_261_248
    embed = 128256 * 4096
    attention = 12 * 32 * 32 * 128 * 8192
    assert flops_per_token(args, n, 8192) == 6 * (n - embed) + attention


def test_peak_table():
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3", "bfloat16") == 989.5e12
    assert peak_flops_for_name("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert peak_flops_for_name("NVIDIA H200", "float8") == 1979e12
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB", "bfloat16") == 312e12
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB", "float8") is None  # no fp8 on Ampere
    assert peak_flops_for_name("Some Future GPU", "bfloat16") is None


def test_cpu_peak_is_measured():
    rate = peak_flops(torch.device("cpu"), "float32")
    assert 1e8 < rate < 1e14
