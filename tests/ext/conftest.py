"""Fixtures of the extension tests."""

import pytest

from tests.helpers.peaks import skip_peak_measurement


@pytest.fixture
def no_peak_probe(monkeypatch):
    """MFU is not under test: skip the trainer's CPU matmul-peak probe during the test."""
    skip_peak_measurement(monkeypatch)
