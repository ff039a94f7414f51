#!/usr/bin/env python
"""Convert a Hugging Face model folder (Llama, or a family from an extension named with --extensions)
to a model-only titanlite DCP step folder (for --checkpoint.initial_load_path).

    python scripts/convert_hf_to_dcp.py <hf_dir> <dcp_out_dir> [--extensions torchtitan_ext.qwen3]

See :mod:`titanlite.checkpoint.hf`. Wrong inputs print one ``error: ...`` line and exit with status 2.
"""

import sys
from pathlib import Path

try:
    import titanlite  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlite.checkpoint.convert_cli import main_hf_to_dcp

if __name__ == "__main__":
    sys.exit(main_hf_to_dcp())
