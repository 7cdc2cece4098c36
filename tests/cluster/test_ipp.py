"""`pn.IPyParallelCluster` on local engines: trains like the reference, fails fast and by
name when an engine is killed or hangs, stops cleanly on Ctrl-C, recovers in place.

One cluster of 2 engines serves the module (its controller and engines start once, in a
temporary ipython profile). Faults are real: engines are SIGKILLed or SIGSTOPped by pid,
Ctrl-C is a SIGINT to this process while it waits on the engines, and worker failures use
the documented hook `PIPER_NB_FAIL_AT`.
"""

from __future__ import annotations

import concurrent.futures as cf
import inspect
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import piper_nb as pn
from piper_nb import optim
from piper_nb.cluster import ipp as ipp_module
from piper_nb.cluster.ipp import IPyParallelCluster
from piper_nb.cluster.local import LocalCluster
from piper_nb.errors import RuntimeFailure, WorkerLost
from piper_nb.train import reference_train, train

pytestmark = pytest.mark.cluster

RTOL, ATOL = 1e-5, 4e-5
LONG = 100_000   # steps: a run that only a fault or Ctrl-C ends


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = IPyParallelCluster(2, profile_dir=str(tmp_path_factory.mktemp("ipp-profile")), lost_after=5.0)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    model = pn.models.MLP(dim=16, depth=4)
    batch = model.example_batch(batch_size=8, seed=0)
    spec = pn.annotate(model, pn.cut_stages(model, 2))
    plan = pn.compile(spec, [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
                             *pn.schedules.one_f_one_b(ranks=2, microbatches=4)], batch)
    ref = reference_train(model, batch, 3, 4, optim.AdamW(1e-2))
    return model, batch, plan, ref


def _same(result, ref) -> None:
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses), rtol=RTOL, atol=ATOL)
    got, want = result.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL)


def _trains(cluster, setup) -> None:
    _, batch, plan, ref = setup
    _same(train(plan, batch, 3, optim.AdamW(1e-2), cluster=cluster), ref)


def _later(seconds: float, fn) -> threading.Timer:
    t = threading.Timer(seconds, fn)
    t.daemon = True
    t.start()
    return t


def test_trains_like_the_reference(cluster, setup):
    _trains(cluster, setup)
    assert cluster.running and len(cluster.engine_ids) == 2
    info = cluster.info
    assert [i["engine"] for i in info] == cluster.engine_ids
    assert all(i["backend"] == "gloo" and i["pid"] != i["engine_pid"] for i in info)
    _trains(cluster, setup)   # the plan is shipped once; the same workers train again
    assert cluster.starts == 1


@pytest.mark.extended
def test_worker_failures_name_the_device(cluster, setup, monkeypatch):
    _, batch, plan, _ = setup
    monkeypatch.setenv("PIPER_NB_FAIL_AT", "1:r1:B2")
    with pytest.raises(RuntimeFailure) as info:
        train(plan, batch, 2, optim.SGD(0.1), cluster=cluster)
    assert not isinstance(info.value, WorkerLost)
    assert info.value.device == 1 and info.value.instruction == "r1:B2"
    assert "injected failure" in str(info.value) and not cluster.running
    monkeypatch.setenv("PIPER_NB_FAIL_AT", "0:r0:F2:exit")   # the worker process dies, the engine lives
    with pytest.raises(WorkerLost) as info:
        train(plan, batch, 2, optim.SGD(0.1), cluster=cluster)
    assert info.value.device == 0 and "exit code 17" in str(info.value)
    monkeypatch.delenv("PIPER_NB_FAIL_AT")
    engines = list(cluster.engine_ids)
    _trains(cluster, setup)
    assert cluster.engine_ids == engines   # same engines, fresh workers


@pytest.mark.full
def test_killed_engine_is_worker_lost_then_replaced(cluster, setup):
    _, batch, plan, _ = setup
    _trains(cluster, setup)
    victim = cluster.info[1]["engine_pid"]
    killed = []
    _later(1.0, lambda: (os.kill(victim, signal.SIGKILL), killed.append(time.monotonic())))
    with pytest.raises(WorkerLost) as info:
        train(plan, batch, LONG, optim.SGD(0.1), cluster=cluster)
    assert killed and time.monotonic() - killed[0] < 15
    assert info.value.device == 1 and str(victim) in str(info.value)
    assert not cluster.running
    _trains(cluster, setup)   # the lost engine was replaced by a new one
    assert cluster.running and cluster.info[1]["engine_pid"] != victim


@pytest.mark.extended
def test_max_restarts_replaces_an_engine_killed_mid_run_and_ends_as_if_it_was_not(
        cluster, setup, tmp_path):
    _, batch, plan, _ = setup
    full = train(plan, batch, 6, optim.AdamW(1e-2), cluster=cluster)
    victims = []

    workers = [info["pid"] for info in cluster.info]

    def kill_engine_1(step, steps, metrics):
        if step == 3 and not victims:                # between checkpoints 2 and 4
            victims.append(cluster.info[1]["engine_pid"])
            workers[:] = [info["pid"] for info in cluster.info]
            os.kill(victims[0], signal.SIGKILL)

    with pytest.warns(UserWarning, match=r"restart 1 of 2 after: step 4: .*device 1"):
        got = train(plan, batch, 6, optim.AdamW(1e-2), cluster=cluster, progress=kill_engine_1,
                    checkpoint_dir=tmp_path, checkpoint_every=2, max_restarts=2)
    assert cluster.running and cluster.info[1]["engine_pid"] != victims[0]   # replaced
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in workers)      # the old group's workers, all gone
    assert got.losses == full.losses
    for name, want in full.params.items():
        assert torch.equal(got.params[name], want), name


@pytest.mark.extended
def test_silent_engine_is_lost_after_lost_after(cluster, setup):
    _, batch, plan, _ = setup
    _trains(cluster, setup)
    victim = cluster.info[0]["engine_pid"]
    stopped = []
    _later(1.0, lambda: (os.kill(victim, signal.SIGSTOP), stopped.append(time.monotonic())))
    try:
        with pytest.raises(WorkerLost, match="not answered") as info:
            train(plan, batch, LONG, optim.SGD(0.1), cluster=cluster)
        assert time.monotonic() - stopped[0] < cluster.lost_after + cluster.poll + 10
        assert info.value.device == 0
    finally:
        os.kill(victim, signal.SIGKILL)
    _trains(cluster, setup)


@pytest.fixture(scope="module")
def slow():
    """A plan whose steps take a while, so Ctrl-C lands while the driver waits on a step."""
    model = pn.models.MLP(dim=512, depth=2)
    batch = model.example_batch(batch_size=512, seed=0)
    spec = pn.annotate(model, pn.cut_stages(model, 2))
    plan = pn.compile(spec, [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
                             *pn.schedules.one_f_one_b(ranks=2, microbatches=2)], batch)
    return batch, plan


class _WaitSpy:
    """`concurrent.futures` for the driver, noting when it sits in `wait` on its engines."""

    def __init__(self):
        self.inside = threading.Event()

    def wait(self, *args, **kwargs):
        self.inside.set()
        try:
            return cf.wait(*args, **kwargs)
        finally:
            self.inside.clear()

    def __getattr__(self, name):
        return getattr(cf, name)


@pytest.mark.full
@pytest.mark.parametrize("grace", [10.0, 0.0])
def test_ctrl_c_stops_the_run_and_keeps_the_cluster(cluster, setup, slow, grace, monkeypatch):
    batch, plan = slow
    train(plan, batch, 1, optim.SGD(0.1), cluster=cluster)
    starts, cluster.grace = cluster.starts, grace
    spy, sent = _WaitSpy(), []
    monkeypatch.setattr(ipp_module, "cf", spy)

    def ctrl_c():   # a real SIGINT, sent while the driver waits on a step
        time.sleep(1.0)
        spy.inside.wait(60.0)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    def unstopped(step, steps, metrics):   # a bound, so a lost Ctrl-C fails instead of hanging
        assert step < 500, f"Ctrl-C sent at {sent} did not stop the run"
    # a shell's background job ignores SIGINT, and Python keeps that: Ctrl-C must raise here
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=ctrl_c, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            train(plan, batch, LONG, optim.SGD(0.1), cluster=cluster, progress=unstopped)
    finally:
        cluster.grace = 10.0
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - sent[0] < grace + 5
    # within the grace the step finishes and the workers stay; without, they are killed
    assert cluster.running == (grace > 0)
    _trains(cluster, setup)
    assert cluster.starts == starts + (grace == 0)


def test_ctrl_c_from_a_progress_callback(cluster, setup):
    _, batch, plan, _ = setup
    if "progress" not in inspect.signature(train).parameters:
        pytest.skip("needs train(progress=...)")

    def stop(step, steps, loss):
        if step == 3:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        train(plan, batch, LONG, optim.SGD(0.1), cluster=cluster, progress=stop)
    _trains(cluster, setup)


@pytest.mark.full
def test_connect_to_a_running_cluster(cluster, setup):
    cluster.start()
    url = Path(cluster._ipp.profile_dir) / "security" / f"ipcontroller-{cluster._ipp.cluster_id}-client.json"
    other = IPyParallelCluster.connect(url_file=str(url), n=2)
    try:
        assert not other.owned
        _trains(other, setup)
        assert sorted(other.engine_ids) == sorted(cluster.engine_ids)
    finally:
        other.close()
    assert set(other.engine_ids) <= set(cluster.client.ids)   # close left the engines up
    cluster.restart()
    _trains(cluster, setup)


@pytest.mark.extended
def test_engines_on_two_machines_meet_at_engine_0(cluster, setup, monkeypatch):
    """The cross-machine path, on one machine: the engines are told they live on two hosts, so
    the group meets at engine 0's reported address instead of a loopback shortcut."""
    if "host" not in ipp_module._SERVE:
        pytest.skip("needs runtime.process.serve(host=...)")
    real = cluster.roster.pick

    def two_hosts(*args):
        ids = real(*args)
        for i, e in enumerate(ids):
            cluster.roster.hello[e] = {**cluster.roster.hello[e], "host": f"node{i}", "machine": f"node{i}"}
        return ids
    monkeypatch.setattr(cluster.roster, "pick", two_hosts)
    cluster.restart()
    assert [i["host"] for i in cluster.info] == ["node0", "node1"]
    _trains(cluster, setup)
    monkeypatch.undo()
    cluster.restart()
    _trains(cluster, setup)


@pytest.mark.full
@pytest.mark.skipif(not hasattr(LocalCluster, "train_state"), reason="needs the checkpoint hooks")
def test_a_checkpoint_moves_between_clusters(cluster, setup, tmp_path):
    """Written on ipyparallel engines, resumed on local workers: the same numbers, bit for bit."""
    _, batch, plan, _ = setup
    opt = optim.AdamW(1e-2)
    full = train(plan, batch, 6, opt, cluster=cluster)
    train(plan, batch, 3, opt, cluster=cluster, checkpoint_dir=tmp_path)
    with LocalCluster(2) as local:
        resumed = train(plan, batch, 6, opt, cluster=local, checkpoint_dir=tmp_path, resume=True)
    assert resumed.losses == full.losses
    assert all(torch.equal(resumed.params[k], v) for k, v in full.params.items())


def _layout(hosts: list[tuple[str, int]], device: str = "cuda") -> list[dict]:
    c = object.__new__(IPyParallelCluster)
    c.n, c.device, c.timeout, c.threads = len(hosts), device, 60.0, 1
    info = [{"host": h, "machine": h, "gpus": g} for h, g in hosts]
    return [c._worker_args(r, info, "10.0.0.1", 1234) for r in range(len(hosts))]


def test_gpus_by_local_rank_and_one_backend_for_all():
    args = _layout([("a", 2), ("a", 2), ("b", 2), ("b", 2)])
    assert [a["local_rank"] for a in args] == [0, 1, 0, 1]
    assert {a["backend"] for a in args} == {"nccl"} and {a["host"] for a in args} == {"10.0.0.1"}
    args = _layout([("a", 2), ("a", 2), ("b", 1), ("b", 1)])   # b has one GPU for two engines
    assert {a["backend"] for a in args} == {"gloo"}
    assert {a["backend"] for a in _layout([("a", 0)], device="cpu")} == {None}


def test_bad_arguments():
    with pytest.raises(ValueError, match="positive number"):
        IPyParallelCluster(0)
    with pytest.raises(ValueError, match="device"):
        IPyParallelCluster(2, device="tpu")


@pytest.mark.full
def test_engines_that_each_see_one_gpu_use_nccl_when_the_gpus_differ():
    from piper_nb.cluster.ipp import gpus_apart

    def host(machine, uuids):
        return {"machine": machine, "gpus": len(uuids), "gpu_uuids": uuids}
    # --gpus-per-task=1: every engine sees one GPU, a different one
    assert gpus_apart([host("a", ["GPU-0"]), host("a", ["GPU-1"]), host("b", ["GPU-0"])])
    # every engine sees all of its machine's GPUs: engine k takes the k-th
    assert gpus_apart([host("a", ["GPU-0", "GPU-1"]), host("a", ["GPU-0", "GPU-1"])])
    # two engines on one GPU (gloo stages through host memory), or none
    assert not gpus_apart([host("a", ["GPU-0"]), host("a", ["GPU-0"])])
    assert not gpus_apart([host("a", ["GPU-0", "GPU-1"])] * 3)
    assert not gpus_apart([host("a", [])])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:      # a zombie is gone too
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
