"""The benchmarks (``titanlite bench <name>``, or ``python -m titanlite.bench.<module>``): each module measures one
thing side by side against its reference and prints its figures (see docs/benchmarks.md). Their measuring code
uses only titanlite's public modules, so the checkout's benchmarks/revision.py can also run it against an older
titanlite."""
