"""Checkpoints: DCP saves with exact resume and resharding, atomic publication, HF conversion (docs/checkpoints.md).
:class:`CheckpointManager` saves and loads; ``resume`` decides what a run loads; ``layout`` names, publishes and
checks folders; ``hf_export`` / ``hf_import`` / ``convert_cli``: ``titanlite convert``; ``seed_args``: a seed
checkpoint's model args.
"""

from titanlite.checkpoint.manager import CheckpointManager, CheckpointWriteError, SaveStats
from titanlite.checkpoint.resume import LoadPlan

__all__ = ["CheckpointManager", "CheckpointWriteError", "LoadPlan", "SaveStats"]
