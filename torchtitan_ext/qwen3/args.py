"""Qwen3 dense-decoder hyper-parameters and the published model sizes ("flavors").

Differences from Llama 3 that the args have to express:

- ``head_dim`` is its own number, not ``dim // n_heads`` (Qwen3-0.6B: dim 1024, 16 heads of 128,
  so the attention width ``n_heads * head_dim = 2048`` is twice the model width);
- the SwiGLU hidden size is published as a plain number (``intermediate_size``), so it is a field
  (``ffn_hidden_dim``), not derived from ``multiple_of`` / ``ffn_dim_multiplier``;
- RMSNorm on every query and key head before RoPE (``qk_norm``), with ``norm_eps = 1e-6``;
- plain RoPE (theta 1e6, no Llama 3.1 frequency scaling) in Hugging Face's half-split layout.

The flavors copy the ``config.json`` of the released Qwen3 dense checkpoints (hidden_size,
intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
vocab_size, max_position_embeddings, rope_theta, rms_norm_eps, tie_word_embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.models.flops import params_of
from titanlite.models.llama3.args import DecoderArgs, check_decoder_args


@dataclass
class Qwen3ModelArgs(DecoderArgs):
    dim: int = 1024
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int | None = 8  # None = n_heads
    head_dim: int = 128  # per-head width; Qwen3 sets it independently of dim / n_heads
    ffn_hidden_dim: int = 3072  # SwiGLU hidden size (HF intermediate_size)
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 40960  # length of the precomputed rotary table
    tie_word_embeddings: bool = False
    qk_norm: bool = True  # RMSNorm over head_dim on q and k, before RoPE
    depth_init: bool = True  # scale output-projection init by layer depth (as titanlite's Llama)
    attn_mask_type: str = "causal"
    attn_backend: str = "auto"

    def validate(self) -> None:
        check_decoder_args(
            self, ("dim", "n_layers", "n_heads", "head_dim", "ffn_hidden_dim", "vocab_size", "max_seq_len")
        )

    @property
    def q_dim(self) -> int:
        """Width of the concatenated query heads (``wq`` output, ``wo`` input)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


# the parameter count from the architecture alone (tied embedding once): titanlite's formula knows Qwen3's free
# head_dim and the QK-norm gains
num_params_from_args = params_of

_QWEN3 = dict(vocab_size=151936, norm_eps=1e-6, rope_theta=1_000_000.0, max_seq_len=40960, head_dim=128)

QWEN3_FLAVORS: dict[str, Qwen3ModelArgs] = {
    # Small enough to train on a CPU in minutes; head_dim (64) deliberately differs from
    # dim / n_heads (256 / 8 = 32), as in the real sizes, so the decoupled head width is exercised.
    "debugmodel": Qwen3ModelArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=64,
        ffn_hidden_dim=768,
        vocab_size=512,
        norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_seq_len=4096,
        tie_word_embeddings=True,
    ),
    "0.6B": Qwen3ModelArgs(
        dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden_dim=3072, tie_word_embeddings=True, **_QWEN3
    ),
    "1.7B": Qwen3ModelArgs(
        dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden_dim=6144, tie_word_embeddings=True, **_QWEN3
    ),
    "4B": Qwen3ModelArgs(
        dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden_dim=9728, tie_word_embeddings=True, **_QWEN3
    ),
    "8B": Qwen3ModelArgs(
        dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden_dim=12288, tie_word_embeddings=False, **_QWEN3
    ),
    "14B": Qwen3ModelArgs(
        dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_hidden_dim=17408, tie_word_embeddings=False, **_QWEN3
    ),
    "32B": Qwen3ModelArgs(
        dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_hidden_dim=25600, tie_word_embeddings=False, **_QWEN3
    ),
}
