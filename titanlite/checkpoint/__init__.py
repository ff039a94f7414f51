"""Checkpoints: DCP saves with exact resume and resharding, atomic publication, HF conversion.

- :class:`CheckpointManager` (``manager``): save / resume of any Stateful objects (``[checkpoint]``),
  and :class:`CheckpointHook`, its place in the training loop.
- ``layout``: folder naming, atomic publication, completeness and damage checks.
- ``state``: the RNG state saved with every checkpoint.
- ``hf``: streaming conversion between DCP step folders and Hugging Face folders (the model
  family's ``hf_adapter`` maps names and layouts); ``convert_cli`` holds the command lines of
  ``titanlite convert``.
"""

from titanlite.checkpoint.manager import CheckpointHook, CheckpointManager, CheckpointWriteError, LoadPlan, SaveStats

__all__ = ["CheckpointHook", "CheckpointManager", "CheckpointWriteError", "LoadPlan", "SaveStats"]
