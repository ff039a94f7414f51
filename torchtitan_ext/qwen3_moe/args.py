"""Qwen3-MoE hyper-parameters and the published sizes ("flavors").

Qwen3's dense fields (:class:`torchtitan_ext.qwen3.Qwen3ModelArgs`: free ``head_dim``, QK-norm, plain
RoPE in the half-split layout) plus the ``moe_*`` fields of titanlite's MoE layer
(:class:`titanlite.models.moe.MoEArgs`) and Qwen3-MoE's placement of sparse blocks: block ``i`` is a MoE
block unless ``i`` is in ``mlp_only_layers``, and only if ``(i + 1) % decoder_sparse_step == 0``; the
others keep a dense SwiGLU of ``ffn_hidden_dim`` (HF ``intermediate_size``).

Qwen3-MoE routes with a softmax over all experts, the top-8 renormalized (``norm_topk_prob``), no
shared expert, and trains with a Switch-style aux loss (``router_aux_loss_coef`` 0.001, counted over the
global batch: ``moe_aux_loss_level = "batch"``). The flavors copy the released ``config.json`` files
(hidden_size, intermediate_size, moe_intermediate_size, num_hidden_layers, num_attention_heads,
num_key_value_heads, head_dim, num_experts, num_experts_per_tok, vocab_size, max_position_embeddings,
rope_theta, rms_norm_eps); ``30B-A3B`` has 30.5 B parameters, 3.3 B active per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titanlite.errors import ConfigError
from titanlite.models.moe import MoEArgs
from torchtitan_ext.qwen3.args import Qwen3ModelArgs


@dataclass
class Qwen3MoEArgs(Qwen3ModelArgs, MoEArgs):
    """Qwen3's fields (their defaults: Qwen3-0.6B's) and checks, the ``moe_*`` fields, and the sparse placement."""

    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.decoder_sparse_step, int) or self.decoder_sparse_step < 1:
            raise ConfigError(f"model.decoder_sparse_step must be a positive integer, got {self.decoder_sparse_step!r}")
        if bad := [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]:
            raise ConfigError(f"model.mlp_only_layers names blocks outside 0..{self.n_layers - 1}: {bad}")
        self.moe_config()  # checks the moe_* fields

    def is_moe_layer(self, layer_id: int) -> bool:
        """Qwen3-MoE's rule (HF ``Qwen3MoeDecoderLayer``)."""
        return layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0


_QWEN3_MOE = dict(
    vocab_size=151936,
    head_dim=128,
    norm_eps=1e-6,
    rope_theta=1_000_000.0,
    max_seq_len=40960,
    moe_num_experts=128,
    moe_top_k=8,
    moe_norm_topk_prob=True,
    moe_aux_loss_coef=1e-3,
)

QWEN3_MOE_FLAVORS: dict[str, Qwen3MoEArgs] = {
    # CPU-sized: QK-norm, head_dim 64 != dim / n_heads, block 0 dense (mlp_only_layers), 8 experts top-2
    "debugmodel": Qwen3MoEArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=64,
        ffn_hidden_dim=768,
        vocab_size=512,
        max_seq_len=4096,
        mlp_only_layers=[0],
        moe_num_experts=8,
        moe_top_k=2,
        moe_hidden_dim=128,
        moe_norm_topk_prob=True,
        moe_aux_loss_coef=1e-3,
    ),
    "30B-A3B": Qwen3MoEArgs(
        dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_hidden_dim=6144, moe_hidden_dim=768, **_QWEN3_MOE
    ),
    "235B-A22B": Qwen3MoEArgs(
        dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, ffn_hidden_dim=12288, moe_hidden_dim=1536, **_QWEN3_MOE
    ),
}
