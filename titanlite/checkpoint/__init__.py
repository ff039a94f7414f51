"""Checkpoints: DCP saves with exact resume and resharding, atomic publication, HF conversion.

- :class:`CheckpointManager` (``manager``): save / resume for the trainer (``[checkpoint]``).
- ``layout``: folder naming, atomic publication, completeness and damage checks.
- ``staging``: CPU copies for asynchronous saves.
- ``state``: train-state and RNG helpers.
- ``metrics_log``: rewinding ``metrics.jsonl`` to the resumed step.
- ``hf``: bounded-memory conversion between DCP step folders and Hugging Face folders (the model
  family's ``hf_adapter`` maps names and layouts); ``convert_cli``: ``scripts/convert_*.py``.
"""

from titanlite.checkpoint.manager import CheckpointManager, LoadPlan, SaveStats
from titanlite.checkpoint.state import AttrState

__all__ = ["AttrState", "CheckpointManager", "LoadPlan", "SaveStats"]
