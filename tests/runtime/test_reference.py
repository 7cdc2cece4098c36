"""`pn.optim` does torch.optim's arithmetic, shard by shard, and `pn.reference_train` is
plain single-process training with microbatches."""

from __future__ import annotations

import copy

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
def test_optimizers_match_torch_bit_for_bit(ours, theirs, kwargs):
    g = torch.Generator().manual_seed(0)
    p = torch.randn(37, generator=g).requires_grad_(True)
    q = p.detach().clone()
    opt, state = theirs([p], foreach=False, **kwargs), {}
    for step in range(1, 6):
        grad = torch.randn(37, generator=g)
        p.grad = grad.clone()
        opt.step()
        ours.step(q, grad, state, step)
        assert torch.equal(p.detach(), q)


@pytest.mark.parametrize("opt", [optim.SGD(0.1, momentum=0.9), optim.AdamW(1e-2)])
def test_sharded_updates_equal_full_updates(opt):
    full = torch.randn(10)
    shards = [full[:5].clone(), full[5:].clone()]
    s_full, s_parts = {}, [{}, {}]
    for step in range(1, 4):
        grad = torch.randn(10)
        opt.step(full, grad, s_full, step)
        for i in range(2):
            opt.step(shards[i], grad[5 * i:5 * i + 5], s_parts[i], step)
    assert torch.equal(torch.cat(shards), full)
    assert opt.state_bytes(s_full) == sum(opt.state_bytes(s) for s in s_parts)


def test_optimizer_configs_are_checked():
    with pytest.raises(ValueError, match="lr"):
        optim.SGD(0)
    with pytest.raises(ValueError, match="momentum"):
        optim.SGD(0.1, momentum=1.5)
    with pytest.raises(ValueError, match="betas"):
        optim.AdamW(1e-3, betas=(0.9, 1.0))
    with pytest.raises(AttributeError):
        optim.SGD(0.1).lr = 1.0  # frozen


def test_reference_matches_plain_torch_loop():
    model = pn.models.MLP(dim=8, depth=3)
    batch = model.example_batch(batch_size=8, seed=1)
    before = copy.deepcopy(model.state_dict())
    result = reference_train(model, batch, steps=3, microbatches=2,
                             optimizer=optim.SGD(0.1, momentum=0.9))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9, foreach=False)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        total = 0.0
        for x, y in zip(batch[0].chunk(2), batch[1].chunk(2), strict=True):
            loss = model.loss_fn(twin(x), y) / 2
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    assert result.losses == pytest.approx(losses, rel=1e-6)
    for k, v in twin.state_dict().items():
        torch.testing.assert_close(result.state_dict()[k], v)
    assert isinstance(result, Result) and len(result.step_times) == 3
    assert result.trace.source == "measured"
    assert [e.label for e in result.trace.events] == ["0F0", "0B0", "0F1", "0B1", "0U"]


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
