"""Valid PyTorch that used to fail late or unclearly: each now trains as a plain PyTorch loop
written here does (parametrizations, a GRU's `zeros(1, B, H)` under export, an in-place op
first in a stage, a frozen parameter forward never reads, peft without a task type), or is
a `PlanError` before anything runs (a `param_groups` typo, a batch of another dtype)."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from torch import nn

import piper_nb as pn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plain import assert_like, tiny_llama  # noqa: E402

pytestmark = pytest.mark.dist
S = pn.schedules
RTOL, ATOL = 1e-5, 4e-5


class Two(nn.Module):
    """Two tagged stages around any modules `a` and `b`."""

    def __init__(self, a: nn.Module, b: nn.Module, spare: nn.Module | None = None):
        super().__init__()
        self.a, self.b = a, b
        if spare is not None:
            self.spare = spare

    def forward(self, x):
        return self.b(self.a(x))

    def loss_fn(self, out, y):
        return nn.functional.mse_loss(out, y)


def plain_loop(model, batch, steps: int, microbatches: int, lr: float):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(batch[0].chunk(microbatches), batch[1].chunk(microbatches),
                          strict=True):
            loss = model.loss_fn(model(xs), ys) / microbatches
            loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
    return losses, model.state_dict()


def trains_like_pytorch(cluster, model, batch, capture: str, annotations=None, steps: int = 2):
    spec = pn.annotate(model, annotations or {"a": {"PP": 0}, "b": {"PP": 1}})
    plan = pn.compile(spec, S.one_f_one_b(2, 2, place=True), batch, capture=capture)
    result = pn.train(plan, batch, steps, pn.optim.SGD(0.1), cluster=cluster)
    losses, state = plain_loop(model, batch, steps, plan.microbatches, 0.1)
    assert_like(result, losses, state)
    return result


def _batch(*shape):
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, *shape, generator=g), torch.randn(8, *shape, generator=g)


@pytest.mark.parametrize("kind, capture", [("weight_norm", "fx"), ("weight_norm", "export"),
                                           ("spectral_norm", "fx")])
def test_parametrized_weights_train_their_parametrization(cluster2, capture, kind):
    """What trains is the parametrization's own parameters (`original0/1`, `original`), and
    spectral_norm's power-iteration buffers move as in one process."""
    torch.manual_seed(0)
    wrap = getattr(nn.utils.parametrizations, kind)
    model = Two(wrap(nn.Linear(8, 8)), nn.Linear(8, 8))
    result = trains_like_pytorch(cluster2, model, _batch(8), capture)
    assert any("parametrizations.weight.original" in k for k in result.state_dict())


def test_spectral_norm_under_export_is_refused_with_the_fix():
    model = Two(nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8)), nn.Linear(8, 8))
    spec = pn.annotate(model, {"a": {"PP": 0}, "b": {"PP": 1}})
    with pytest.raises(pn.PlanError, match=r"a.weight is parametrized by _SpectralNorm .*"
                                           r"capture='fx'"):
        pn.compile(spec, S.one_f_one_b(2, 2, place=True), _batch(8), capture="export")


class GRUStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(8, 8, batch_first=True)

    def forward(self, x):
        h0 = torch.zeros(1, x.shape[0], 8)      # the batch size read from the input
        return self.gru(x, h0)[0]


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_gru_with_its_initial_state_made_from_the_batch_size(cluster2, capture):
    torch.manual_seed(0)
    trains_like_pytorch(cluster2, Two(GRUStage(), nn.Linear(8, 8)), _batch(3, 8), capture)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_an_in_place_op_first_in_a_stage(cluster2, capture):
    torch.manual_seed(0)
    model = Two(nn.Linear(8, 8), nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8)))
    trains_like_pytorch(cluster2, model, _batch(8), capture)


@pytest.mark.parametrize("tagged", [True, False])
def test_a_frozen_parameter_forward_never_reads_is_allowed(cluster2, tagged):
    """A spare frozen head: PyTorch trains around it, and so does the plan; it comes back in
    the state dict unchanged."""
    torch.manual_seed(0)
    model = Two(nn.Linear(8, 8), nn.Linear(8, 8), spare=nn.Linear(8, 8))
    model.spare.requires_grad_(False)
    annotations = {"a": {"PP": 0}, "b": {"PP": 1}, **({"spare": {"PP": 1}} if tagged else {})}
    result = trains_like_pytorch(cluster2, model, _batch(8), "fx", annotations)
    assert torch.equal(result.state_dict()["spare.weight"], model.spare.weight)


def test_an_unused_trainable_parameter_is_still_refused():
    model = Two(nn.Linear(8, 8), nn.Linear(8, 8), spare=nn.Linear(8, 8))
    spec = pn.annotate(model, {"a": {"PP": 0}, "b": {"PP": 1}, "spare": {"PP": 1}})
    with pytest.raises(pn.PlanError, match=r"spare.weight, spare.bias are never used"):
        pn.compile(spec, S.one_f_one_b(2, 2, place=True), _batch(8))


def test_a_param_groups_pattern_that_matches_nothing_is_a_plan_error():
    model = Two(nn.Linear(8, 8), nn.Linear(8, 8))
    plan = pn.compile(pn.annotate(model, {"a": {"PP": 0}, "b": {"PP": 1}}),
                      S.one_f_one_b(2, 2, place=True), _batch(8))
    with pytest.raises(pn.PlanError, match=r"param_groups\[1\] pattern '\*.bais' matches no "
                                           r"parameter or module \(did you mean"):
        pn.train(plan, _batch(8), 1, pn.optim.SGD(0.1),
                 param_groups=[{"params": ["a.*"], "lr": 0.5},
                               {"params": ["*.bais"], "weight_decay": 0.0}])
    from piper_nb.optim import check_optimizer
    recipe = check_optimizer(pn.optim.SGD(0.1), param_groups=[{"params": ["*norm*", "*.bias"]}])
    recipe.check_patterns(["a.weight", "a.bias"], "here")   # one pattern matching is enough
    with pytest.raises(pn.PlanError, match=r"reference_train: param_groups\[0\]"):
        pn.reference_train(model, _batch(8), 1, 2, pn.optim.SGD(0.1),
                           param_groups=[{"params": ["head.*"], "lr": 0.5}])


def test_a_batch_of_another_dtype_fails_as_pytorch_does_before_anything_runs():
    """float64 data into a float32 model: PyTorch's own error, named by region and batch, at
    compile; a later float64 batch in pn.train is the same error naming the step."""
    model = Two(nn.Linear(8, 8), nn.Linear(8, 8))
    spec = pn.annotate(model, {"a": {"PP": 0}, "b": {"PP": 1}})
    wide = tuple(t.double() for t in _batch(8))
    with pytest.raises(pn.PlanError, match=r"region PP=0 fails on the example batch \(inputs "
                                           r"\[4, 8\] float64.*same dtype"):
        pn.compile(spec, S.one_f_one_b(2, 2, place=True), wide)
    plan = pn.compile(spec, S.one_f_one_b(2, 2, place=True), _batch(8))
    with pytest.raises(pn.PlanError, match=r"step 2: a batch whose 'inputs' is \[8, 8\] float64 "
                                           r"\(the plan is for \[8, 8\] float32\) cannot be "
                                           r"trained: .*same dtype"):
        pn.train(plan, iter([_batch(8), wide]), 2, pn.optim.SGD(0.1))


def test_peft_without_a_task_type_uses_the_models_own_loss():
    """A PeftModel without task_type forwards **kwargs to the model, whose forward takes
    labels: its loss is the model's, not 'has no loss'."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base = tiny_llama(transformers)
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(3, 32, (4, 6), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    ref = pn.reference_train(model, batch, 1, 2, pn.optim.SGD(0.1))
    plain = copy.deepcopy(model)
    want = sum(float(plain(**{k: v[i:i + 2] for k, v in batch.items()}).loss) / 2
               for i in (0, 2))
    assert ref.losses[0] == pytest.approx(want, rel=1e-6)
