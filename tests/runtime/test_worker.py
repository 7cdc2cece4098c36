"""The runtime's pieces without processes: flat layouts, batch slicing, state assembly,
parameter binding, ZeRO-3 release/re-gather under autograd, and a worker running a
single-device plan in this process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import piper_nb as pn
from piper_nb import optim
from piper_nb.plan.instr import parse_free
from piper_nb.runtime.bundle import bind_params, direct_calls, load_bundle, make_bundle, param_aliases
from piper_nb.runtime.layout import Layout, assemble_state, batch_part, bucket_layouts
from piper_nb.runtime.stores import ParamStore, ValueStore
from piper_nb.runtime.worker import Worker
from piper_nb.train import reference_train


def _layout(group=(0, 1, 2), zero=3) -> Layout:
    return Layout(0, ("a", "b"), ((2, 2), (3,)), (0, 4), 7, -(-7 // len(group)), group, zero)


def test_layout_flatten_pads_and_shards():
    lay = _layout()
    a, b = torch.arange(4.0).view(2, 2), torch.tensor([4.0, 5.0, 6.0])
    flat = lay.flatten([a, None], like=a)
    assert flat.tolist() == [0, 1, 2, 3, 0, 0, 0, 0, 0]
    flat = lay.flatten([a, b], like=a)
    assert lay.padded == 9 and lay.my_shard(flat, 2).tolist() == [6.0, 0.0, 0.0]
    va, vb = lay.views(flat)
    assert torch.equal(va, a) and torch.equal(vb, b)


def test_batch_part_takes_microbatch_then_replica():
    t = torch.arange(16)
    assert batch_part(t, 2, 1, 0, 1).tolist() == list(range(8, 16))
    assert batch_part(t, 2, 1, 1, 2).tolist() == [12, 13, 14, 15]
    assert batch_part(t, 4, 0, 1, 2).tolist() == [2, 3]


def test_zero3_release_and_regather_keep_autograd_working():
    lay = _layout(group=(0,))
    init = {"a": torch.randn(2, 2), "b": torch.randn(3)}
    store = ParamStore(["a", "b"], init, {0: lay}, 0, torch.device("cpu"))
    assert not store.gathered(0) and store.bytes()[0] == 7 * 4  # only the shard
    store.acquire(0, store.shards[0].clone())
    assert store.bytes()[0] == 2 * 7 * 4 and torch.equal(store.params["a"].detach(), init["a"])
    x = torch.randn(4, 5, 2, requires_grad=True)  # linear on 3-d input saves a view W.t()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = (F.linear(x, store.params["a"]).sum(-1) * store.params["b"][0]).sum()
    weights = [t for t in saved if t.shape == (2, 2)]
    assert weights
    store.free(0)
    assert not store.gathered(0)  # really released, the saved weight (views) included
    assert all(t.untyped_storage().nbytes() == 0 for t in weights)
    store.acquire(0, store.shards[0].clone())  # a different buffer with the same values
    loss.backward()
    ref_a = init["a"].clone().requires_grad_(True)
    ref_b = init["b"].clone().requires_grad_(True)
    (F.linear(x.detach(), ref_a).sum(-1) * ref_b[0]).sum().backward()
    torch.testing.assert_close(store.params["a"].grad, ref_a.grad)
    torch.testing.assert_close(store.params["b"].grad, ref_b.grad)
    store.acquire(0, store.shards[0].clone())
    store.free(0)
    assert store.gathered(0)  # still one user
    store.free(0)
    assert not store.gathered(0)


def test_value_store_frees_by_key():
    v = ValueStore()
    v.acts[("x", 1)] = torch.ones(2)
    v.add_grad("x", 1, torch.ones(2))
    v.add_grad("x", 1, torch.ones(2))
    assert v.grads[("x", 1)].tolist() == [2.0, 2.0] and v.bytes() == 16
    v.drop(*parse_free("act:x@1"))
    v.drop(*parse_free("grad:x@1"))
    assert v.bytes() == 0


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight = self.a.weight


def test_bind_params_follows_aliases():
    model = _Tied()
    aliases = param_aliases(model)
    assert aliases["b.weight"] == "a.weight"
    holder = nn.Module()
    holder.model = _Tied()
    mine = {n: nn.Parameter(torch.zeros_like(p)) for n, p in model.named_parameters()}
    bind_params(holder, mine, aliases)
    assert holder.model.b.weight is mine["a.weight"] and holder.model.a.weight is mine["a.weight"]
    assert holder.model.b.bias is mine["b.bias"]


def test_direct_calls_reach_each_submodule_by_one_attribute_and_compute_the_same():
    model = pn.models.MLP(dim=8, depth=4)
    batch = model.example_batch(batch_size=4, seed=0)
    plan = pn.compile(pn.annotate(model, pn.cut_stages(model, 2)),
                      pn.schedules.one_f_one_b(2, 2, place=True), batch)
    plain, direct = (load_bundle(make_bundle(plan)).modules[1] for _ in range(2))
    direct.load_state_dict(plain.state_dict())
    direct_calls(direct)
    assert "getattr(" in plain.code and "getattr(" not in direct.code
    first = next(n for n in direct.graph.nodes if n.op == "call_module")
    assert direct.get_submodule(first.target) is direct.get_submodule("model.layers.2.0")
    x = torch.randn(2, 8)
    torch.testing.assert_close(direct(x, batch[1][:2])[0], plain(x, batch[1][:2])[0],
                               rtol=0, atol=0)
    assert dict(direct.named_parameters()).keys() == dict(plain.named_parameters()).keys()


class _NoComm:
    def ensure_groups(self, comms=(), counted=(), batchnorm=()):
        assert not list(comms)

    def barrier(self):
        pass

    def poll(self, pending, clock):
        raise AssertionError("a single-device plan issues no communication")

    def recycle(self):
        pass


def _single_device():
    model = pn.models.TinyGPT(vocab=32, dim=16, layers=2, heads=2, seq=8)
    batch = model.example_batch(batch_size=8, seed=0)
    spec = pn.annotate(model, pn.cut_stages(model, 2))
    plan = pn.compile(spec, [pn.place({}, [0]), pn.split({}, "MB", 4)], batch)
    return model, batch, plan


def test_worker_runs_a_single_device_plan_in_process():
    model, batch, plan = _single_device()
    worker = Worker(0, load_bundle(make_bundle(plan)), _NoComm(), torch.device("cpu"))
    opt = optim.AdamW(1e-3)
    worker.reset(opt)
    losses = [worker.step(batch)["loss"] for _ in range(2)]
    ref = reference_train(model, batch, 2, 4, opt)
    assert losses == pytest.approx(ref.losses, rel=1e-6)
    params = assemble_state(plan, [worker.export_state()])
    for name, value in ref.params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=4e-5)
    out = worker.step(batch)
    assert out["leftover"] == [] and out["memory"][-1].optim > 0
    assert [e.label for e in out["events"]][:2] == ["r0:F0", "r1:F0"]


def test_assemble_state_from_zero3_shards():
    model = pn.models.MLP(dim=4, depth=2)
    batch = model.example_batch(batch_size=4)
    spec = pn.annotate(model, {"layers": {"PP": 0}})
    plan = pn.compile(spec, [pn.replicate({}, [0, 1], zero=3)], batch)
    (lay,) = bucket_layouts(plan).values()
    flat = lay.flatten([p for p in model.parameters()], like=next(model.parameters()))
    parts = [{"full": {}, "shards": {0: (i, lay.my_shard(flat, i))}} for i in (0, 1)]
    got = assemble_state(plan, parts)
    for name, p in model.named_parameters():
        assert torch.equal(got[name], p.detach())
    with pytest.raises(RuntimeError, match="no worker holds"):
        assemble_state(plan, parts[:1])


def test_a_plan_from_json_cannot_be_shipped():
    _, _, plan = _single_device()
    with pytest.raises(pn.PlanError, match="pn.compile"):
        make_bundle(pn.Plan.from_json(plan.to_json()))


def test_receive_buffers_are_recycled_across_steps_once_nothing_holds_them():
    from piper_nb.runtime.comm import Comm
    comm = Comm(0, torch.device("cpu"), "gloo")
    free = comm._recv_buf((4, 8), torch.float32)
    kept = comm._recv_buf((4, 8), torch.float32).detach()   # a stash's leaf still holds it
    assert comm._recv_buf((4, 8), torch.float32) is not free  # within a step: all new
    comm.recycle()                                           # the step is over
    first, second = (comm._recv_buf((4, 8), torch.float32) for _ in range(2))
    assert first is free or second is free                   # reused, not reallocated
    for got in (first, second):                              # the held one never comes back
        assert got.untyped_storage().data_ptr() != kept.untyped_storage().data_ptr()
    assert comm._recv_buf((2, 8), torch.float32).shape == (2, 8)   # other shapes: new
