"""Region segments: a tag combination re-entered after a region that depends on it (MoE
dispatch -> experts -> combine) becomes a new segment, so the region graph stays acyclic."""

import pytest
import torch
from torch import nn

import piper_nb as pn
from piper_nb.capture import run_reference
from piper_nb.capture.region_code import pack_size, unpack_size
from piper_nb.ir.filters import matches
from piper_nb.strategies import moe_annotation


def moe_spec(layers=2, experts=2, stages=2):
    model = pn.models.TinyMoE(layers=layers, experts=experts)
    return model, pn.annotate(model, moe_annotation(layers, experts, stages))


def region_edges(cap):
    return {(cap.producer[v], c) for v, cs in cap.consumers.items() for c in cs
            if cap.producer[v] >= 0}


def assert_acyclic_in_order(cap):
    """Regions are numbered topologically: every value flows to a later region."""
    for src, dst in region_edges(cap):
        assert src < dst, (cap.regions[src].name, cap.regions[dst].name)


def test_moe_regions_are_split_into_segments_and_acyclic():
    _, spec = moe_spec()
    cap = spec.capture()
    assert [r.name for r in cap.regions] == [
        "PP=0", "PP=0,EP=0", "PP=0,EP=1", "PP=0,SEG=1",
        "PP=1", "PP=1,EP=0", "PP=1,EP=1", "PP=1,SEG=1"]
    assert_acyclic_in_order(cap)
    edges = region_edges(cap)
    # dispatch from segment 0, combine into segment 1, never back into segment 0
    assert {(0, 1), (0, 2), (1, 3), (2, 3), (0, 3), (3, 4)} <= edges
    assert not any(dst == 0 for _, dst in edges)
    assert cap.regions[0].modules[-1] == "blocks.0.moe.router"
    assert cap.regions[1].modules == tuple(f"blocks.0.moe.experts.0.{i}" for i in range(3))
    assert cap.regions[7].has_loss and cap.regions[7].modules == ("head.norm", "head.proj")


@pytest.mark.parametrize("layers", [2, 4])
def test_split_moe_computes_the_eager_loss_and_gradients(layers):
    model, spec = moe_spec(layers=layers)
    cap = spec.capture()
    assert_acyclic_in_order(cap)
    x, y = model.example_batch(batch_size=4, seed=1)
    eager = model.loss_fn(model(x), y)
    eager_grads = torch.autograd.grad(eager, list(model.parameters()))
    split = run_reference(cap, x, y)
    torch.testing.assert_close(split, eager)
    split_grads = torch.autograd.grad(split, list(model.parameters()))
    for a, b in zip(split_grads, eager_grads, strict=True):
        torch.testing.assert_close(a, b)


def test_two_blocks_per_stage_number_segments_per_reentry():
    _, spec = moe_spec(layers=4)
    names = [r.name for r in spec.capture().regions]
    assert names == [
        "PP=0", "PP=0,EP=0", "PP=0,EP=1", "PP=0,SEG=1", "PP=0,EP=0,SEG=1", "PP=0,EP=1,SEG=1",
        "PP=0,SEG=2", "PP=1", "PP=1,EP=0", "PP=1,EP=1", "PP=1,SEG=1", "PP=1,EP=0,SEG=1",
        "PP=1,EP=1,SEG=1", "PP=1,SEG=2"]


def test_filters_select_every_segment():
    _, spec = moe_spec(layers=4)
    cap = spec.capture()

    def chosen(f):
        return [r.name for r in cap.regions if matches(f, dict(r.tags))]

    assert chosen({"PP": 0}) == [r.name for r in cap.regions[:7]]
    assert chosen({"PP": 0, "EP": 0}) == ["PP=0,EP=0", "PP=0,EP=0,SEG=1"]
    assert chosen({"PP": 1, "EP": "*"}) == ["PP=1,EP=0", "PP=1,EP=1", "PP=1,EP=0,SEG=1",
                                            "PP=1,EP=1,SEG=1"]


def test_segment_tags_make_unique_dag_node_ids():
    model, spec = moe_spec()
    plan = pn.compile(spec, [pn.place({}, [0]), pn.split({}, "MB", 2)], model.example_batch(4))
    ids = {n.id for n in plan.dag.nodes}
    assert {"F[PP=0,MB=0]", "F[PP=0,SEG=1,MB=0]", "B[PP=0,EP=1,MB=1]", "U[PP=1,SEG=1]"} <= ids


class Skip(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        h0 = self.layers[0](x)
        return self.layers[2](torch.tanh(self.layers[1](h0))) + h0

    def loss_fn(self, out, y):
        return nn.functional.mse_loss(out, y)


@pytest.mark.parametrize("case", ["gpt", "gpt_tied", "mlp", "moe_pp_only", "skip"])
def test_models_without_reentry_keep_their_regions(case):
    if case == "skip":
        model = Skip()
        spec = pn.annotate(model, {f"layers.{i}": {"PP": i} for i in range(3)})
        want = ["PP=0", "PP=1", "PP=2"]
    elif case == "mlp":
        model = pn.models.MLP(depth=4)
        spec = pn.annotate(model, pn.cut_stages(model, 4))
        want = ["PP=0", "PP=1", "PP=2", "PP=3"]
    else:
        model = (pn.models.TinyMoE(layers=2) if case == "moe_pp_only"
                 else pn.models.TinyGPT(layers=2, tie_embeddings=case == "gpt_tied"))
        spec = pn.annotate(model, {"embed": {"PP": 0}, "blocks.0": {"PP": 0},
                                   "blocks.1": {"PP": 1}, "head": {"PP": 1}})
        want = ["PP=0", "PP=1"]
    cap = spec.capture()
    assert [r.name for r in cap.regions] == want
    assert not any("SEG" in dict(r.tags) for r in cap.regions)
    assert_acyclic_in_order(cap)
    if case == "gpt":
        assert cap.regions[0].modules[:2] == ("embed.tok", "embed.pos")
        assert cap.regions[1].modules[-2:] == ("head.norm", "head.proj")
    if case == "gpt_tied":
        assert cap.tied == {"embed.tok.weight": (0, 1)}


class ShapeAcross(nn.Module):
    """`out.reshape(x.shape)` in a later segment: a torch.Size crosses regions."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        with pn.region("PP", 0):
            h = self.a(x)
            flat = h.reshape(-1, h.size(-1))
        with pn.region("EP", 0):
            e = self.b(flat)
        with pn.region("PP", 0):
            out = self.c(e).reshape(h.shape) + h
        return out

    def loss_fn(self, out, y):
        return nn.functional.mse_loss(out, y)


def test_sizes_crossing_segments_travel_as_tensors():
    model = ShapeAcross()
    cap = pn.annotate(model).capture()
    assert [r.name for r in cap.regions] == ["PP=0", "EP=0", "PP=0,SEG=1"]
    x, y = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    torch.testing.assert_close(run_reference(cap, x, y), model.loss_fn(model(x), y))
    (size,) = [v for v in cap.regions[0].outputs if v in cap.regions[2].inputs
               and v not in cap.regions[1].outputs and v != "model_a"]
    # shape propagation sees a one-byte uint8 tensor shaped like h
    plan = pn.compile(pn.annotate(model), [pn.place({}, [0])], (x, y))
    assert (plan.values[size].shape, plan.values[size].dtype) == ((2, 3, 4), "uint8")


@pytest.mark.parametrize("value", [torch.Size([2, 3, 4]), torch.Size([]), 0, 7, -3, 0.5])
def test_pack_size_round_trips_and_survives_zero_filled_inputs(value):
    t = pack_size(value)
    assert unpack_size(t) == value
    if t.dtype in (torch.uint8, torch.int8):  # shape-encoded: the profiler's zeros decode too
        assert unpack_size(torch.zeros(t.shape, dtype=t.dtype)) == value
        assert t.untyped_storage().nbytes() <= 1


class _Counting(nn.Module):
    """A root forward that bumps a buffer no region reads, and builds and drops a cache."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        torch.zeros(3).clone().detach_()   # a dropped cache: no trace left
        return self.b(torch.relu(self.a(x)))


def test_an_op_of_the_root_forward_no_region_reads_names_its_line():
    spec = pn.annotate(_Counting(), {"a": {"PP": 0}, "b": {"PP": 1}})
    with pytest.raises(pn.PlanError) as err:
        pn.compile(spec, [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1])],
                   (torch.randn(4, 4), torch.randn(4, 4)), loss_fn=nn.functional.mse_loss,
                   capture="export")
    msg = str(err.value)
    assert "add_" in msg and "the root forward (_Counting)" in msg, msg
    assert "test_segments.py" in msg and "self.calls.add_(1)" in msg, msg
    assert "detach_" not in msg
