"""Checkpoints: a run killed mid-way and resumed ends bit for bit where an uninterrupted run
ends; a write cut short leaves the previous checkpoint; nothing but tensors is unpickled.

The kill is real: a progress callback arms the documented test hook
`PIPER_NB_FAIL_AT="0:<instr>:exit"` after step 3, so worker 0's process dies inside step 4.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch

import piper_nb as pn
from piper_nb import optim
from piper_nb.cluster import checkpoint as ck
from piper_nb.cluster import dcp
from piper_nb.cluster.local import LocalCluster
from piper_nb.errors import PlanError, RuntimeFailure, WorkerLost
from piper_nb.train import train

HOOKS = hasattr(LocalCluster, "train_state") and "checkpoint_dir" in inspect.signature(train).parameters
needs_hooks = pytest.mark.skipif(not HOOKS, reason="needs train(checkpoint_dir=...) and the runtime's "
                                 "train_state/load_train_state commands")

STEPS, KILL_AFTER = 6, 3
PLANS = {
    "pp-1f1b": lambda: [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
                        *pn.schedules.one_f_one_b(ranks=2, microbatches=4)],
    "dp-zero1": lambda: [pn.replicate({}, [0, 1], zero=1), pn.split({}, "MB", 2)],
    "dp-zero3": lambda: [pn.replicate({}, [0, 1], zero=3), pn.split({}, "MB", 2)],
}


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(2) as c:
        yield c


def _setup(name: str):
    model = pn.models.MLP(dim=16, depth=4)
    batches = [model.example_batch(batch_size=8, seed=s) for s in range(STEPS)]  # a real loader
    annotation = pn.cut_stages(model, 2) if name.startswith("pp") else {"layers": {"PP": 0}}
    plan = pn.compile(pn.annotate(model, annotation), PLANS[name](), batches[0])
    return model, batches, plan


@needs_hooks
@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(PLANS))
@pytest.mark.parametrize("fmt", ck.FORMATS)
def test_killed_and_resumed_run_equals_an_uninterrupted_one(cluster, tmp_path, monkeypatch, name,
                                                            fmt):
    _, batches, plan = _setup(name)
    opt = optim.AdamW(1e-2)   # optimizer state and the step count both matter
    full = train(plan, batches, STEPS, opt, cluster=cluster)

    instr = str(plan.devices[0].compute()[0])

    def kill_after_step_3(step, steps, loss):
        if step == KILL_AFTER:
            monkeypatch.setenv("PIPER_NB_FAIL_AT", f"0:{instr}:exit")

    with pytest.raises(WorkerLost, match=rf"^step {KILL_AFTER + 1}: the worker of device 0"):
        train(plan, batches, STEPS, opt, cluster=cluster, progress=kill_after_step_3,
              checkpoint_dir=tmp_path, checkpoint_every=1, checkpoint_format=fmt)
    monkeypatch.delenv("PIPER_NB_FAIL_AT")
    assert [s for s, _ in ck.checkpoints(tmp_path)] == [2, 3]     # keep=2, nothing torn
    resumed = train(plan, batches, STEPS, opt, cluster=cluster, checkpoint_dir=tmp_path,
                    resume=True, checkpoint_format=fmt)
    assert resumed.losses == full.losses
    assert [m.step for m in resumed.metrics] == list(range(1, STEPS + 1))  # the resumed and before
    assert [m.loss for m in resumed.metrics] == full.losses
    assert [m.lr for m in resumed.metrics] == [m.lr for m in full.metrics]
    for name_, want in full.params.items():
        assert torch.equal(resumed.params[name_], want), name_
    assert [s for s, _ in ck.checkpoints(tmp_path)] == [5, 6]
    if fmt == "dcp":
        whole, side = dcp.read(ck.latest(tmp_path))
        assert int(whole["train_state.step"]) == side["data_position"] == STEPS
    else:
        obj = ck.load(ck.latest(tmp_path))
        assert obj["step"] == obj["data_position"] == STEPS
        whole = ck.full_state(obj, plan)
    for name_, want in full.params.items():
        assert torch.equal(whole[name_], want)


@needs_hooks
@pytest.mark.dist
@pytest.mark.parametrize("fmt", ck.FORMATS)
def test_resume_refuses_another_optimizer_and_its_own_format_another_plan(cluster, tmp_path,
                                                                          fmt):
    model, batches, plan = _setup("pp-1f1b")
    train(plan, batches, 2, optim.SGD(0.1), cluster=cluster, checkpoint_dir=tmp_path,
          checkpoint_format=fmt)
    with pytest.raises(PlanError, match=r"the optimizer changed: lr 0\.1 -> 0\.2"):
        train(plan, batches, 3, optim.SGD(0.2), cluster=cluster, checkpoint_dir=tmp_path,
              resume=True, checkpoint_format=fmt)
    if fmt == "piper_nb":     # a DCP checkpoint resumes on any plan (tests/cluster/test_dcp.py)
        _, _, other = _setup("dp-zero1")
        with pytest.raises(PlanError, match=r"the plan changed: microbatches 4 -> 2"):
            train(other, batches, 3, optim.SGD(0.1), cluster=cluster, checkpoint_dir=tmp_path,
                  resume=True, checkpoint_format=fmt)


def _obj(step: int) -> dict:
    return {"format": ck.FORMAT, "step": step, "workers": [{"full": {"w": torch.full((64,), step)}}]}


def test_a_write_cut_short_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    ck.save(tmp_path, _obj(1))
    real = ck._write

    def half_then_crash(obj, fh):
        import io
        buf = io.BytesIO()
        real(obj, buf)
        fh.write(buf.getvalue()[:len(buf.getvalue()) // 2])
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ck, "_write", half_then_crash)
    with pytest.raises(OSError, match="simulated"):
        ck.save(tmp_path, _obj(2))
    assert ck.latest(tmp_path).name == "step-000001.pt"
    assert torch.equal(ck.load(ck.latest(tmp_path))["workers"][0]["full"]["w"], torch.full((64,), 1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001.pt"]   # no temp file left
    # a process killed mid-write leaves only a hidden temp file, which is never taken for a checkpoint
    (tmp_path / ".step-000003.pt.x1y2.tmp").write_bytes(b"torn")
    assert ck.latest(tmp_path).name == "step-000001.pt"


def test_save_keeps_the_newest(tmp_path):
    for s in (1, 2, 3, 4):
        ck.save(tmp_path, _obj(s), keep=2)
    assert [s for s, _ in ck.checkpoints(tmp_path)] == [3, 4]
    assert ck.latest(tmp_path / "nothing-here") is None


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_load_unpickles_no_code(tmp_path):
    path = tmp_path / "step-000001.pt"
    torch.save({"format": ck.FORMAT, "step": 1, "evil": _Evil()}, path)
    with pytest.raises(RuntimeFailure, match="cannot read checkpoint"):
        ck.load(path)
    torch.save({"not": "ours"}, path)
    with pytest.raises(RuntimeFailure, match="not a piper_nb checkpoint"):
        ck.load(path)


def test_checkpointer_validates_its_arguments(tmp_path):
    _, _, plan = _setup("pp-1f1b")
    with pytest.raises(ValueError, match="checkpoint_every"):
        ck.Checkpointer(plan, optim.SGD(0.1), tmp_path, every=0)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        ck.Checkpointer.for_train(plan, optim.SGD(0.1), None, 2, False)
    assert ck.Checkpointer.for_train(plan, optim.SGD(0.1), None, None, False) is None
    c = ck.Checkpointer(plan, optim.SGD(0.1), tmp_path, resume=True)
    assert c.restore(object()) == (0, [], [], [])      # nothing to resume from: start at step 0
    with pytest.raises(PlanError, match="cannot checkpoint"):
        c.after_step(object(), 1, 1, [1.0], [0.1])
