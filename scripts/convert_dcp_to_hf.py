#!/usr/bin/env python
"""Convert a titanlite DCP checkpoint step folder to a Hugging Face folder (LlamaForCausalLM, or
the model of a family from an extension named with --extensions).

    python scripts/convert_dcp_to_hf.py <dcp_step_dir> <hf_out_dir> [--dtype bfloat16|float32] [--max-shard-size 5GB]
        [--extensions MODULES]

See :mod:`titanlite.checkpoint.hf`. Wrong inputs print one ``error: ...`` line and exit with status 2.
"""

import sys
from pathlib import Path

try:
    import titanlite  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlite.checkpoint.convert_cli import main_dcp_to_hf

if __name__ == "__main__":
    sys.exit(main_dcp_to_hf())
