"""Parameter counts and training FLOPs per token of a Llama-style decoder from its sizes (:class:`ModelShape`,
with :class:`MoEShape` for mixture-of-experts blocks): a family's ``ModelSpec`` counts through :func:`params_of`,
:func:`active_params_of` and :func:`flops_of`; the run planner builds on them."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn


@dataclasses.dataclass(frozen=True)
class MoEShape:
    n_moe: int  # MoE blocks (the others are dense)
    num_experts: int
    top_k: int
    hidden_dim: int  # each routed expert's SwiGLU hidden size
    shared_hidden_dim: int = 0  # the shared experts' SwiGLU hidden size (0: none)

    @classmethod
    def from_args(cls, args: Any) -> MoEShape | None:
        """From model args with ``moe_config()`` and ``n_moe_layers`` (titanlite's MoE families), else None."""
        if not hasattr(args, "moe_config"):
            return None
        c = args.moe_config()
        return cls(args.n_moe_layers, c.num_experts, c.top_k, c.hidden_dim, c.num_shared_experts * c.hidden_dim)

    def expert_params(self, dim: int) -> int:
        """The routed experts' parameters of one MoE block."""
        return 3 * dim * self.hidden_dim * self.num_experts

    def block_ffn_params(self, dim: int) -> tuple[int, int]:
        """``(all, active per token)`` parameters of one MoE block's feed-forward (router, experts, shared)."""
        shared = 3 * dim * self.shared_hidden_dim + dim * self.num_experts
        return self.expert_params(dim) + shared, 3 * dim * self.hidden_dim * self.top_k + shared

    def active_hidden(self) -> int:
        """The SwiGLU width a token goes through in a MoE block (routed k x H plus shared)."""
        return self.top_k * self.hidden_dim + self.shared_hidden_dim

    def extra_activation_bytes(self, dim: int, c: int, lin: int) -> int:
        """Bytes per token a MoE block keeps beyond a SwiGLU of width :meth:`active_hidden` (docs/memory_model.md)."""
        return self.top_k * 2 * c * dim + c * self.top_k * dim + lin * dim + 16 * self.num_experts


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The sizes that determine parameters, FLOPs and activations (Llama-style decoder; names as in the
    Llama 3 model args). Families with their own ``head_dim`` and query/key RMSNorm weights (``qk_norm``,
    Qwen3) are counted exactly too. ``num_params``: the family's exact count when its blocks are not Llama
    blocks (0: the formula of :func:`param_count`)."""

    dim: int
    n_layers: int
    n_heads: int
    kv_heads: int
    ffn_hidden_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    head_dim: int = 0  # 0: dim // n_heads, filled in by __post_init__
    qk_norm: bool = False
    num_params: int = 0
    moe: MoEShape | None = None  # mixture-of-experts blocks (MoEShape)

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)

    @classmethod
    def from_args(cls, args: Any, num_params: int = 0) -> ModelShape:
        kv = getattr(args, "kv_heads", None) or getattr(args, "n_kv_heads", None) or args.n_heads
        sizes = (args.dim, args.n_layers, args.n_heads, kv, args.ffn_hidden_dim, args.vocab_size)
        head_dim, qk_norm = (getattr(args, k, None) for k in ("head_dim", "qk_norm"))  # a family's own fields
        tied = args.tie_word_embeddings
        return cls(*sizes, bool(tied), int(head_dim or 0), bool(qk_norm), num_params, MoEShape.from_args(args))

    @property
    def q_dim(self) -> int:
        """Width of the concatenated query heads (``wq`` output, ``wo`` input); ``dim`` for Llama."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def moe_fraction(self) -> float:
        """Share of the blocks that are MoE blocks (0 for a dense model)."""
        return 0.0 if self.moe is None else self.moe.n_moe / self.n_layers

    @property
    def active_ffn_hidden(self) -> float:
        """The SwiGLU width a token goes through, averaged over the blocks (``ffn_hidden_dim`` when dense)."""
        f = self.moe_fraction
        return self.ffn_hidden_dim * (1 - f) + (self.moe.active_hidden() * f if self.moe else 0)

    def moe_extra_params(self, active: bool = False) -> int:
        """All MoE blocks' feed-forward parameters (``active``: per token) minus the dense SwiGLUs they replace."""
        if self.moe is None:
            return 0
        return self.moe.n_moe * (self.moe.block_ffn_params(self.dim)[active] - 3 * self.dim * self.ffn_hidden_dim)


def block_matmul_params(s: ModelShape) -> float:
    """The linear weights of one block: wq, wo; wk, wv; w1, w2, w3 (MoE: the average block's)."""
    dense = 2 * s.dim * s.q_dim + 2 * s.dim * s.kv_dim + 3 * s.dim * s.ffn_hidden_dim
    return dense + s.moe_extra_params() / s.n_layers if s.moe else dense


def block_params(s: ModelShape) -> int:
    """Parameters of one block: its linears, two RMSNorm weights and, with ``qk_norm``, the query/key ones."""
    return block_matmul_params(s) + 2 * s.dim + (2 * s.head_dim if s.qk_norm else 0)


def param_count(s: ModelShape) -> int:
    """All parameters, a tied embedding/output counted once."""
    if s.num_params:
        return s.num_params
    embed = s.vocab_size * s.dim
    output = 0 if s.tie_word_embeddings else embed
    return round(embed + s.n_layers * block_params(s) + s.dim + output)


def active_param_count(s: ModelShape) -> int:
    """Parameters a token uses: all of them but the routed experts it does not go to (MoE)."""
    return param_count(s) - (s.moe_extra_params() - s.moe_extra_params(active=True))


def palm_flops_per_token(matmul_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> int:
    """Training FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B): a forward+backward pass
    costs 6 FLOPs per parameter that takes part in a matmul, plus 12 x n_layers x n_heads x head_dim
    x seq_len for the attention scores and weighted sum (2 matmuls of 2 FLOPs, x3 for backward)."""
    return 6 * matmul_params + 12 * n_layers * n_heads * head_dim * seq_len


def flops_per_token(s: ModelShape, seq_len: int) -> int:
    """:func:`palm_flops_per_token` of the shape: every parameter a token uses but the input embedding table
    is a matmul parameter (a tied table is the output projection, so it counts; MoE: the active ones)."""
    embed = 0 if s.tie_word_embeddings else s.vocab_size * s.dim
    return palm_flops_per_token(active_param_count(s) - embed, s.n_layers, s.n_heads, s.head_dim, seq_len)


def params_of(args: Any) -> int:
    """Exact parameters of a Llama-style family's model args (a ``ModelSpec.num_params``)."""
    return param_count(ModelShape.from_args(args))


def active_params_of(args: Any) -> int:
    """Parameters per token of a Llama-style family's model args (a ``ModelSpec.active_params``; MoE-aware)."""
    return active_param_count(ModelShape.from_args(args))


def flops_of(args: Any, seq_len: int) -> int:
    """Training FLOPs per token of a Llama-style family's model args (a ``ModelSpec.flops_per_token``)."""
    return flops_per_token(ModelShape.from_args(args), seq_len)


def num_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Number of parameters, tied (shared) tensors counted once (``parameters()`` de-duplicates
    them); optionally without the input embedding table (when tied, the shared table is excluded)."""
    total = sum(p.numel() for p in model.parameters())
    emb = getattr(model, "tok_embeddings", None) if exclude_embedding else None
    return total - (emb.weight.numel() if emb is not None else 0)
