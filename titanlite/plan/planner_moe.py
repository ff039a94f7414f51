"""The mixture-of-experts part of the run planner (pure functions; :mod:`titanlite.planner` uses them).

A MoE model is a Llama-style :class:`~titanlite.planner.ModelShape` with ``moe`` set: ``n_moe`` of its
blocks replace the dense SwiGLU (hidden ``ffn_hidden_dim``) by a router (``dim x E``), ``E`` routed
SwiGLU experts of hidden ``H`` of which ``k`` run per token, and shared experts (one SwiGLU of hidden
``S``) that always run. Hence, per MoE block:

- parameters: ``dim E + 3 dim H E + 3 dim S``; active per token ``dim E + 3 dim H k + 3 dim S``;
- FLOPs: PaLM's ``6 x`` the active matmul parameters (the router included) plus attention;
- activations per token (bytes, ``c`` compute dtype, ``l`` saved matmul inputs), instead of the dense
  ``3 c F + l F``: ``k (c dim + 3 c H + l H + c dim)`` (each routed copy of the token, its SwiGLU, the
  expert output) + ``c k dim`` (the outputs back in token order before the weighted sum) + ``3 c S + l S + l
  dim`` (shared experts) + ``16 E`` (fp32 logits, scores, biased scores and their top-k mask);
- memory layout: the experts are sharded over the data-parallel shard ranks only (expert parallelism is a
  factor of them), and run replicated over tensor-parallel ranks; FSDP gathers a block's experts over
  the ``dp_shard / ep`` ranks that hold the same ones, so a gathered block holds ``E / ep`` experts;
- communication (expert parallelism ``ep``): each MoE block sends ``k`` copies of every token's hidden
  state to the experts' ranks and receives the outputs back, in forward and again (their gradients) in
  backward: ``4 k tokens dim c (ep - 1) / ep`` bytes per GPU per micro-batch and MoE block (a share
  ``1/ep`` stays on the rank when the load is uniform), plus 2 more exchanges when full activation
  checkpointing recomputes the forward.
"""

from __future__ import annotations

import dataclasses
from typing import Any


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
        """Bytes per token a MoE block keeps beyond a SwiGLU of width :meth:`active_hidden` (module docstring)."""
        return self.top_k * 2 * c * dim + c * self.top_k * dim + lin * dim + 16 * self.num_experts


GPUS_PER_NODE = 8
NVLINK_BYTES_PER_S = 450e9  # H100 SXM NVLink 4, one direction per GPU
INFINIBAND_BYTES_PER_S = 50e9  # one 400 Gb/s NDR link per GPU


def all_to_all_seconds(volume: float, ep: int) -> tuple[float, str]:
    """``(seconds, link)``: the time to send ``volume`` bytes from one GPU over the link its expert group's
    all-to-all is limited by: NVLink when the group fits in a node (``ep <= 8``), InfiniBand otherwise (a floor:
    no overlap with compute assumed, no latency, full link bandwidth)."""
    if ep <= GPUS_PER_NODE:
        return volume / NVLINK_BYTES_PER_S, "NVLink 450 GB/s"
    return volume / INFINIBAND_BYTES_PER_S, "InfiniBand 50 GB/s"


def all_to_all_bytes(
    moe: MoEShape, dim: int, tokens: float, ep: int, n_moe_blocks: float, c: int, recompute: bool = False
) -> float:
    """Bytes one GPU sends by all-to-all for ``tokens`` tokens through ``n_moe_blocks`` MoE blocks (its
    pipeline stage's) under expert parallelism ``ep`` (module docstring); 0 without EP."""
    if ep <= 1:
        return 0.0
    exchanges = 6 if recompute else 4
    return exchanges * moe.top_k * tokens * dim * c * (ep - 1) / ep * n_moe_blocks
