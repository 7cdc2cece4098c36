"""`pn.train(..., max_restarts=N)`: a worker killed with a real SIGKILL mid-run is
replaced, the newest checkpoint reloaded, and the run ends where an uninterrupted one
does, with no process left behind; a fault that repeats stops after N restarts with the
original error."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import piper_nb as pn
from piper_nb import optim
from piper_nb.cluster.local import LocalCluster
from piper_nb.errors import PlanError, RuntimeFailure

STEPS = 6


def _setup():
    model = pn.models.MLP(dim=16, depth=4)
    batches = [model.example_batch(batch_size=8, seed=s) for s in range(STEPS)]
    plan = pn.compile(pn.annotate(model, pn.cut_stages(model, 2)),
                      [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
                       *pn.schedules.one_f_one_b(ranks=2, microbatches=4)], batches[0])
    return batches, plan


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:          # a zombie is gone too
        return f.read().split()[2] != "Z"


@pytest.mark.dist
def test_a_worker_killed_mid_run_is_replaced_and_the_run_ends_as_if_it_was_not(tmp_path):
    batches, plan = _setup()
    opt = optim.AdamW(1e-2)
    with LocalCluster(2) as cluster:
        full = pn.train(plan, batches, STEPS, opt, cluster=cluster)
    with LocalCluster(2) as cluster:
        first_group = []

        def kill_worker_1(step, steps, metrics):
            if step == 3 and not first_group:       # mid-run, between checkpoints 2 and 4
                first_group.extend(info["pid"] for info in cluster.info)
                os.kill(cluster.info[1]["pid"], signal.SIGKILL)

        with pytest.warns(UserWarning, match=r"restart 1 of 2 after: step 4: the worker of "
                                             r"device 1 died"):
            got = pn.train(plan, batches, STEPS, opt, cluster=cluster, progress=kill_worker_1,
                           checkpoint_dir=tmp_path, checkpoint_every=2, max_restarts=2)
        assert cluster.starts == 2
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in first_group) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in first_group)   # the old group, all of it, is gone
    assert got.losses == full.losses
    assert [m.step for m in got.metrics] == list(range(1, STEPS + 1))
    for name, want in full.params.items():
        assert torch.equal(got.params[name], want), name


@pytest.mark.dist
def test_a_worker_that_hangs_mid_run_is_replaced_and_the_run_ends_as_if_it_did_not(tmp_path):
    """SIGSTOP: the worker is alive but answers nothing. After the cluster's timeout the
    group is stopped (the frozen process killed with it) and the run goes on."""
    batches, plan = _setup()
    opt = optim.AdamW(1e-2)
    with LocalCluster(2, timeout=5.0) as cluster:
        full = pn.train(plan, batches, STEPS, opt, cluster=cluster)
        frozen = []

        def freeze_worker_0(step, steps, metrics):
            if step == 3 and not frozen:
                frozen.append(cluster.info[0]["pid"])
                os.kill(frozen[0], signal.SIGSTOP)

        with pytest.warns(UserWarning, match=r"restart 1 of 1 after: step 4: "):
            got = pn.train(plan, batches, STEPS, opt, cluster=cluster, progress=freeze_worker_0,
                           checkpoint_dir=tmp_path, checkpoint_every=2, max_restarts=1)
        deadline = time.monotonic() + 10
        while _alive(frozen[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(frozen[0])                     # not left behind, stopped
    assert got.losses == full.losses
    for name, want in full.params.items():
        assert torch.equal(got.params[name], want), name


@pytest.mark.extended
@pytest.mark.dist
def test_a_fault_that_repeats_stops_after_n_restarts_with_the_original_error(tmp_path,
                                                                              monkeypatch):
    batches, plan = _setup()
    instr = str(plan.devices[1].compute()[0])
    monkeypatch.setenv("PIPER_NB_FAIL_AT", f"1:{instr}")     # every attempt, step 1
    with LocalCluster(2) as cluster:
        with pytest.warns(UserWarning, match=r"restart [12] of 2") as said:
            with pytest.raises(RuntimeFailure, match=rf"^step 1: device 1 failed at "
                                                      rf"instruction {instr}") as err:
                pn.train(plan, batches, STEPS, optim.SGD(0.1), cluster=cluster,
                         checkpoint_dir=tmp_path, max_restarts=2)
        assert len([w for w in said if "restart" in str(w.message)]) == 2
    assert "restarted 2 times, and each attempt failed" in "".join(err.value.__notes__)


def test_restarts_need_a_checkpoint_directory():
    batches, plan = _setup()
    with pytest.raises(PlanError, match="max_restarts reloads the newest checkpoint"):
        pn.train(plan, batches, STEPS, optim.SGD(0.1), max_restarts=1)
    with pytest.raises(PlanError, match="max_restarts must be a non-negative int"):
        pn.train(plan, batches, STEPS, optim.SGD(0.1), max_restarts=-1)
