"""``python -m titanlite.generate``."""

from titanlite.generate.cli import main

raise SystemExit(main())
