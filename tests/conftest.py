"""Session fixtures every tier shares: one local cluster of 2 and one of 4 workers
(spawning costs seconds; plans larger than 2 devices run on the 4)."""

from __future__ import annotations

import pytest

from piper_nb.cluster.local import LocalCluster


@pytest.fixture(scope="session")
def cluster2():
    with LocalCluster(2) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def cluster4():
    with LocalCluster(4) as cluster:
        yield cluster
