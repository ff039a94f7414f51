"""``python -m titanlite``: the ``titanlite`` command (:mod:`titanlite.cli`)."""

from titanlite.cli import main

raise SystemExit(main())
