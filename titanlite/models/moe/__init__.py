"""Mixture-of-experts building blocks for any decoder family (see each module's docstring):

- :mod:`~titanlite.models.moe.args`: the ``moe_*`` model args and the layer's :class:`MoEConfig`;
- :mod:`~titanlite.models.moe.layer`: the dropless :class:`MoE` feed-forward layer;
- :mod:`~titanlite.models.moe.router`, :mod:`~titanlite.models.moe.experts`: routing, stacked experts;
- :mod:`~titanlite.models.moe.balance`: aux losses and the aux-loss-free bias;
- :mod:`~titanlite.models.moe.step`: :class:`MoEStep`, the per-step loads, bias updates and metrics;
- :mod:`~titanlite.models.moe.expert_parallel`: token dispatch over the ``ep`` mesh;
- :mod:`~titanlite.models.moe.parallelize`: a decoder's plan with MoE blocks (EP, FSDP of the experts).
"""

from titanlite.models.moe.args import MOE_RUN_ARGS, MoEArgs, MoEConfig
from titanlite.models.moe.experts import GroupedExperts
from titanlite.models.moe.layer import MoE
from titanlite.models.moe.router import TopKRouter
from titanlite.models.moe.step import MoEStep

__all__ = ["MOE_RUN_ARGS", "GroupedExperts", "MoE", "MoEArgs", "MoEConfig", "MoEStep", "TopKRouter"]
