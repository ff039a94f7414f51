"""docs/library.md's Python examples, picked out by what each contains: tests/test_library_examples.py runs
them, tests/test_docs.py checks that every library block of the docs is one of them."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BLOCKS = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "library.md").read_text(), flags=re.S)
LOOP = next(b for b in BLOCKS if "step = TrainStep(" in b)
CKPT = next(b for b in BLOCKS if "class TokenCounter" in b)
FAMILY = next(b for b in BLOCKS if 'name="gpt2"' in b)
LOSS = next(b for b in BLOCKS if 'register("loss", "z_loss"' in b)
BUILD = next(b for b in BLOCKS if "parts = build_training(" in b)
SPEC = next(b for b in BLOCKS if 'ModelSpec(name="tiny"' in b)
