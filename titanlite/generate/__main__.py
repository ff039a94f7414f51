"""``python -m titanlite.generate``."""

from titanlite.generate import main

raise SystemExit(main())
