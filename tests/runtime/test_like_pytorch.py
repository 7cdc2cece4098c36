"""Fidelity against a plain PyTorch loop written here (not only `pn.reference_train`): custom
autograd Functions keep their backward, modules keep the mode the user set (eval or train),
and batches whose per-sample shapes change from step to step train as they would in one
process. Each case runs under PP 2 1F1B and PP 2 x DP 2 ZeRO-3."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import piper_nb as pn

pytestmark = pytest.mark.dist
S = pn.schedules
RTOL, ATOL = 1e-5, 4e-5


def plain_loop(model, batches, microbatches: int, lr: float, loss_fn):
    """SGD over each batch, `microbatches` equal slices accumulated, each loss / M: the
    loop a user writes. The model's modes are left as the user set them."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
            loss = loss_fn(model(xs), ys) / microbatches
            loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
    return losses, model.state_dict()


def assert_like(result, want_losses, want_state):
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(want_losses),
                               rtol=RTOL, atol=ATOL)
    got = result.state_dict()
    assert got.keys() == want_state.keys()
    for k in want_state:
        torch.testing.assert_close(got[k].float(), want_state[k].float(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m, k=k: f"{k}: {m}")


def programs(two: bool):
    pp = [*S.one_f_one_b(2, 2, place=True)]
    if two:
        return pp
    return [pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
            pn.replicate({"PP": 0}, [0, 2], zero=3), pn.replicate({"PP": 1}, [1, 3], zero=3),
            *S.one_f_one_b(2, 2)]


STRATEGIES = {"pp2": True, "pp2-dp2-zero3": False}


def _cluster(request, name):
    return request.getfixturevalue("cluster2" if STRATEGIES[name] else "cluster4")


class StraightThrough(torch.autograd.Function):
    """Rounds forward, passes the gradient through unchanged (a straight-through estimator)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class Quantized(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        with pn.region("PP", 0):
            h = StraightThrough.apply(torch.tanh(self.a(x)))
        with pn.region("PP", 1):
            return self.b(h)

    def loss_fn(self, out, y):
        return nn.functional.mse_loss(out, y)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_custom_autograd_function_keeps_its_backward(request, name):
    model = Quantized()
    batch = (torch.randn(8, 8), torch.randn(8, 4))
    plan = pn.compile(pn.annotate(model), programs(STRATEGIES[name]), batch)
    result = pn.train(plan, batch, 2, pn.optim.SGD(0.5), cluster=_cluster(request, name))
    want = plain_loop(model, [batch] * 2, plan.microbatches, 0.5, model.loss_fn)
    assert_like(result, *want)
    moved = (result.state_dict()["a.weight"] - model.a.weight).abs().max()
    assert moved > 1e-3      # the straight-through gradient reached the first layer


def test_export_refuses_a_custom_autograd_function_it_would_drop():
    model = Quantized()
    batch = (torch.randn(8, 8), torch.randn(8, 4))
    with pytest.raises(pn.PlanError, match=r"custom torch.autograd.Function .*StraightThrough.*"
                                           r"capture='fx'"):
        pn.compile(pn.annotate(model), programs(True), batch, capture="export")


class Normed(nn.Module):
    """BatchNorm and dropout in each stage: what eval and train modes change."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.n, self.d = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        with pn.region("PP", 0):
            h = self.d(self.n(self.a(x)))
        with pn.region("PP", 1):
            return self.b(torch.relu(h))

    def loss_fn(self, out, y):
        return nn.functional.mse_loss(out, y)


def _buffers(state):
    return {k: v for k, v in state.items() if "running" in k or "num_batches" in k}


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_eval_mode_trains_as_in_eval(request, name, capture, recompute):
    """The user's eval mode holds in every worker: dropout off, BatchNorm on its running
    statistics (which never move), with or without recomputing the BatchNorm region."""
    model = Normed().eval()
    batch = (torch.randn(8, 8), torch.randn(8, 4))
    program = [*programs(STRATEGIES[name]), *([pn.recompute({"PP": 0})] if recompute else [])]
    plan = pn.compile(pn.annotate(model), program, batch, capture=capture)
    result = pn.train(plan, batch, 2, pn.optim.SGD(0.1), cluster=_cluster(request, name))
    losses, state = plain_loop(model, [batch] * 2, plan.microbatches, 0.1, model.loss_fn)
    assert_like(result, losses, state)
    assert int(result.state_dict()["n.num_batches_tracked"]) == 0
    assert not model.training and not model.n.training   # the user's model untouched


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_train_mode_batchnorm_counts_every_microbatch(request, capture):
    """BatchNorm in train mode (dropout off): statistics and the batch counter move exactly
    as in one process, one update per microbatch forward."""
    model = Normed()
    model.d.p = 0.0
    batch = (torch.randn(8, 8), torch.randn(8, 4))
    plan = pn.compile(pn.annotate(model), programs(True), batch, capture=capture)
    result = pn.train(plan, batch, 3, pn.optim.SGD(0.1), cluster=_cluster(request, "pp2"))
    losses, state = plain_loop(model, [batch] * 3, plan.microbatches, 0.1, model.loss_fn)
    assert_like(result, losses, state)
    assert int(result.state_dict()["n.num_batches_tracked"]) == 3 * plan.microbatches
