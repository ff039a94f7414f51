"""Tests whose MFU is not under test skip the trainer's CPU matmul-peak probe (seconds of CPU per Trainer)."""

from __future__ import annotations


def skip_peak_measurement(monkeypatch=None) -> None:
    """MFU is not under test: skip the trainer's ~5 s CPU matmul-peak probe (for good in a worker
    process, undone after the test with ``monkeypatch`` in the pytest process)."""
    import titanlite.trainer.metrics as metrics

    fake = lambda *args, **kwargs: 1e11  # noqa: E731
    if monkeypatch is None:
        metrics.peak_flops = fake
    else:
        monkeypatch.setattr(metrics, "peak_flops", fake)
