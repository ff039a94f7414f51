"""What several test files share: the multi-process harness, the tiny models and runs, the shared data.

Test modules import from here (or get fixtures from a conftest.py), never from one another:
tests/test_test_layout.py checks it.
"""
