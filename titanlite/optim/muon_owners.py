"""Which rank orthogonalizes which matrix: a pure function of the matrices' costs, so every rank computes the same
assignment without communicating.

Matrices go out largest first, each to the rank with the least work so far (the lowest such rank on a tie): a
round-robin over the ranks that follows the load instead of the turn. Largest-first greedy keeps the largest rank
within 4/3 of the optimum; on a transformer's few distinct shapes it is close to the mean
(tests/optim/test_muon.py checks the Llama 1B shape on 8 ranks).
"""

from __future__ import annotations


def assign_owners(costs: list[float], n_ranks: int) -> list[int]:
    """The owning rank (0..n_ranks-1) of each matrix, given each matrix's cost (e.g. its Newton-Schulz FLOPs)."""
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    load = [0.0] * n_ranks
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(n_ranks), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += costs[i]
    return owners


def rank_loads(costs: list[float], owners: list[int], n_ranks: int) -> list[float]:
    """Each rank's total cost under ``owners``."""
    load = [0.0] * n_ranks
    for cost, rank in zip(costs, owners):
        load[rank] += cost
    return load
