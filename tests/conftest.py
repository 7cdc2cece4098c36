"""Fixtures every tier shares: one local cluster of 2 and one of 4 workers per session
(spawning costs seconds; plans larger than 2 devices run on the 4), and `one_thread`."""

from __future__ import annotations

import pytest
import torch

from piper_nb.cluster.local import LocalCluster


@pytest.fixture(scope="session")
def cluster2():
    with LocalCluster(2) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def cluster4():
    with LocalCluster(4) as cluster:
        yield cluster


@pytest.fixture
def one_thread():
    """The driver's reference runs beside the workers on few cores: keep it to one thread."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
