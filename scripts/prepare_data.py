"""The old command: `titanlite prepare` (titanlite must be installed, as scripts/setup_env.sh does)."""

from titanlite.data.prepare import main

raise SystemExit(main())
