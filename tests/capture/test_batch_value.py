"""The batch is named once, at the front door (`Batch.of` in `pn.compile`, the batches
`pn.train` and `pn.reference_train` draw, `pn.Designer`, `cluster.step`), and travels as
that `Batch` down to the workers: named again nowhere, whatever the number of steps."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import piper_nb as pn
from piper_nb.capture.batch import Batch
from piper_nb.compiler.compile import rebatch


class _Scaled(nn.Module):
    """A model called as `model(**batch)` less its labels."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, scale):
        return self.lin(x) * scale


def _mse(out, labels):
    return F.mse_loss(out, labels)


def _dict_batch(n: int = 8) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(n, 4, generator=g), "scale": torch.rand(n, 1, generator=g),
            "labels": torch.randn(n, 4, generator=g)}


def _gpt():
    torch.manual_seed(0)
    model = pn.models.TinyGPT(vocab=32, dim=16, layers=2, heads=2, seq=8)
    return model, model.example_batch(batch_size=8, seed=0)


@pytest.fixture
def namings(monkeypatch) -> list[str]:
    """Where each batch was named: every `Batch.of` given anything but a `Batch`."""
    seen: list[str] = []
    real = Batch.of.__func__

    def counting(cls, batch, where: str = "batch"):
        if not isinstance(batch, Batch):
            seen.append(where)
        return real(cls, batch, where)

    monkeypatch.setattr(Batch, "of", classmethod(counting))
    return seen


def test_a_batch_is_named_once_and_then_kept_as_it_is():
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    batch = Batch.of((x, y))
    assert tuple(batch) == ("inputs", "targets") and batch.is_pair and batch.size == 4
    assert Batch.of(batch) is batch and Batch.of(batch, "elsewhere") is batch
    assert batch.in_order(("inputs", "targets"), "here") is batch
    with pytest.raises(AttributeError):
        batch.extra = 1
    back = pickle.loads(pickle.dumps(batch))
    assert isinstance(back, Batch) and tuple(back) == tuple(batch)
    assert back["inputs"].equal(x) and back["targets"].equal(y)


def test_a_plan_ordered_tuple_takes_the_plan_names_not_a_pair():
    """`cluster.step`'s tensors in plan order: a dict plan's two names, never inputs/targets."""
    ids, labels = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)
    batch = Batch.ordered(("input_ids", "labels"), (ids, labels), "cluster.step")
    assert tuple(batch) == ("input_ids", "labels") and not batch.is_pair
    assert Batch.ordered(("labels", "input_ids"), batch, "cluster.step").is_pair is False
    with pytest.raises(pn.PlanError, match=r"cluster.step: the batch has \['input_ids', "
                                           r"'labels'\] but the plan was compiled for"):
        Batch.ordered(("input_ids", "mask"), batch, "cluster.step")


def test_a_dict_batch_in_another_key_order_is_rebatched():
    batch = _dict_batch()
    plan = pn.compile(_Scaled(), [pn.place({}, [0]), pn.split({}, "MB", 2)], batch,
                      loss_fn=_mse)
    assert plan.batch_names == ("x", "scale", "labels")
    smaller = {k: _dict_batch(4)[k] for k in ("labels", "scale", "x")}   # another order
    other = rebatch(plan, smaller)
    assert other.batch_size == 4 and other.batch_names == plan.batch_names


def test_a_pair_batch_counts_flops_on_the_inputs_alone():
    model, batch = _gpt()
    assert pn.cut_stages(model, 2, by="flops", example=Batch.of(batch)) == pn.cut_stages(
        model, 2, by="flops", example=batch)


def test_reference_train_names_one_repeated_batch_once(namings):
    model, batch = _gpt()
    pn.reference_train(model, batch, steps=3, microbatches=2, optimizer=pn.optim.SGD(lr=0.1))
    assert namings == ["reference_train step 1"]
    namings.clear()
    loader = [model.example_batch(batch_size=8, seed=s) for s in range(3)]
    pn.reference_train(model, loader, steps=3, microbatches=2, optimizer=pn.optim.SGD(lr=0.1))
    assert namings == [f"reference_train step {s}" for s in (1, 2, 3)]


@pytest.mark.dist
def test_train_names_the_batch_once_down_to_the_workers(namings, cluster2):
    model, batch = _gpt()
    spec = pn.annotate(model, pn.cut_stages(model, 2))
    program = [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
               *pn.schedules.one_f_one_b(ranks=2, microbatches=2)]
    plan = pn.compile(spec, program, batch)
    assert namings == ["pn.compile"]
    namings.clear()
    opt = pn.optim.SGD(lr=0.1)
    got = pn.train(plan, batch, steps=3, optimizer=opt, cluster=cluster2)
    assert namings == ["step 1"]                  # not once per step, nor per floor
    ref = pn.reference_train(model, batch, steps=3, microbatches=2, optimizer=opt)
    assert got.losses == pytest.approx(ref.losses, rel=1e-5)
