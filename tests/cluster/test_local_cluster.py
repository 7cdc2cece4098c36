"""`pn.LocalCluster`: failures surface fast and by name, and the cluster recovers.

Failures are injected with the documented test hook `PIPER_NB_FAIL_AT="<device>:<instr>"`
(append `:exit` to make the worker process die instead of raising), which the driver
forwards with every step.
"""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch

import piper_nb as pn
from piper_nb import host, optim
from piper_nb.cluster.local import LocalCluster
from piper_nb.errors import RuntimeFailure, WorkerLost
from piper_nb.host import core_plan
from piper_nb.train import reference_train, train

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(2) as c:
        yield c


@pytest.fixture(scope="module")
def setup():
    model = pn.models.MLP(dim=16, depth=4)
    batch = model.example_batch(batch_size=8, seed=0)
    spec = pn.annotate(model, pn.cut_stages(model, 2))
    plan = pn.compile(spec, [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
                             *pn.schedules.one_f_one_b(ranks=2, microbatches=4)], batch)
    return model, batch, plan


def test_region_failure_names_device_and_instruction(cluster, setup, monkeypatch):
    model, batch, plan = setup
    monkeypatch.setenv("PIPER_NB_FAIL_AT", "1:r1:B2")
    t0 = time.monotonic()
    with pytest.raises(RuntimeFailure) as info:
        train(plan, batch, 2, optim.SGD(0.1), cluster=cluster)
    assert time.monotonic() - t0 < 20
    err = info.value
    assert not isinstance(err, WorkerLost)
    assert err.device == 1 and err.instruction == "r1:B2"
    assert "injected failure" in err.original and "r1:B2" in str(err) and "device 1" in str(err)
    # the group was stopped; the next call restarts it and trains correctly
    monkeypatch.delenv("PIPER_NB_FAIL_AT")
    starts = cluster.starts
    result = train(plan, batch, 2, optim.SGD(0.1), cluster=cluster)
    ref = reference_train(model, batch, 2, 4, optim.SGD(0.1))
    assert cluster.starts == starts + 1 and cluster.running
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses))


def test_failure_in_a_wait_while_the_peer_blocks(cluster, setup, monkeypatch):
    _, batch, plan = setup
    monkeypatch.setenv("PIPER_NB_FAIL_AT", "0:wait(r0:RECV_B1<1)")
    t0 = time.monotonic()
    with pytest.raises(RuntimeFailure) as info:
        train(plan, batch, 1, optim.SGD(0.1), cluster=cluster)
    assert time.monotonic() - t0 < 20
    assert info.value.device == 0 and info.value.instruction == "wait(r0:RECV_B1<1)"


def test_dead_worker_is_worker_lost(cluster, setup, monkeypatch):
    _, batch, plan = setup
    monkeypatch.setenv("PIPER_NB_FAIL_AT", "0:r0:F2:exit")
    t0 = time.monotonic()
    with pytest.raises(WorkerLost) as info:
        train(plan, batch, 1, optim.SGD(0.1), cluster=cluster)
    assert time.monotonic() - t0 < 20
    assert info.value.device == 0 and "died" in str(info.value)
    assert not cluster.running


def test_default_cluster_is_closed_and_model_untouched(setup):
    model, batch, plan = setup
    before = copy.deepcopy(model.state_dict())
    result = train(plan, batch, 1, optim.SGD(0.5))
    assert len(result.losses) == 1 and len(result.step_times) == 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not torch.equal(result.state_dict()["layers.0.0.weight"], before["layers.0.0.weight"])


def test_plan_larger_than_cluster(setup):
    _, batch, plan = setup
    small = LocalCluster(1)
    with pytest.raises(pn.PlanError, match="needs 2 devices"):
        train(plan, batch, 1, optim.SGD(0.1), cluster=small)
    assert not small.running


def test_bad_arguments():
    with pytest.raises(ValueError, match="positive number"):
        LocalCluster(0)
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        LocalCluster(2, device="tpu")


def test_core_plan_gives_each_worker_its_own_core_when_there_are_enough(monkeypatch):
    monkeypatch.setattr(host, "usable_cores", lambda: [2, 5])
    assert core_plan(2) == [(2,), (5,)]
    assert core_plan(1) == [(2,)]
    assert core_plan(3) == [None] * 3             # more workers than cores: the OS places
    assert core_plan(3, pin=True) == [(2,), (5,), (2,)]
    assert core_plan(2, pin=False) == [None, None]
    assert core_plan(2, device="cuda") == [None, None]
    assert core_plan(1, busy={2: 1}) == [(5,)]          # another cluster holds core 2
    assert core_plan(3, pin=True, busy={2: 1}) == [(5,), (2,), (5,)]


@pytest.mark.skipif(len(host.usable_cores()) < 2, reason="needs 2 cores")
def test_workers_and_all_their_threads_are_pinned_one_core_each():
    with LocalCluster(2) as c:
        infos = c.info
        threads = {r: os.listdir(f"/proc/{i['pid']}/task") for r, i in enumerate(infos)}
        affinity = {r: [os.sched_getaffinity(int(t)) for t in threads[r]] for r in threads}
    cores = [info["cores"] for info in infos]
    assert all(len(c) == 1 for c in cores) and cores[0] != cores[1]
    for rank in range(2):
        assert len(threads[rank]) > 1    # gloo's threads, started after pinning, included
        assert all(a == set(cores[rank]) for a in affinity[rank])


@pytest.mark.skipif(len(host.usable_cores()) < 2, reason="needs 2 cores")
def test_two_clusters_at_once_take_different_cores_and_give_them_back():
    from piper_nb.cluster.local import _PINNED
    before = +_PINNED                     # cores that running clusters (fixtures) hold
    with LocalCluster(1) as a, LocalCluster(1) as b:
        assert a.info[0]["cores"] != b.info[0]["cores"]
    assert +_PINNED == before
