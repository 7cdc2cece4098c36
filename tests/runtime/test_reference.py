"""Optimizers: torch.optim built from factories, element-wise ones exact shard by shard; and
`pn.reference_train`, plain single-process training with microbatches."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import piper_nb as pn
from piper_nb import optim
from piper_nb.train import Result, reference_train


@pytest.mark.parametrize("ours,theirs,kwargs", [
    (optim.SGD(0.1), torch.optim.SGD, {"lr": 0.1}),
    (optim.SGD(0.1, momentum=0.9, weight_decay=0.01), torch.optim.SGD,
     {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    (optim.AdamW(1e-2), torch.optim.AdamW, {"lr": 1e-2}),
    (optim.AdamW(3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1), torch.optim.AdamW,
     {"lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}),
])
def test_pn_optim_builds_the_torch_optimizer(ours, theirs, kwargs):
    g = torch.Generator().manual_seed(0)
    p = torch.randn(37, generator=g).requires_grad_(True)
    q = p.detach().clone().requires_grad_(True)
    a, b = theirs([p], foreach=False, **kwargs), ours([q])
    assert type(b) is theirs
    for _ in range(5):
        grad = torch.randn(37, generator=g)
        p.grad, q.grad = grad.clone(), grad.clone()
        a.step()
        b.step()
        assert torch.equal(p.detach(), q.detach())


ELEMENTWISE = [torch.optim.SGD, functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
               torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
               torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam]


@pytest.mark.parametrize("factory", ELEMENTWISE)
def test_element_wise_optimizers_update_flat_pieces_as_whole_tensors(factory):
    spec = optim.check_optimizer(factory)
    assert spec.elementwise and spec.requires_whole() is None
    assert optim._probe_elementwise(spec)   # the claim, checked by running it


def test_an_optimizer_that_is_not_element_wise_is_found_out():
    spec = optim.check_optimizer(functools.partial(torch.optim.Adafactor, lr=1e-2))
    assert not spec.elementwise and "factored" in spec.requires_whole()
    assert not optim._probe_elementwise(spec)


def test_shard_pieces_are_runs_of_one_group_inside_one_shard():
    sizes = [("a.weight", 5), ("a.bias", 3), ("b.weight", 4)]   # 12 elements, 3 shards of 4
    group = lambda n: 1 if n.endswith("bias") else 0
    assert optim.shard_pieces(sizes, 4, 0, group) == [("a.weight", 0, 4, 0)]
    assert optim.shard_pieces(sizes, 4, 1, group) == [("a.weight", 0, 1, 0), ("a.bias", 1, 4, 1)]
    assert optim.shard_pieces(sizes, 4, 2, group) == [("b.weight", 0, 4, 0)]
    assert optim.shard_pieces(sizes, 4, 1, lambda n: 0) == [("a.weight", 0, 4, 0)]
    assert optim.shard_pieces(sizes, 5, 2, group) == [("b.weight", 0, 2, 0)]   # 3 padding


def test_param_groups_match_names_or_module_paths_first_match_wins():
    spec = optim.check_optimizer(torch.optim.AdamW, param_groups=[
        {"params": ["*norm*", "*.bias"], "weight_decay": 0.0},
        {"params": "blocks.0", "lr": 1e-4}])
    assert spec.group_of("blocks.1.norm.weight") == 0
    assert spec.group_of("blocks.0.attn.bias") == 0
    assert spec.group_of("blocks.0.attn.weight") == 1      # by its module path
    assert spec.group_of("blocks.10.attn.weight") == 2     # the default group
    assert spec.state_bytes((3, 5)) == 15 * 8 + 4         # exp_avg, exp_avg_sq, step


def test_a_spec_given_groups_or_a_scheduler_keeps_what_it_had():
    def warmup(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    no_decay = [{"params": "*.bias", "weight_decay": 0.0}]
    grouped = optim.check_optimizer(torch.optim.AdamW, param_groups=no_decay)
    both = optim.check_optimizer(grouped, lr_scheduler=warmup)
    assert both.groups == grouped.groups and both.scheduler is warmup
    again = optim.check_optimizer(both, param_groups=[{"params": "*norm*", "lr": 1e-4}])
    assert again.scheduler is warmup and again.group_of("a.bias") == 1   # groups replaced
    assert again.group_of("norm.weight") == 0 and again.factory is torch.optim.AdamW


def test_optimizer_configs_are_checked():
    with pytest.raises(pn.PlanError, match="sets 'weight_dcay', which AdamW does not have"):
        optim.check_optimizer(torch.optim.AdamW, param_groups=[{"params": "*.bias",
                                                                  "weight_dcay": 0.0}])
    with pytest.raises(pn.PlanError, match="LBFGS needs a closure"):
        optim.check_optimizer(torch.optim.LBFGS)
    with pytest.raises(ValueError, match="lr"):
        optim.SGD(0)
    with pytest.raises(ValueError, match="momentum"):
        optim.SGD(0.1, momentum=1.5)
    with pytest.raises(ValueError, match="betas"):
        optim.AdamW(1e-3, betas=(0.9, 1.0))
    with pytest.raises(AttributeError):
        optim.SGD(0.1).lr = 1.0  # frozen


def test_reference_leaves_the_model_alone_and_traces_its_step():
    """The loop itself is checked line by line against plain PyTorch in
    tests/runtime/test_torch_optim.py; here, what it returns."""
    model = pn.models.MLP(dim=8, depth=3)
    batch = model.example_batch(batch_size=8, seed=1)
    before = copy.deepcopy(model.state_dict())
    result = reference_train(model, batch, steps=3, microbatches=2,
                             optimizer=optim.SGD(0.1, momentum=0.9))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched
    assert any(not torch.equal(before[k], v) for k, v in result.state_dict().items())
    assert isinstance(result, Result) and len(result.step_times) == 3
    assert len(result.metrics) == 3 and result.grad_norms == [None] * 3
    assert result.lrs == [0.1] * 3
    assert result.trace.source == "measured"
    assert [e.label for e in result.trace.events] == ["r0:F0", "r0:B0", "r0:F1", "r0:B1", "r0:U"]


def test_reference_state_dict_keeps_tied_names():
    model = pn.models.TinyGPT(vocab=32, dim=16, layers=1, heads=2, seq=8, tie_embeddings=True)
    batch = model.example_batch(batch_size=4, seed=0)
    sd = reference_train(model, batch, 1, 2, optim.AdamW(1e-2)).state_dict()
    assert sd.keys() == model.state_dict().keys()
    assert torch.equal(sd["head.proj.weight"], sd["embed.tok.weight"])
    assert not torch.equal(sd["embed.tok.weight"], model.embed.tok.weight)


def test_reference_rejects_uneven_microbatches():
    model = pn.models.MLP(dim=4, depth=1)
    with pytest.raises(pn.PlanError, match="do not divide"):
        reference_train(model, model.example_batch(batch_size=6), 1, 4, optim.SGD(0.1))
