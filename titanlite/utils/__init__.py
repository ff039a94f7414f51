"""Leaf utilities: atomic file writes, the JSON/TOML depth guard, dtype names, the run lock and
the private torch APIs titanlite uses (each imports nothing from titanlite above ``utils``)."""
