"""Ordinary PyTorch semantics under every plan: skip edges across stages, frozen weights,
BatchNorm buffers, dropout seeds, untagged modules, weights tied across stages under ZeRO,
and optimizers that cannot be built. Each compared with `pn.reference_train`."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import piper_nb as pn
from piper_nb.train import reference_train, train

pytestmark = pytest.mark.dist

SGD = pn.optim.SGD(0.05, momentum=0.9)
ADAMW = pn.optim.AdamW(1e-2)


class Chain(nn.Module):
    """Linear stages `s.0`..`s.{n-1}` with tanh; `skips` adds stage a's output to stage b's."""

    def __init__(self, n: int = 4, dim: int = 8, skips=(), frozen=(), norm=(), drop: float = 0.0):
        super().__init__()
        torch.manual_seed(0)
        self.s = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n))
        self.norm = nn.ModuleDict({str(i): nn.BatchNorm1d(dim) for i in norm})
        self.drop = nn.Dropout(drop)
        self.skips = tuple(skips)
        for i in frozen:
            self.s[i].requires_grad_(False)

    def forward(self, x):
        outs = []
        for i, stage in enumerate(self.s):
            x = stage(x)
            for a, b in self.skips:
                if b == i:
                    x = x + outs[a]
            if str(i) in self.norm:
                x = self.norm[str(i)](x)
            x = self.drop(torch.tanh(x))
            outs.append(x)
        return x

    def loss_fn(self, out, y):
        return F.mse_loss(out, y)


def stages(model: Chain) -> dict:
    tags = {f"s.{i}": {"PP": i} for i in range(len(model.s))}
    tags |= {f"norm.{i}": {"PP": int(i)} for i in model.norm}
    return tags


def batch(n: int = 16, dim: int = 8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, dim, generator=g), torch.randn(n, dim, generator=g)


def run(model, program, cluster, steps=3, opt=SGD, ref_micro=None, annotation=None):
    data = batch()
    plan = pn.compile(pn.annotate(model, annotation or stages(model)), program, data)
    result = train(plan, data, steps, opt, cluster=cluster)
    ref = reference_train(model, data, steps, ref_micro or plan.microbatches, opt)
    return plan, result, ref


SCHEDULES = {
    "interleaved": lambda: pn.schedules.interleaved_1f1b(2, 4, chunks=2, place=True),
    "dualpipev": lambda: pn.schedules.dualpipev(2, 4, place=True),
    "dualpipe": lambda: pn.schedules.dualpipe(4, 8, place=True),   # 4 ranks
}


@pytest.mark.parametrize("schedule,skip", [
    ("interleaved", (0, 3)),   # a value read on another rank by a later chunk
    ("interleaved", (1, 2)),   # ... and by the next chunk of the same rank
    ("dualpipev", (0, 2)),     # a value read by both arms of a V on one rank
    ("dualpipev", (1, 3)),
    ("dualpipe", (0, 3)),      # the two directions of full DualPipe
])
def test_skip_edges_across_stages_train_like_one_process(request, same, schedule, skip):
    cluster = request.getfixturevalue("cluster4" if schedule == "dualpipe" else "cluster2")
    model = Chain(skips=[skip])
    _, result, ref = run(model, SCHEDULES[schedule](), cluster)
    same(result, ref, model)


def test_a_frozen_layer_stays_frozen_and_holds_no_optimizer_state(cluster2, same):
    model = Chain(n=2, frozen=[1])
    frozen = model.s[1].weight.detach().clone()
    program = [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
               *pn.schedules.one_f_one_b(2, 4)]
    plan, result, ref = run(model, program, cluster2, opt=ADAMW)
    same(result, ref, model)
    assert torch.equal(result.state_dict()["s.1.weight"], frozen)
    assert plan.frozen == ("s.1.bias", "s.1.weight")
    u = next(i for i in plan[1].instrs if i.kind == "U")
    assert u.data.params == ()   # nothing to update on the frozen stage
    assert max(m.optim for m in result.trace.memory if m.device == 1) == 0
    assert max(m.grads for m in result.trace.memory if m.device == 1) == 0
    predicted = pn.simulate(plan, pn.CostModel.uniform(),
                            memory=pn.MemorySettings(optimizer=ADAMW))
    assert [m[2:] for m in _samples(predicted, 1)] == [m[2:] for m in _samples(result.trace, 1)]


def _samples(trace, device: int) -> list[tuple]:
    return [(m.device, m.time, m.params, m.grads, m.optim, m.activations, m.buffers)
            for m in trace.memory if m.device == device]


def test_frozen_weights_under_zero3_are_held_in_full(cluster2, same):
    model = Chain(n=2, frozen=[0])
    program = [pn.replicate({}, [0, 1], zero=3), pn.split({}, "MB", 2)]
    plan, result, ref = run(model, program, cluster2, annotation={"": {"PP": 0}})
    same(result, ref, model)
    assert all("s.0.weight" not in b.params for b in plan.buckets)


def test_batchnorm_running_statistics_train_and_come_back(cluster2, same):
    model = Chain(n=2, norm=[0, 1])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    program = [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
               *pn.schedules.one_f_one_b(2, 4)]
    _, result, ref = run(model, program, cluster2)
    # compile ran every region once in training mode: the model is as it was
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    same(result, ref, model)
    assert int(result.state_dict()["norm.0.num_batches_tracked"]) == 3 * 4
    # a second run on the same workers starts from the model's buffers again
    again = train(pn.compile(pn.annotate(model, stages(model)), program, batch()), batch(), 3,
                  SGD, cluster=cluster2)
    same(again, ref, model)


@pytest.mark.parametrize("zero", [0, 3])
def test_batchnorm_under_data_parallel_normalizes_the_whole_microbatch(cluster2, same, zero):
    """Replicas sum BatchNorm's statistics over their group (SyncBatchNorm, on CPU too):
    losses, weights and running statistics equal one process's."""
    model = Chain(n=2, norm=[0, 1])
    program = [pn.replicate({}, [0, 1], zero=zero), pn.split({}, "MB", 2)]
    _, result, ref = run(model, program, cluster2, annotation={"": {"PP": 0}})
    same(result, ref, model)
    assert int(result.state_dict()["norm.0.num_batches_tracked"]) == 3 * 2


def test_batchnorm_under_pp2_x_dp2(cluster4, same):
    model = Chain(n=2, norm=[0, 1])
    program = [pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
               pn.replicate({"PP": 0}, [0, 2]), pn.replicate({"PP": 1}, [1, 3]),
               *pn.schedules.one_f_one_b(2, 4)]
    _, result, ref = run(model, program, cluster4)
    same(result, ref, model)


def test_batchnorm_on_both_copies_of_a_dualpipe_stage_is_refused():
    model = Chain(n=2, norm=[0])
    with pytest.raises(pn.PlanError, match=r"region \{PP=0\} changes buffers norm.0.running_mean"
                                           r".* forwards run on devices \[0, 1\]"):
        pn.compile(pn.annotate(model, stages(model)), pn.schedules.dualpipe(2, 4, place=True),
                   batch())


def test_dropout_is_reproducible_with_a_seed(cluster2):
    model = Chain(n=2, drop=0.3)
    plan = pn.compile(pn.annotate(model, stages(model)),
                      [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
                       *pn.schedules.one_f_one_b(2, 4)], batch())
    torch.manual_seed(1)
    a = train(plan, batch(), 2, SGD, cluster=cluster2)
    torch.manual_seed(1)
    b = train(plan, batch(), 2, SGD, cluster=cluster2)
    c = train(plan, batch(), 2, SGD, cluster=cluster2, seed=7)
    d = train(plan, batch(), 2, SGD, cluster=cluster2, seed=7)
    assert a.losses == b.losses and c.losses == d.losses and a.losses != c.losses
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k])


@pytest.mark.parametrize("recompute", [False, True])
def test_dropout_across_stages_equals_the_seeded_reference(cluster2, same, recompute):
    """`reference_train(spec, ..., seed=)` draws each stage's masks as the plan's forwards
    do (seeded per step, stage and microbatch): 1F1B over two devices, with the first stage
    recomputed or not, equals it; another seed does not."""
    model = Chain(n=2, drop=0.3)
    spec = pn.annotate(model, stages(model))
    plan = pn.compile(spec, [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
                             *pn.schedules.one_f_one_b(2, 4),
                             *([pn.recompute({"PP": 0})] if recompute else [])], batch())
    got = train(plan, batch(), 2, SGD, cluster=cluster2, seed=7)
    same(got, reference_train(spec, batch(), 2, 4, SGD, seed=7))
    other = reference_train(spec, batch(), 2, 4, SGD, seed=8)
    assert abs(other.losses[0] - got.losses[0]) > 1e-4


def test_an_unannotated_model_is_seeded_as_one_region(cluster2, same):
    """A plain module given to the seeded reference is the one region `PP=0` an unannotated
    plan is: a two-replica... one-device plan of it draws the same masks."""
    model = Chain(n=2, drop=0.3)
    plan = pn.compile(pn.annotate(model), [pn.place({}, [0])], batch())
    same(train(plan, batch(), 2, SGD, seed=3), reference_train(model, batch(), 2, 1, SGD, seed=3))


def test_the_reference_seed_must_be_an_integer():
    with pytest.raises(pn.PlanError, match="reference_train: seed must be an integer, got '7'"):
        reference_train(Chain(n=2), batch(), 1, 1, SGD, seed="7")


class Untagged(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.act, self.b = nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.act(self.a(x)))

    def loss_fn(self, out, y):
        return F.mse_loss(out, y)


def test_an_untagged_module_without_parameters_joins_its_caller(cluster2, same):
    model = Untagged()
    program = [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
               *pn.schedules.one_f_one_b(2, 2)]
    plan, result, ref = run(model, program, cluster2,
                            annotation={"a": {"PP": 0}, "b": {"PP": 1}})
    assert plan.regions[0].modules == ("a", "act")
    same(result, ref, model)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_weights_tied_across_stages_train_under_zero_on_pp2_dp2(cluster4, same, zero):
    model = pn.models.TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16, tie_embeddings=True)
    data = model.example_batch(batch_size=8, seed=0)
    program = [pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
               pn.replicate({"PP": 0}, [0, 2], zero=zero),
               pn.replicate({"PP": 1}, [1, 3], zero=zero), *pn.schedules.one_f_one_b(2, 4)]
    plan = pn.compile(pn.annotate(model, pn.cut_stages(model, 2)), program, data)
    (tied,) = [b for b in plan.buckets if "embed.tok.weight" in b.params]
    assert tied.group == (0, 1, 2, 3) and tied.zero == zero
    result = train(plan, data, 3, ADAMW, cluster=cluster4)
    same(result, reference_train(model, data, 3, 4, ADAMW), model)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_over_the_two_copies_of_dualpipe_stages(cluster2, same, zero):
    model = pn.models.TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16, tie_embeddings=True)
    data = model.example_batch(batch_size=8, seed=0)
    program = [*pn.schedules.dualpipe(2, 4, place=True),
               pn.replicate({"PP": 0}, [0, 1], zero=zero),
               pn.replicate({"PP": 1}, [0, 1], zero=zero)]
    plan = pn.compile(pn.annotate(model, pn.cut_stages(model, 2)), program, data)
    assert {b.zero for b in plan.buckets} == {zero}
    result = train(plan, data, 3, ADAMW, cluster=cluster2)
    same(result, reference_train(model, data, 3, 4, ADAMW), model)


def test_an_optimizer_that_cannot_be_built_is_refused_before_anything_runs():
    model = Chain(n=2)
    plan = pn.compile(pn.annotate(model, stages(model)),
                      [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
                       *pn.schedules.one_f_one_b(2, 2)], batch())

    class Broken:   # a cluster that fails the test if anything reaches it
        def reset(self, *a):
            raise AssertionError("a worker was asked to run")

    with pytest.raises(pn.PlanError, match=r"torch.optim.AdamW instance, bound to this process's "
                                           r"parameters; pass a factory .*partial"):
        train(plan, batch(), 2, torch.optim.AdamW(model.parameters()), cluster=Broken())
    with pytest.raises(pn.PlanError, match=r"is the class; pass an instance"):
        train(plan, batch(), 2, pn.optim.AdamW, cluster=Broken())
    with pytest.raises(pn.PlanError, match="reference_train: optimizer"):
        reference_train(model, batch(), 2, 2, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(pn.PlanError, match="building the optimizer .* failed: TypeError"):
        train(plan, batch(), 2, functools.partial(torch.optim.SGD, learning_rate=0.1),
              cluster=Broken())
    with pytest.raises(pn.PlanError, match="clip_grad_norm must be a positive number"):
        train(plan, batch(), 2, torch.optim.SGD, clip_grad_norm=-1.0, cluster=Broken())


class Shared(nn.Module):
    """`out(shared(mid(shared(inp(x)))))`: `shared` is tagged with stage 0 and called again
    after stage 1, so stage 0 comes back (region {PP=0,SEG=1})."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.shared, self.mid, self.out = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        x = torch.tanh(self.shared(torch.tanh(self.inp(x))))
        return self.out(torch.tanh(self.shared(torch.tanh(self.mid(x)))))

    def loss_fn(self, out, y):
        return F.mse_loss(out, y)


SHARED_TAGS = {"inp": {"PP": 0}, "shared": {"PP": 0}, "mid": {"PP": 1}, "out": {"PP": 1}}


@pytest.mark.parametrize("schedule", [
    lambda: pn.schedules.gpipe(2, 4, place=True),
    lambda: pn.schedules.one_f_one_b(2, 4, place=True),
    lambda: pn.schedules.zero_bubble(2, 4, place=True),
    lambda: pn.schedules.dualpipe(2, 4, place=True),
    lambda: pn.schedules.from_grid("0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1", place=True),
], ids=["gpipe", "1f1b", "zb1p", "dualpipe", "grid"])
def test_a_module_called_from_two_stages_runs_under_every_schedule(cluster2, same, schedule):
    model = Shared()
    plan, result, ref = run(model, schedule(), cluster2, annotation=SHARED_TAGS)
    assert [r.name for r in plan.regions] == ["PP=0", "PP=1", "PP=0,SEG=1", "PP=1,SEG=1"]
    same(result, ref, model)
