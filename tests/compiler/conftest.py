"""Shared small models and specs for compiler tests."""

import pytest

import piper_nb as pn


@pytest.fixture(scope="session")
def mlp():
    model = pn.models.MLP(dim=8, depth=8)
    return model, model.example_batch(batch_size=16, seed=0)

