"""The old command: `titanlite plot` (titanlite must be installed, as scripts/setup_env.sh does)."""

from titanlite.tools.plot import main

raise SystemExit(main())
