"""titanlite.bench.step_floors: each part's floor of a step, against counts made by hand for a small shape."""

from __future__ import annotations

import pytest

from titanlite.bench.step_floors import (
    attention_flops_per_token,
    elementwise_bytes_per_token,
    matmul_flops_per_token,
    step_floors,
)
from titanlite.models.flops import ModelShape

# dim 8, 2 blocks, 2 query heads of 4 sharing 1 key/value head, SwiGLU 16 wide, 32 tokens of vocabulary (untied)
SHAPE = ModelShape(dim=8, n_layers=2, n_heads=2, kv_heads=1, ffn_hidden_dim=16, vocab_size=32)
# a block's linears: wq, wo 8 x 8; wk, wv 8 x 4; w1, w2, w3 8 x 16 = 64 + 64 + 32 + 32 + 384 = 576
BLOCK_MATMUL, OUTPUT = 576, 32 * 8


def test_matmul_and_attention_flops_by_hand():
    assert matmul_flops_per_token(SHAPE) == 6 * (2 * BLOCK_MATMUL + OUTPUT)  # the input embedding is a lookup
    # full AC: each block's forward (2 FLOPs per parameter) once more; the output layer is not recomputed
    assert matmul_flops_per_token(SHAPE, recompute_forward=True) == 6 * (2 * 576 + 256) + 2 * 2 * 576
    tied = ModelShape(
        dim=8, n_layers=2, n_heads=2, kv_heads=1, ffn_hidden_dim=16, vocab_size=32, tie_word_embeddings=True
    )
    assert matmul_flops_per_token(tied) == matmul_flops_per_token(SHAPE)  # the one table is the output layer
    # causal, seq 10: per layer and head, q.k and p.v over 5 keys on average, 2 FLOPs a multiply-add, x3 passes
    assert attention_flops_per_token(SHAPE, 10) == 3 * 2 * 2 * 2 * 2 * 4 * 5
    assert attention_flops_per_token(SHAPE, 10, recompute_forward=True) == 4 * 2 * 2 * 2 * 2 * 4 * 5


def test_elementwise_bytes_by_hand():
    # per block forward: 2 x (residual + norm: 4 x 8) + RoPE 2 x (8 + 4) + SwiGLU 3 x 16 = 64 + 24 + 48 = 136;
    # forward + backward (twice) = 3 passes, 2 blocks; the loss: logits read and gradient written, 2 x 32
    assert elementwise_bytes_per_token(SHAPE, 2) == (136 * 3 * 2 + 64) * 2
    assert elementwise_bytes_per_token(SHAPE, 4, recompute_forward=True) == (136 * 4 * 2 + 64) * 4


def test_step_floors_divide_the_work_by_the_rates():
    got = step_floors(SHAPE, 100, 10, gemm_flops_per_s=1e3, bytes_per_s=1e2, update_bytes=500.0, act_bytes=2)
    assert got == pytest.approx(
        {
            "matmul": 100 * 6 * (2 * BLOCK_MATMUL + OUTPUT) / 1e3,
            "attention": 100 * 3 * 2 * 2 * 2 * 2 * 4 * 5 / 1e3,
            "elementwise / norm": 100 * (136 * 3 * 2 + 64) * 2 / 1e2,
            "optimizer": 5.0,
            "communication": 0.0,
            "idle (host-bound)": 0.0,
        }
    )


def test_float8_linears_put_the_blocks_at_the_float8_rate_and_the_rest_at_bf16s():
    """The blocks' matmuls at the float8 rate; the output layer (kept in bf16) and attention at the bf16 one."""
    got = step_floors(SHAPE, 100, 10, gemm_flops_per_s=1e3, bytes_per_s=1e2, update_bytes=500.0, float8_flops_per_s=2e3)
    assert got["matmul"] == pytest.approx(100 * (6 * 2 * BLOCK_MATMUL / 2e3 + 6 * OUTPUT / 1e3))
    assert got["attention"] == pytest.approx(100 * 3 * 2 * 2 * 2 * 2 * 4 * 5 / 1e3)
