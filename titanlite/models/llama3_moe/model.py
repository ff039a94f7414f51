"""``llama3_moe``: titanlite's Llama 3 decoder with mixture-of-experts feed-forward layers.

Every block is a Llama 3 block (:class:`~titanlite.models.llama3.model.TransformerBlock`: grouped-query
attention with interleaved RoPE, RMSNorm, residuals); in blocks ``n_dense_layers`` and later the
``feed_forward`` is a :class:`~titanlite.models.moe.MoE` (router, stacked routed experts, optional shared
experts, Llama's SwiGLU) instead of a dense SwiGLU. Names therefore stay Llama's, with the MoE's inside:
``layers.<i>.feed_forward.router.gate.weight``, ``.router.expert_bias`` (the aux-loss-free bias, a
buffer), ``.experts.w1`` ``[E, hidden, dim]``, ``.shared_experts.w1.weight`` ...
"""

from __future__ import annotations

from titanlite.models.llama3.model import FeedForward, Transformer
from titanlite.models.llama3_moe.args import Llama3MoEArgs
from titanlite.models.moe import MoE


class Llama3MoE(Transformer):
    """``forward(tokens [B, S], document_ids=None, cache=None) -> logits [B, S, vocab]``, as Llama 3's."""

    def __init__(self, args: Llama3MoEArgs):
        super().__init__(args)
        cfg = args.moe_config()
        for i, block in self.layers.items():
            if args.is_moe_layer(int(i)):
                block.feed_forward = MoE(args.dim, cfg, shared_cls=FeedForward)
