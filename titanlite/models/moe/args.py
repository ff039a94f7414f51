"""Hyper-parameters of the mixture-of-experts feed-forward layer.

A family's model args inherit :class:`MoEArgs`, whose flat ``moe_*`` fields are ``[model]`` keys and options like
any other model arg; :meth:`MoEArgs.moe_config` gathers them into the layer's :class:`MoEConfig`. Fields that say
how a run trains rather than what the weights mean (balancing coefficients, the grouped GEMM switch) are in
:data:`MOE_RUN_ARGS`, which a family adds to its ``ModelSpec.run_args``: a seed checkpoint never imposes them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from titanlite.errors import ConfigError

SCORE_FUNCS = ("softmax", "sigmoid")
AUX_LOSS_LEVELS = ("batch", "seq")
MOE_RUN_ARGS = ("moe_aux_loss_coef", "moe_aux_loss_level", "moe_z_loss_coef", "moe_bias_update_rate", "moe_grouped_mm")


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer: ``num_experts`` routed SwiGLU experts of hidden size ``hidden_dim``, ``top_k`` per token,
    plus ``num_shared_experts`` always-active ones (one SwiGLU of ``num_shared_experts x hidden_dim``).

    Routing: scores are ``softmax`` or ``sigmoid`` of the router logits; the top-k are chosen on the scores
    plus the aux-loss-free bias (DeepSeek-V3), optionally only among the ``topk_groups`` best of ``n_groups``
    expert groups (node-limited routing; a group's score is the sum of its two best scores); the weights are
    the chosen scores, renormalized to sum to 1 when ``norm_topk_prob``, times ``route_scale``.

    Balancing (:mod:`titanlite.models.moe.balance`): ``aux_loss_coef`` (the Switch/GShard loss per ``aux_loss_level``,
    ``"seq"`` or ``"batch"``), ``z_loss_coef`` (the router z-loss), ``bias_update_rate`` (the aux-loss-free bias
    step after each optimizer step; 0: off)."""

    num_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 256
    num_shared_experts: int = 0
    score_func: str = "softmax"
    norm_topk_prob: bool = False
    route_scale: float = 1.0
    n_groups: int = 1
    topk_groups: int = 1
    aux_loss_coef: float = 0.0
    aux_loss_level: str = "batch"
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0
    grouped_mm: bool = True

    def __post_init__(self) -> None:
        key = "model.moe_"
        for name in ("num_experts", "top_k", "hidden_dim", "n_groups", "topk_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{key}{name} must be a positive integer, got {value!r}")
        if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
            raise ConfigError(f"{key}num_shared_experts must be >= 0, got {self.num_shared_experts!r}")
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"{key}top_k ({self.top_k}) must be <= {key}num_experts ({self.num_experts}): "
                "a token cannot go to more experts than there are"
            )
        if self.score_func not in SCORE_FUNCS:
            raise ConfigError(f"{key}score_func must be one of {', '.join(SCORE_FUNCS)}, got {self.score_func!r}")
        if self.aux_loss_level not in AUX_LOSS_LEVELS:
            raise ConfigError(
                f"{key}aux_loss_level must be one of {', '.join(AUX_LOSS_LEVELS)}, got {self.aux_loss_level!r}"
            )
        if self.num_experts % self.n_groups:
            raise ConfigError(f"{key}n_groups ({self.n_groups}) must divide {key}num_experts ({self.num_experts})")
        if self.topk_groups > self.n_groups:
            raise ConfigError(f"{key}topk_groups ({self.topk_groups}) must be <= {key}n_groups ({self.n_groups})")
        if self.topk_groups * (self.num_experts // self.n_groups) < self.top_k:
            raise ConfigError(
                f"{key}topk_groups ({self.topk_groups}) groups of {self.num_experts // self.n_groups} experts hold "
                f"fewer than {key}top_k ({self.top_k}) experts"
            )
        for name in ("route_scale", "aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{key}{name} must be a finite number >= 0, got {value!r}")
        if self.route_scale == 0:
            raise ConfigError(f"{key}route_scale must be > 0")

    @property
    def shared_hidden_dim(self) -> int:
        return self.num_shared_experts * self.hidden_dim


@dataclass
class MoEArgs:
    """The ``moe_*`` model args (see :class:`MoEConfig` for their meaning); a family's args dataclass
    inherits them and calls :meth:`moe_config` (which checks them) from its own validation."""

    moe_num_experts: int = 8
    moe_top_k: int = 2
    moe_hidden_dim: int = 256  # each routed expert's SwiGLU hidden size (HF moe_intermediate_size)
    moe_num_shared_experts: int = 0
    moe_score_func: str = "softmax"
    moe_norm_topk_prob: bool = False
    moe_route_scale: float = 1.0
    moe_n_groups: int = 1
    moe_topk_groups: int = 1
    moe_aux_loss_coef: float = 0.0
    moe_aux_loss_level: str = "batch"
    moe_z_loss_coef: float = 0.0
    moe_bias_update_rate: float = 0.0
    moe_grouped_mm: bool = True

    def moe_config(self) -> MoEConfig:
        return MoEConfig(**{f.name: getattr(self, "moe_" + f.name) for f in dataclasses.fields(MoEConfig)})

    def is_moe_layer(self, layer_id: int) -> bool:  # pragma: no cover - each family says which blocks are sparse
        raise NotImplementedError

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))
