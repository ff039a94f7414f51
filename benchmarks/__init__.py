"""Development-only benchmarks: they need this git checkout (another revision of titanlite, extracted side by
side), so they live outside the installed package. ``titanlite bench`` measures what a user measures on their
own hardware; docs/benchmarks.md says which figures come from here."""
