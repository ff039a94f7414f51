"""Qwen3-MoE: the Qwen3 decoder (torchtitan_ext.qwen3: QK-norm, free head_dim, half-split RoPE) whose sparse
blocks' ``feed_forward`` is titanlite's :class:`~titanlite.models.moe.MoE` (router, stacked experts).

Names: ``layers.<i>.feed_forward.router.gate.weight`` (HF ``mlp.gate.weight``),
``layers.<i>.feed_forward.experts.{w1,w2,w3}`` ``[E, ...]`` (HF's per-expert ``mlp.experts.<j>.{gate,down,up}
_proj.weight`` stacked), ``layers.<i>.feed_forward.router.expert_bias`` (the aux-loss-free bias, zero unless
a run updates it); dense blocks keep Qwen3's ``feed_forward.{w1,w2,w3}``.
"""

from __future__ import annotations

from titanlite.models.llama3.model import FeedForward
from titanlite.models.moe import MoE
from torchtitan_ext.qwen3.model import Qwen3Model
from torchtitan_ext.qwen3_moe.args import Qwen3MoEArgs


class Qwen3MoEModel(Qwen3Model):
    """``forward(tokens [B, S], document_ids=None, cache=None) -> logits [B, S, vocab]``, as Qwen3's."""

    def __init__(self, args: Qwen3MoEArgs):
        super().__init__(args)
        cfg = args.moe_config()
        for i, block in self.layers.items():
            if args.is_moe_layer(int(i)):
                block.feed_forward = MoE(args.dim, cfg, shared_cls=FeedForward)
