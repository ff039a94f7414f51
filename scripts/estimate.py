"""The old command: `titanlite estimate` (titanlite must be installed, as scripts/setup_env.sh does)."""

from titanlite.tools.estimate import main

raise SystemExit(main())
