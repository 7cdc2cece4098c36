"""Shared fixtures for the runtime tier: the comparison against `pn.reference_train` (the
clusters of 2 and 4 workers are session fixtures of tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

RTOL, ATOL = 1e-5, 4e-5


def assert_same(result, ref, model=None) -> None:
    """Losses and every parameter equal to the reference's (fp32 rounding), nothing leaked."""
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses),
                               rtol=RTOL, atol=ATOL)
    got, want = result.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert result.leftover == []
    if model is not None:  # training really moved the parameters
        init = model.state_dict()
        assert any(not torch.equal(init[k], got[k]) for k in init)


@pytest.fixture
def same():
    """`same(result, ref, model=None)`: see `assert_same`."""
    return assert_same


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every runtime test runs its reference on one thread (see tests/conftest.py)."""
    yield
