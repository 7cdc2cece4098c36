"""Shared fixtures for the runtime tier (the comparison against `pn.reference_train`,
`same`, and the clusters of 2 and 4 workers are fixtures of tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every runtime test runs its reference on one thread (see tests/conftest.py)."""
    yield
