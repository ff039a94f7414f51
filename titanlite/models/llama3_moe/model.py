"""``llama3_moe``: Llama 3 blocks (:class:`~titanlite.models.llama3.model.TransformerBlock`) whose
``feed_forward``, from block ``n_dense_layers`` on, is a :class:`~titanlite.models.moe.MoE`; names stay Llama's,
with the MoE's inside (``layers.<i>.feed_forward.router.gate.weight``, ``.router.expert_bias``, ``.experts.w1``,
``.shared_experts.w1.weight`` ...).
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
