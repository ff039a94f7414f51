"""Which parameters Muon updates and which AdamW does.

Muon orthogonalizes the update of a hidden weight matrix, so it takes the attention and MLP projections and the
routed experts (a batch of matrices, one per expert), as nanochat and Moonshot do. AdamW keeps what is not a hidden
matrix: the token embedding (a lookup table, not a linear map), the output layer (its rows are per-token scores),
a MoE layer's router (its rows are per-expert scores; orthogonalization would raise its small gradient's weak
directions to full size, where summation-order noise between layouts lives), norms and biases.
``muon_params`` / ``adamw_params`` (fnmatch patterns on the parameter names, wrappers' name parts removed) move
parameters from one side to the other; ``adamw_params`` wins where both match. Only matrices and stacks of matrices
can go to Muon.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch
from torch import nn

from titanlite.errors import ConfigError

OUTPUT_NAMES = ("output.weight", "lm_head.weight")  # the output layer of titanlite's families and HF's
ROUTER_PATTERN = "*.router.*"  # a MoE layer's gate: per-expert scores, like the output layer's per-token ones
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def clean_name(name: str) -> str:
    """A parameter's name without the name parts activation checkpointing, compile and FSDP wrappers add."""
    for part in _WRAPPERS:
        name = name.replace(part, "")
    return name


def default_is_muon(name: str, p: torch.Tensor, embeddings: set[int]) -> bool:
    """The default split: a matrix or a stack of them, not an embedding, the output layer or a MoE router."""
    hidden = name not in OUTPUT_NAMES and not fnmatchcase(name, ROUTER_PATTERN)
    return p.ndim in (2, 3) and id(p) not in embeddings and hidden


def split_params(
    model: nn.Module, muon_patterns: list[str] = (), adamw_patterns: list[str] = ()
) -> tuple[list[tuple[str, nn.Parameter]], list[nn.Parameter]]:
    """``(muon, adamw)``: the named Muon parameters and the AdamW parameters of ``model`` (trainable, each
    shared tensor once, in the model's order)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    muon, adamw = [], []
    for raw, p in model.named_parameters():
        if not p.requires_grad:
            continue
        name = clean_name(raw)
        to_muon = default_is_muon(name, p, embeddings) or any(fnmatchcase(name, pat) for pat in muon_patterns)
        if any(fnmatchcase(name, pat) for pat in adamw_patterns):
            to_muon = False
        if to_muon and p.ndim not in (2, 3):
            raise ConfigError(f"optimizer.muon_params matches {name} of shape {tuple(p.shape)}: Muon takes matrices")
        (muon.append((name, p)) if to_muon else adamw.append(p))
    return muon, adamw
