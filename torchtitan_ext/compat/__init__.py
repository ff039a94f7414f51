"""torchtitan interop: run torchtitan's classic (v0.2) TOML train configs and resume from torchtitan
DCP checkpoints of Llama 3 models, on titanlite.

    python -m torchtitan_ext.compat.train --config torchtitan.toml

- :mod:`torchtitan_ext.compat.config`: :func:`translate` (torchtitan TOML + overrides -> titanlite
  config), :class:`CompatError` for refused features;
- :mod:`torchtitan_ext.compat.checkpoint`: the torchtitan checkpoint layout and its loader;
- :mod:`torchtitan_ext.compat.format`: torchtitan's DCP names and the model args of its step folders (also what
  ``titanlite.checkpoint.hf_export.dcp_to_hf`` reads a torchtitan folder with);
- :mod:`torchtitan_ext.compat.train`: :class:`CompatTrainer` and the entry point.

What maps and what does not: ``torchtitan_ext/compat/README.md``.
"""

from torchtitan_ext.compat.config import CompatError, CompatSettings, Translation, load_translated, translate

__all__ = ["CompatError", "CompatSettings", "Translation", "load_translated", "translate"]
