"""A checkpoint knows what wrote it: the same model, plan, optimizer and scheduler resume
(lambdas, partials, a new process); a changed activation, dropout probability or lambda
learning rate is refused naming the change; `resume="weights_only"` trains on; `steps` below
the checkpoint's step says so. Each error's suggested fix is applied and works.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import piper_nb as pn
from piper_nb.cluster import checkpoint as ck
from piper_nb.cluster.by_value import flatten
from piper_nb.cluster.local import LocalCluster
from piper_nb.errors import PlanError
from piper_nb.train import train

ROOT = Path(__file__).resolve().parents[2]
ACTS = {"tanh": nn.Tanh, "gelu": nn.GELU}


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(2) as c:
        yield c


def _plan(act: str = "tanh", p: float = 0.0, program=None):
    """MLP 4x16 in two stages; block 1's activation and a dropout after block 2 vary."""
    model = pn.models.MLP(dim=16, depth=4)
    model.layers[1][1] = ACTS[act]()
    model.layers[2].append(nn.Dropout(p))
    batches = [model.example_batch(batch_size=8, seed=s) for s in range(6)]
    program = program or [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
                          *pn.schedules.one_f_one_b(ranks=2, microbatches=2)]
    return pn.compile(pn.annotate(model, pn.cut_stages(model, 2)), program, batches[0]), batches


def _lambda(lr):
    return eval(f"lambda ps: torch.optim.AdamW(ps, lr={lr})", {"torch": torch})  # a fresh one


# -- by value, without workers --------------------------------------------------------
def test_callables_are_recorded_by_value_never_by_address():
    assert flatten(_lambda(0.01)) == flatten(_lambda(0.01))       # two objects, one value
    assert flatten(_lambda(0.01)) != flatten(_lambda(0.02))
    sched = [functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda s: 0.9 ** s)
             for _ in range(2)]
    assert flatten(sched[0]) == flatten(sched[1])
    assert not any("0x" in v for v in flatten(sched[0]).values())

    def closing_over(lr):
        return lambda ps: torch.optim.SGD(ps, lr=lr)
    assert flatten(closing_over(0.1)) == flatten(closing_over(0.1))
    old, new = flatten(closing_over(0.1)), flatten(closing_over(0.2))
    assert [(k, old[k], new[k]) for k in new if old[k] != new[k]] == [("<lambda>.lr", "0.1", "0.2")]


# -- resumes that are the same run --------------------------------------------------
FACTORIES = {
    "lambda": (lambda: _lambda(0.01), None),
    "partial": (lambda: functools.partial(torch.optim.AdamW, lr=0.01), None),
    "partial-LambdaLR": (lambda: functools.partial(torch.optim.SGD, lr=0.1), lambda: functools.partial(
        torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda s: 0.9 ** s)),
}


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_the_same_run_resumes(cluster, tmp_path, name):
    plan, batches = _plan()
    opt, sched = FACTORIES[name]

    kept = []   # each call builds its factories anew, all kept alive: new addresses, same values

    def run(steps, **kw):
        kept.append((opt(), sched() if sched else None))
        return train(plan, batches, steps, kept[-1][0], cluster=cluster, seed=0,
                     lr_scheduler=kept[-1][1], **kw)
    full = run(4)
    run(2, checkpoint_dir=tmp_path)
    resumed = run(4, checkpoint_dir=tmp_path, resume=True)
    assert resumed.losses == full.losses
    for k, v in full.params.items():
        assert torch.equal(resumed.params[k], v), k


SCRIPT = """
import functools, json, sys, torch
import piper_nb as pn
model = pn.models.MLP(dim=16, depth=4)
batches = [model.example_batch(batch_size=8, seed=s) for s in range(3)]
plan = pn.compile(pn.annotate(model, pn.cut_stages(model, 2)),
                  [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1])], batches[0])
opt = lambda ps: torch.optim.AdamW(ps, lr=0.01)
sched = functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda s: 0.9 ** s)

def run(steps, **kw):
    return pn.train(plan, batches, steps, opt, lr_scheduler=sched, seed=0, cluster=CLUSTER, **kw)
"""


@pytest.mark.dist
def test_a_new_process_resumes_a_checkpoint_of_this_one(cluster, tmp_path):
    ns = {"__name__": "__main__", "CLUSTER": cluster}
    exec(SCRIPT, ns)                                    # the lambdas live in __main__ here too
    full = ns["run"](3)
    ns["run"](2, checkpoint_dir=tmp_path)
    resume = f"CLUSTER = None\n{SCRIPT}\nr = run(3, checkpoint_dir={str(tmp_path)!r}, resume=True)\n" \
             "print(json.dumps(r.losses))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", resume], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == full.losses


# -- resumes of another run: refused, naming the change; each fix works --------------
def _refused(plan, batches, cluster, d, opt, match):
    with pytest.raises(PlanError, match=match) as err:
        train(plan, batches, 3, opt, cluster=cluster, checkpoint_dir=d, resume=True)
    assert "resume=\"weights_only\"" in str(err.value) and "fresh checkpoint_dir" in str(err.value)


@pytest.mark.dist
def test_a_changed_activation_is_refused_naming_it_and_the_fixes_work(cluster, tmp_path):
    plan, batches = _plan("tanh")
    opt = functools.partial(torch.optim.SGD, lr=0.1)
    train(plan, batches, 2, opt, cluster=cluster, checkpoint_dir=tmp_path)
    gelu, _ = _plan("gelu")
    _refused(gelu, batches, cluster, tmp_path, opt,
             r"the model's region PP=0 changed \(Tanh\(\) -> GELU\(approximate='none'\) at layers\.1\.1")
    with pytest.warns(UserWarning, match=r"weights_only.*Tanh\(\) -> GELU"):   # fix: weights only
        r = train(gelu, batches, 3, opt, cluster=cluster, checkpoint_dir=tmp_path, resume="weights_only")
    assert len(r.losses) == 3 and [m.step for m in r.metrics] == [1, 2, 3]
    assert ck.latest(tmp_path).name == "step-000003"
    r = train(gelu, batches, 3, opt, cluster=cluster, checkpoint_dir=tmp_path / "fresh", resume=True)
    assert len(r.losses) == 3                                              # fix: a fresh directory
    r = train(gelu, batches, 4, opt, cluster=cluster, checkpoint_dir=tmp_path, resume=True)
    assert len(r.losses) == 4   # fix: revert (the gelu run wrote step 3, gelu resumes it)


@pytest.mark.dist
def test_a_changed_dropout_probability_is_refused(cluster, tmp_path):
    plan, batches = _plan(p=0.0)
    opt = functools.partial(torch.optim.SGD, lr=0.1)
    train(plan, batches, 2, opt, cluster=cluster, checkpoint_dir=tmp_path)
    other, _ = _plan(p=0.1)
    _refused(other, batches, cluster, tmp_path, opt,
             r"region PP=1 changed \(Dropout\(p=0\.0, inplace=False\) -> Dropout\(p=0\.1, "
             r"inplace=False\) at layers\.2\.2")


@pytest.mark.dist
def test_a_lambda_with_another_lr_is_refused_and_weights_only_takes_the_new_lr(cluster, tmp_path):
    plan, batches = _plan()
    train(plan, batches, 2, _lambda(0.01), cluster=cluster, checkpoint_dir=tmp_path)
    _refused(plan, batches, cluster, tmp_path, _lambda(0.02),
             r"the optimizer changed: <lambda> constants \(None, 0\.01, \('lr',\)\) -> "
             r"\(None, 0\.02, \('lr',\)\)")
    with pytest.warns(UserWarning, match="optimizer changed"):
        r = train(plan, batches, 3, _lambda(0.02), cluster=cluster, checkpoint_dir=tmp_path,
                  resume="weights_only")
    assert [m.lr for m in r.metrics] == [0.01, 0.01, 0.02]   # steps 1-2 from the checkpoint
    assert r.optimizer_state["param_groups"][0]["lr"] == 0.02


@pytest.mark.dist
def test_weights_only_loads_another_parameter_layout_from_dcp_alone(cluster, tmp_path):
    plan, batches = _plan()
    opt = functools.partial(torch.optim.SGD, lr=0.1)
    train(plan, batches, 2, opt, cluster=cluster, checkpoint_dir=tmp_path / "own",
          checkpoint_format="piper_nb")
    zero3, _ = _plan(program=[pn.replicate({}, [0, 1], zero=3), pn.split({}, "MB", 2)])
    with pytest.raises(PlanError, match="lays them out differently.*fresh checkpoint_dir"):
        train(zero3, batches, 3, opt, cluster=cluster, checkpoint_dir=tmp_path / "own",
              resume="weights_only", checkpoint_format="piper_nb")
    r = train(zero3, batches, 3, opt, cluster=cluster, checkpoint_dir=tmp_path / "fresh")
    assert len(r.losses) == 3                                              # the fix
    full = train(plan, batches, 3, opt, cluster=cluster, checkpoint_dir=tmp_path / "dcp")
    r = train(zero3, batches, 4, opt, cluster=cluster, checkpoint_dir=tmp_path / "dcp",
              resume="weights_only")                          # DCP: any layout loads
    assert r.losses[:3] == full.losses and len(r.losses) == 4


@pytest.mark.dist
def test_steps_below_the_checkpoint_say_so(cluster, tmp_path):
    plan, batches = _plan()
    opt = functools.partial(torch.optim.SGD, lr=0.1)
    full = train(plan, batches, 5, opt, cluster=cluster, seed=0)
    train(plan, batches, 4, opt, cluster=cluster, checkpoint_dir=tmp_path, seed=0)
    with pytest.raises(PlanError, match=r"is at step 4, beyond steps=2: .*pass steps greater than 4"):
        train(plan, batches, 2, opt, cluster=cluster, checkpoint_dir=tmp_path, resume=True, seed=0)
    r = train(plan, batches, 5, opt, cluster=cluster, checkpoint_dir=tmp_path, resume=True, seed=0)
    assert r.losses == full.losses                                         # the fix


def test_resume_takes_true_false_or_weights_only(tmp_path):
    plan, _ = _plan()
    with pytest.raises(ValueError, match="weights_only"):
        ck.Checkpointer(plan, pn.optim.SGD(0.1), tmp_path, resume="weights")
