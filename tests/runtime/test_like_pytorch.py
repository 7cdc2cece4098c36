"""Fidelity against a plain PyTorch loop written here (not only `pn.reference_train`): custom
autograd Functions keep their backward, modules keep the mode the user set (eval or train),
and batches whose per-sample shapes change from step to step train as they would in one
process. Each case runs under PP 2 1F1B and PP 2 x DP 2 ZeRO-3."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from torch import nn

import piper_nb as pn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plain import assert_like, chunks, plain_loop  # noqa: E402

pytestmark = pytest.mark.dist
S = pn.schedules
RTOL, ATOL = 1e-5, 4e-5


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


class RoundTo(torch.autograd.Function):
    """Rounds to `step` forward and returns the remainder too; both pass their gradient
    straight through: a Function with a non-tensor argument and two outputs."""

    @staticmethod
    def forward(ctx, x, step: float):
        r = torch.round(x / step) * step
        return r, x - r

    @staticmethod
    def backward(ctx, grad_r, grad_rest):
        return grad_r + grad_rest, None


class QuantizedDict(nn.Module):
    """`Quantized` with a second Function of two outputs, trained from a dict batch (which
    only torch.export captures) with the model's own loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x, labels):
        with pn.region("PP", 0):
            h = StraightThrough.apply(torch.tanh(self.a(x)))
            r, rest = RoundTo.apply(h, 0.5)
        with pn.region("PP", 1):
            return {"loss": nn.functional.mse_loss(self.b(r + 0.5 * rest), labels)}


def test_export_keeps_a_custom_autograd_functions_backward(cluster2):
    model = QuantizedDict()
    batch = {"x": torch.randn(8, 8), "labels": torch.randn(8, 4)}
    plan = pn.compile(pn.annotate(model), programs(True), batch, capture="export")
    assert plan.capture.method == "export"
    result = pn.train(plan, batch, 2, pn.optim.SGD(0.5), cluster=cluster2)
    ref = pn.reference_train(model, batch, steps=2, microbatches=plan.microbatches,
                             optimizer=pn.optim.SGD(0.5))
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses),
                               rtol=1e-5, atol=4e-5)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(result.state_dict()[k], v, rtol=1e-5, atol=4e-5)
    moved = (result.state_dict()["a.weight"] - model.a.weight).abs().max()
    assert moved > 1e-3      # the straight-through gradients reached the first layer


class QuantizedInAutocast(Quantized):
    def forward(self, x):
        with torch.autocast("cpu", enabled=False):   # export nests this block
            h = StraightThrough.apply(torch.tanh(self.a(x)))
        return self.b(h)


def test_a_custom_function_inside_an_autocast_block_is_refused_and_fx_is_the_fix(cluster2):
    model = QuantizedInAutocast()
    batch = (torch.randn(8, 8), torch.randn(8, 4))
    spec = pn.annotate(model, {"a": {"PP": 0}, "b": {"PP": 1}})
    with pytest.raises(pn.PlanError, match=r"StraightThrough inside a `torch.autocast` block"
                                           r".*capture='fx'"):
        pn.compile(spec, programs(True), batch, capture="export")
    plan = pn.compile(spec, programs(True), batch, capture="fx")
    result = pn.train(plan, batch, 2, pn.optim.SGD(0.5), cluster=cluster2)
    assert_like(result, *plain_loop(model, [batch] * 2, plan.microbatches, 0.5, model.loss_fn))
    assert (result.state_dict()["a.weight"] - model.a.weight).abs().max() > 1e-3


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


class Tokens(nn.Module):
    """Token ids in, next-token logits out; the ids' padding mask crosses the stage as an
    integer tensor, as attention masks do."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.a, self.b = nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16)

    def forward(self, input_ids, labels=None):
        with pn.region("PP", 0):
            h = torch.tanh(self.a(self.emb(input_ids)))
            keep = (input_ids != 0).long()
        with pn.region("PP", 1):
            logits = self.b(h * keep.unsqueeze(-1))
        if labels is None:
            return logits
        return {"loss": self.loss_fn(logits, labels)}

    def loss_fn(self, logits, labels):
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _padded(length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 16, (8, length), generator=g)
    ids[::3, length // 2:] = 0          # some rows padded, as a collator pads to the longest
    return ids, torch.randint(0, 16, (8, length), generator=g)


@pytest.mark.parametrize("form", ["pair-fx", "dict-export"])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_sequence_length_that_changes_between_steps(request, name, form):
    """A collator padding each batch to its longest sequence: lengths 8, 4, 8, 6. Each new
    length trains on the program compiled for it (a warning says so), from the same state."""
    model = Tokens()
    pairs = [_padded(n, i) for i, n in enumerate([8, 4, 8, 6])]
    batches = ([{"input_ids": x, "labels": y} for x, y in pairs] if form == "dict-export"
               else pairs)
    plan = pn.compile(pn.annotate(model), programs(STRATEGIES[name]), batches[0],
                      capture=form.split("-")[1])
    with pytest.warns(UserWarning, match=r"'(inputs|input_ids)' is \[8, 4\] int64 \(the plan "
                                         r"is for \[8, 8\] int64\)"):
        result = pn.train(plan, iter(batches), 4, pn.optim.SGD(0.5),
                          cluster=_cluster(request, name))
    want = plain_loop(model, batches, plan.microbatches, 0.5, model.loss_fn)
    assert_like(result, *want)


def test_a_batch_the_plan_was_not_compiled_for_is_refused_by_step(cluster2):
    """Below pn.train, a step on samples the plan does not know is a PlanError before any
    worker runs, never a half-filled receive buffer."""
    model = Tokens()
    x, y = _padded(8, 0)
    plan = pn.compile(pn.annotate(model), programs(True), (x, y))
    x4, y4 = _padded(4, 1)
    cluster2.reset(plan, pn.optim.SGD(0.1), 0)
    with pytest.raises(pn.PlanError, match=r"cluster.step: batch\['inputs'\] has per-sample "
                                           r"shape \[4\] but the plan was compiled for \[8\]"):
        cluster2.step(plan, (x4, y4))
    with pytest.raises(pn.PlanError, match=r"per-sample dtype int32 .* int64"):
        cluster2.step(plan, (x.int(), y))


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_the_optimizer_state_comes_back_whole(request, name):
    """`result.optimizer_state_dict()`: AdamW's moments and step per parameter name, ZeRO
    shards gathered back, equal to a plain torch.optim.AdamW loop's state."""
    model = Tokens()
    batch = _padded(8, 0)
    plan = pn.compile(pn.annotate(model), programs(STRATEGIES[name]), batch)
    groups = [{"params": ["*.bias"], "weight_decay": 0.0}]
    result = pn.train(plan, batch, 2, pn.optim.AdamW(1e-2, weight_decay=0.1),
                      cluster=_cluster(request, name), param_groups=groups)
    plain = copy.deepcopy(model)
    named = dict(plain.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in named.items() if n.endswith(".bias")],
                              "weight_decay": 0.0},
                             {"params": [p for n, p in named.items() if not n.endswith(".bias")]}],
                            lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        opt.zero_grad()
        for xs, ys in chunks(batch, plan.microbatches):
            (model.loss_fn(plain(xs), ys) / plan.microbatches).backward()
        opt.step()
    got = result.optimizer_state_dict()
    assert sorted(got["state"]) == sorted(named)
    for n, p in named.items():
        for k, want in opt.state[p].items():
            torch.testing.assert_close(got["state"][n][k], want, rtol=RTOL, atol=1e-6,
                                       msg=lambda m, n=n, k=k: f"{n} {k}: {m}")
    assert [g["weight_decay"] for g in got["param_groups"]] == [0.0, 0.1]
    assert sorted(got["param_groups"][0]["params"]) == ["a.bias", "b.bias"]
