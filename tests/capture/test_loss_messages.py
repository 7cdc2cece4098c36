"""Loss errors that say what to do, each checked by applying the fix it suggests: a count
returned as a number, a mean where (sum, count) is asked for, a dict batch without labels."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import piper_nb as pn

IGNORE = -100


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


def program():
    return pn.schedules.one_f_one_b(2, 2, place=True)


def spec():
    model = Stack()
    return pn.annotate(model, {"emb": {"PP": 0}, "head": {"PP": 1}})


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 16, (4, 6), generator=g)
    labels = ids.clone()
    labels[:, 4:] = IGNORE
    return ids, labels


def token_sum(logits, labels):
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                       ignore_index=IGNORE, reduction="sum")


def test_a_count_returned_as_a_number_is_named_and_a_tensor_count_compiles():
    def numbered(logits, labels):
        return token_sum(logits, labels), labels.numel()
    with pytest.raises(pn.PlanError, match=r"the count that the loss returns is a \w+, not a "
                                           r"tensor.*\(labels != -100\)\.sum\(\)"):
        pn.compile(spec(), program(), batch(), loss_fn=numbered, loss_mean="global")
    plan = pn.compile(spec(), program(), batch(), loss_mean="global",
                      loss_fn=lambda o, y: (token_sum(o, y), (y != IGNORE).sum()))
    assert plan.loss_mean == "global"


def test_a_mean_under_the_global_loss_is_called_one_tensor_and_sum_count_compiles():
    def mean(logits, labels):
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                           ignore_index=IGNORE)
    with pytest.raises(pn.PlanError, match=r"must return \(sum, count\).*got one tensor "
                                           r"\(a mean\?\)") as err:
        pn.compile(spec(), program(), batch(), loss_fn=mean, loss_mean="global")
    assert "FakeTensor" not in str(err.value) and "Proxy" not in str(err.value)
    pn.compile(spec(), program(), batch(), loss_mean="global",
               loss_fn=lambda o, y: (token_sum(o, y), (y != IGNORE).sum()))


def test_a_dict_batch_without_a_loss_is_told_both_halves_of_the_fix():
    ids, labels = batch()
    with pytest.raises(pn.PlanError, match=r"has no loss: pass loss_fn=.*'labels' entry"):
        pn.compile(spec(), program(), {"ids": ids})
    plan = pn.compile(spec(), program(), {"ids": ids, "labels": labels},
                      loss_fn=lambda o, y: token_sum(o, y) / (y != IGNORE).sum())
    assert plan.capture.batch == ("ids", "labels")
