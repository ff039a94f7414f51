#!/usr/bin/env python
"""Tokenize raw text into binary token shards (CLI of :mod:`titanlite.data.prepare`).

    python scripts/prepare_data.py --input PATH [PATH ...] --tokenizer tokenizer.model --output DIR \\
        [--val-fraction F] [--workers N] [--shard-tokens N] [--text-field NAME]
"""

import sys
from pathlib import Path

try:
    import titanlite  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlite.data.prepare import main

if __name__ == "__main__":
    sys.exit(main())
