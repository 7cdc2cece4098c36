"""Fixtures shared by the Designer tests: the TinyGPT both the state and the widget design."""

from __future__ import annotations

import pytest

import piper_nb as pn


@pytest.fixture(scope="module")
def gpt():
    model = pn.models.TinyGPT(layers=4)
    return model, model.example_batch(batch_size=8, seed=0)
