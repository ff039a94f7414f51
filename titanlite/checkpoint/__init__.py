"""Checkpoints: DCP saves with exact resume and resharding, atomic publication, HF conversion.

- :class:`CheckpointManager` (``manager``): save / load of any Stateful objects (``[checkpoint]``; its place in the
  training loop is :class:`titanlite.trainer.checkpoint_hook.CheckpointHook`); ``resume``: what a run loads
  (fallbacks, set-aside).
- ``layout``: folder naming, atomic publication, completeness and damage checks.
- ``state``: the RNG state saved with every checkpoint.
- ``hf_export``: :func:`dcp_to_hf`; ``hf_import``: :func:`hf_to_dcp` and the HF initial load; the
  family's ``hf_adapter`` mapping names and layouts; ``seed_args``: a seed checkpoint's model args;
  ``convert_cli``: the command lines of ``titanlite convert``.
"""

from titanlite.checkpoint.manager import CheckpointManager, CheckpointWriteError, SaveStats
from titanlite.checkpoint.resume import LoadPlan

__all__ = ["CheckpointManager", "CheckpointWriteError", "LoadPlan", "SaveStats"]
