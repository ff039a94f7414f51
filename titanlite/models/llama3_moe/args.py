"""Hyper-parameters of ``llama3_moe``: a Llama 3 decoder whose feed-forward layers are MoE layers (the ``moe_*``
fields, :class:`~titanlite.models.moe.MoEArgs`) after the first ``n_dense_layers`` (DeepSeek-V3's
``first_k_dense_replace``); the Llama 3 fields mean what they mean in
:class:`~titanlite.models.llama3.args.Llama3ModelArgs`.

Flavors: ``debugmodel`` has the Llama debug model's attention and, per token, three 256-wide SwiGLUs per MoE
block (top-2 plus a shared expert), as many FLOPs as the dense debug model's 768-wide one, so the two are the
side-by-side pair of ``titanlite bench train``. ``671B`` is DeepSeek-V3's MoE shape; its attention is GQA, not
DeepSeek's multi-head latent attention (not built), with 128 query heads of width 96 and 8 key/value heads, which
give MLA's parameters per block, so the totals stay DeepSeek-V3's (~671 B, ~37 B active per token).
"""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.errors import ConfigError
from titanlite.models.llama3.args import DecoderArgs, check_decoder_args
from titanlite.models.moe.args import MoEArgs


@dataclass
class Llama3MoEArgs(MoEArgs, DecoderArgs):
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 8
    n_kv_heads: int | None = 4
    attn_head_dim: int = 0  # 0: dim // n_heads
    vocab_size: int = 512
    ffn_hidden_dim: int = 768  # the dense blocks' SwiGLU
    n_dense_layers: int = 1  # the first blocks are dense, the others MoE
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling_factor: float = 0.0  # Llama 3.1 scaling (0: off), as in llama3
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    max_seq_len: int = 2048
    tie_word_embeddings: bool = False
    depth_init: bool = True
    attn_mask_type: str = "causal"
    attn_backend: str = "auto"

    def validate(self) -> None:
        check_decoder_args(self, ("dim", "n_layers", "n_heads", "vocab_size", "ffn_hidden_dim", "max_seq_len"))
        if self.attn_head_dim < 0 or (not self.attn_head_dim and self.dim % self.n_heads):
            raise ConfigError(f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ConfigError(f"model.n_dense_layers ({self.n_dense_layers}) must be in [0, n_layers={self.n_layers}]")
        self.moe_config()  # checks the moe_* fields

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.n_dense_layers


LLAMA3_MOE_FLAVORS: dict[str, Llama3MoEArgs] = {
    "debugmodel": Llama3MoEArgs(
        moe_num_experts=8, moe_top_k=2, moe_hidden_dim=256, moe_num_shared_experts=1, moe_aux_loss_coef=1e-3
    ),
    "671B": Llama3MoEArgs(
        dim=7168,
        n_layers=61,
        n_heads=128,
        n_kv_heads=8,
        attn_head_dim=96,
        vocab_size=129280,
        ffn_hidden_dim=18432,
        n_dense_layers=3,
        norm_eps=1e-6,
        rope_theta=10000.0,
        max_seq_len=4096,
        moe_num_experts=256,
        moe_top_k=8,
        moe_hidden_dim=2048,
        moe_num_shared_experts=1,
        moe_score_func="sigmoid",
        moe_norm_topk_prob=True,
        moe_route_scale=2.5,
        moe_n_groups=8,
        moe_topk_groups=4,
        moe_aux_loss_coef=1e-4,
        moe_aux_loss_level="seq",
        moe_bias_update_rate=1e-3,
    ),
}
