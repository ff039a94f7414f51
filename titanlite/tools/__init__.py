"""Command-line tools beside training: ``titanlite estimate`` (plan a run) and ``titanlite plot`` (curves)."""
