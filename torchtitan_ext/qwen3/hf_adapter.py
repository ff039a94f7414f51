"""Qwen3 <-> Hugging Face ``Qwen3ForCausalLM``: parameter names and ``config.json``.

The model already uses Hugging Face's half-split RoPE layout, so every tensor converts unchanged;
only names differ:

=====================================  ==================================================
titanlite / torchtitan name            Hugging Face name
=====================================  ==================================================
``tok_embeddings.weight``              ``model.embed_tokens.weight``
``layers.N.attention.wq.weight``       ``model.layers.N.self_attn.q_proj.weight`` (k, v, o alike)
``layers.N.attention.q_norm.weight``   ``model.layers.N.self_attn.q_norm.weight`` (k_norm alike)
``layers.N.feed_forward.w1.weight``    ``model.layers.N.mlp.gate_proj.weight`` (w3: up, w2: down)
``layers.N.attention_norm.weight``     ``model.layers.N.input_layernorm.weight``
``layers.N.ffn_norm.weight``           ``model.layers.N.post_attention_layernorm.weight``
``norm.weight`` / ``output.weight``    ``model.norm.weight`` / ``lm_head.weight``
=====================================  ==================================================

Built on titanlite's shared ``HFDecoderAdapter`` (the ``ModelSpec.hf_adapter`` contract), so
``titanlite.checkpoint.hf_export`` / ``hf_import`` (``titanlite convert dcp-to-hf`` / ``hf-to-dcp``) converts
Qwen3 checkpoints once the extension is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from titanlite.errors import CheckpointError
from titanlite.models.hf_decoder import DECODER_BLOCK, HFDecoderAdapter
from torchtitan_ext.qwen3.args import Qwen3ModelArgs


class Qwen3HFAdapter(HFDecoderAdapter):
    """The shared decoder names plus the QK-norm gains; tensors convert unchanged."""

    architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"
    family = "Qwen3"
    BLOCK = {
        **DECODER_BLOCK,
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
    }

    def extra_block_shapes(self) -> dict[str, tuple[int, ...]]:
        a = self.args
        if not a.qk_norm:
            return {}
        return {"attention.q_norm.weight": (a.head_dim,), "attention.k_norm.weight": (a.head_dim,)}

    def extra_hf_config(self) -> dict[str, Any]:
        a = self.args
        if not a.qk_norm:
            raise CheckpointError(
                "Qwen3ForCausalLM always applies QK-norm; a model with qk_norm=false has no HF equivalent"
            )
        return {
            "rope_theta": a.rope_theta,  # transformers 4.x
            "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta},  # transformers 5
            "rope_scaling": None,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": a.n_layers,
        }

    @classmethod
    def args_from_hf_config(cls, config: Mapping[str, Any]) -> Qwen3ModelArgs:
        """Model args of an HF Qwen3 ``config.json``; ValueError for what this model cannot express."""
        cls.check_hf_config(config)
        if config.get("use_sliding_window"):
            raise CheckpointError("unsupported use_sliding_window=true (this Qwen3 attends to the whole window)")
        theta, rope_type, _ = cls.rope_from_hf(config)
        if rope_type != "default":
            raise CheckpointError(f"unsupported rope_type {rope_type!r} (this Qwen3 supports plain RoPE only)")
        n_heads = config["num_attention_heads"]
        return Qwen3ModelArgs(
            dim=config["hidden_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            head_dim=int(config.get("head_dim") or config["hidden_size"] // n_heads),
            ffn_hidden_dim=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_seq_len=int(config.get("max_position_embeddings", 40960)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
