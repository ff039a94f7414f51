"""Llama 3 architecture hyper-parameters and the published model sizes ("flavors")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from titanlite.errors import ConfigError

# Attention-mask kinds the model understands. Add a name here (and handle it in
# ``Attention.attention``) to support a new one, e.g. "block_causal" for document masking.
ATTN_MASK_TYPES: tuple[str, ...] = ("causal", "block_causal")
ATTN_BACKENDS: tuple[str, ...] = ("auto", "sdpa", "flex")


class DecoderArgs:
    """What the args of a Llama-style decoder (Llama 3, its MoE, Qwen3) share: :meth:`validate` on construction
    and :attr:`kv_heads`."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (``n_kv_heads`` with None resolved to ``n_heads``)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads


@dataclass
class Llama3ModelArgs(DecoderArgs):
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None = n_heads (plain multi-head attention)
    vocab_size: int = 128256
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Llama 3.1 RoPE frequency scaling; a factor of 0 disables it.
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    max_seq_len: int = 8192  # length of the precomputed rotary table
    tie_word_embeddings: bool = False
    depth_init: bool = True  # scale output-projection init by layer depth
    attn_mask_type: str = "causal"  # "block_causal": attend only within the token's own document
    attn_backend: str = "auto"  # block_causal kernel: flex on CUDA, SDPA + boolean mask on CPU

    def validate(self) -> None:
        check_decoder_args(self, ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"))
        if self.dim % self.n_heads != 0:
            raise ConfigError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.ffn_dim_multiplier is not None and self.ffn_dim_multiplier <= 0:
            raise ConfigError(f"ffn_dim_multiplier must be positive or None, got {self.ffn_dim_multiplier}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size, Meta's formula: 2/3 of 4*dim, times the multiplier, rounded up."""
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


def check_decoder_args(args: Any, positive: tuple[str, ...]) -> None:
    """The checks of a Llama-style decoder's args (Llama 3, its MoE, Qwen3): each field in ``positive`` a positive
    integer, the heads, norm, RoPE (Llama 3.1 scaling where the args have it) and attention kind; a one-line
    ValueError naming the field otherwise."""
    for name in positive:
        value = getattr(args, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{type(args).__name__}.{name} must be a positive integer, got {value!r}")
    if args.n_kv_heads is not None and (not isinstance(args.n_kv_heads, int) or args.n_kv_heads <= 0):
        raise ConfigError(
            f"{type(args).__name__}.n_kv_heads must be a positive integer or None, got {args.n_kv_heads!r}"
        )
    if args.head_dim % 2:
        raise ConfigError(f"head_dim ({args.head_dim}) must be even for rotary embeddings")
    if args.n_heads % args.kv_heads:
        raise ConfigError(f"n_heads ({args.n_heads}) must be divisible by n_kv_heads ({args.kv_heads})")
    if args.norm_eps <= 0:
        raise ConfigError(f"norm_eps must be positive, got {args.norm_eps}")
    if args.rope_theta <= 0:
        raise ConfigError(f"rope_theta must be positive, got {args.rope_theta}")
    scaling = getattr(args, "rope_scaling_factor", 0.0)
    if scaling < 0:
        raise ConfigError(f"rope_scaling_factor must be >= 0 (0 = off), got {scaling}")
    if scaling > 0:
        if not 0 < args.rope_low_freq_factor < args.rope_high_freq_factor:
            raise ConfigError(
                "RoPE scaling needs 0 < rope_low_freq_factor < rope_high_freq_factor, got "
                f"{args.rope_low_freq_factor} and {args.rope_high_freq_factor}"
            )
        if args.rope_original_max_position <= 0:
            raise ConfigError(f"rope_original_max_position must be positive, got {args.rope_original_max_position}")
    if args.attn_backend not in ATTN_BACKENDS:
        raise ConfigError(f"attn_backend must be one of {ATTN_BACKENDS}, got {args.attn_backend!r}")
    if args.attn_mask_type not in ATTN_MASK_TYPES:
        raise ConfigError(f"attn_mask_type must be one of {ATTN_MASK_TYPES}, got {args.attn_mask_type!r}")


# Llama 3.1 RoPE scaling (the factor differs by size) and its 128K context
_ROPE31 = dict(rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_position=8192, max_seq_len=131072)
_LLAMA32 = dict(multiple_of=256, rope_scaling_factor=32.0, tie_word_embeddings=True, **_ROPE31)  # 1B, 3B
_LLAMA31_8X = dict(rope_scaling_factor=8.0, **_ROPE31)  # 8B, 70B, 405B

LLAMA3_FLAVORS: dict[str, Llama3ModelArgs] = {
    "debugmodel": Llama3ModelArgs(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=512, max_seq_len=2048),
    # Llama 3.2
    "1B": Llama3ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, **_LLAMA32),
    "3B": Llama3ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0, **_LLAMA32),
    # Llama 3.1
    "8B": Llama3ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024, **_LLAMA31_8X
    ),
    "70B": Llama3ModelArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096, **_LLAMA31_8X
    ),
    "405B": Llama3ModelArgs(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096, **_LLAMA31_8X
    ),
}
