"""Pipeline schedules by their torchtitan names and their unit-model arithmetic (pure functions): a rank's idle
share, the stages it runs, the microbatches it keeps in flight. Used by :mod:`titanlite.parallel.pipeline` and the
run planner."""

from __future__ import annotations

from titanlite.errors import ConfigError

# torch.distributed.pipelining schedules by their torchtitan names (as [parallelism] pipeline_parallel_schedule)
PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # rank r holds stages r and 2p - 1 - r
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def check_pipeline(schedule: str, local_batch_size: int, microbatch_size: int, stage_sizes: tuple[int, ...]) -> None:
    """The planner's own checks of a pipeline setup (the trainer's full ones are ``PipelinePlan.check``)."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(f"pipeline schedule {schedule!r} must be one of {', '.join(PIPELINE_SCHEDULES)}")
    if microbatch_size < 1 or local_batch_size % microbatch_size:
        raise ConfigError(
            f"local_batch_size ({local_batch_size}) must be a multiple of the pipeline microbatch size "
            f"({microbatch_size})"
        )
    if any(n < 1 for n in stage_sizes):
        raise ConfigError(f"every pipeline stage needs at least one block, got {list(stage_sizes)}")


def pipeline_bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle share of each pipeline rank's time in one schedule run, for ``p`` ranks, ``m`` microbatches and
    ``v`` stages per rank, in the usual unit model (every stage equally fast, a backward twice its forward, no
    communication time):

    - GPipe and 1F1B: ``(p - 1) / (m + p - 1)`` (Huang et al. 2019; Narayanan et al. 2021): the first
      microbatch needs ``p - 1`` stage times to reach the last rank, and the last one as many to come back;
    - Interleaved1F1B: ``(p - 1) / (v m + p - 1)`` (Narayanan et al. 2021): the ramp is ``p - 1`` *virtual*
      stage times, each ``1/v`` of a rank's share. With fewer microbatches than ranks a round cannot fill
      the pipeline and it is ``1 - v m / (v p + m - 1)``; both are ``1 - v m / max(v m + p - 1, v p + m - 1)``;
    - the zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV), whose backward is split
      into an input-gradient and a weight-gradient half (each as long as the forward): the weight halves fill
      the backward ramp, leaving ``(p - 1) / (3 v m + p - 1)``. Exact for ``m >= p`` (InterleavedZeroBubble)
      and ``m >= 2p`` (ZBV, DualPipeV); with fewer microbatches the schedules idle more than this.
    """
    if schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(f"pipeline schedule {schedule!r} must be one of {', '.join(PIPELINE_SCHEDULES)}")
    if p <= 1:
        return 0.0
    if schedule in ZERO_BUBBLE_SCHEDULES:
        return (p - 1) / (3 * v * m + p - 1)
    return 1 - v * m / max(v * m + p - 1, v * p + m - 1)


def split_evenly(n_layers: int, num_stages: int) -> list[int]:
    """Blocks per stage, as even as possible; the extra blocks go to the middle stages first (the first
    stage holds the most activations in flight under 1F1B, the last one computes the output and loss)."""
    base, extra = divmod(n_layers, num_stages)
    order = [*range(1, num_stages - 1), num_stages - 1, 0] if num_stages > 1 else [0]
    sizes = [base] * num_stages
    for s in order[:extra]:
        sizes[s] += 1
    return sizes


def pipeline_rank_stages(schedule: str, p: int, num_stages: int, rank: int) -> list[int]:
    """The stages pp rank ``rank`` runs: a loop (``rank, rank + p, ...``), or a V for ZBV and DualPipeV."""
    return [rank, 2 * p - 1 - rank] if schedule in V_SCHEDULES else list(range(rank, num_stages, p))


def microbatches_in_flight(schedule: str, p: int, m: int, v: int, rank: int) -> int:
    """The most (microbatch, local stage) forwards whose activations pp rank ``rank`` holds at once, i.e.
    forwards minus (input-)backwards, maximized over torch.distributed.pipelining's order for the schedule
    (torch 2.13; tests/plan/test_planner.py checks each against the order torch builds):

    - GPipe: ``m`` (every forward runs before the first backward);
    - 1F1B: ``min(m, p - rank)`` (warm-up forwards, then one backward before each forward);
    - Interleaved1F1B: ``min(W + 1, v m)`` with ``W = min((v - 1) k + 2 (p - 1 - rank), v m)`` warm-up
      forwards, ``k = m / max(1, m // p)`` microbatches per round (one more forward runs before the first
      backward): about ``(1 + 1/v)`` times the 1F1B stage's activations on the first rank;
    - InterleavedZeroBubble: the same with ``W = (v - 1) k + (p - 1 - rank)`` (its warm-up grows by one per hop);
    - ZBVZeroBubble: ``min(2p, m + rank + 1, 2m)``; DualPipeV: ``2p + 1`` (it needs ``m >= 2p``).

    For the zero-bubble schedules a backward counts when its input-gradient half runs: the weight-gradient
    half, run later, still needs the saved matmul inputs, so their peak is somewhat higher (not modelled).
    """
    if p <= 1 or schedule == "GPipe":
        return m * v
    if schedule == "1F1B":
        return min(m, p - rank)
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        per_round = m // max(1, m // p)
        hops = (2 if schedule == "Interleaved1F1B" else 1) * (p - 1 - rank)
        warmup = min((v - 1) * per_round + hops, v * m)
        return min(warmup + 1, v * m)
    if schedule == "ZBVZeroBubble":
        return min(2 * p, m + rank + 1, 2 * m)
    if schedule == "DualPipeV":
        return min(2 * p + 1, 2 * m)
    raise ConfigError(f"pipeline schedule {schedule!r} must be one of {', '.join(PIPELINE_SCHEDULES)}")
