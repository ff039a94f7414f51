"""``python -m titanlite.eval``: see :mod:`titanlite.eval.cli`."""

import sys

from titanlite.eval.cli import main

sys.exit(main())
