"""Models written for torch.distributed.pipelining: `pipe_split()` in forward and
`split_spec` give the regions of the equivalent pn.annotate, and train like one process."""

import os
import sys

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipe_split

import piper_nb as pn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "runtime"))
from plain import assert_like, plain_loop, tiny_llama  # noqa: E402

D = 8


def mse(out, y):
    return nn.functional.mse_loss(out, y)


class RootParams(nn.Module):
    """Shaped like torch's zoo `ExampleCode`: parameters and a buffer on the root module,
    read by operations of the root forward on both sides of each split."""

    def __init__(self):
        super().__init__()
        self.mm_param0 = nn.Parameter(torch.randn(D, D) / D)
        self.mm_param1 = nn.Parameter(torch.randn(D, D) / D)
        self.register_buffer("cval", torch.randn(D))
        self.lin0 = nn.Linear(D, D)
        self.lin1 = nn.Linear(D, D)

    def forward(self, x):
        x = torch.relu(torch.mm(x, self.mm_param0))
        pipe_split()
        x = self.lin0(torch.mm(x, self.mm_param1))
        pipe_split()
        x = torch.relu(x) + self.cval
        return self.lin1(x)

    loss_fn = staticmethod(mse)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Stack(nn.Module):
    """Like the zoo's `MultiMLP`: a list of blocks, a split after each but the last."""

    def __init__(self, n=4, split=True):
        super().__init__()
        self.layers = nn.ModuleList(Mlp() for _ in range(n))
        self.split = split

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if self.split and i < len(self.layers) - 1:
                pipe_split()
        return x

    loss_fn = staticmethod(mse)


class Aliased(nn.Module):
    """Like the zoo's `ModelWithParamAlias`: one parameter and one module under two names,
    used on both sides of the split."""

    def __init__(self):
        super().__init__()
        self.mm_param = self.mm_alias = nn.Parameter(torch.randn(D, D) / D)
        self.lin = self.lin_alias = nn.Linear(D, D)

    def forward(self, x):
        x = self.lin(torch.mm(x, self.mm_param))
        pipe_split()
        return self.lin_alias(torch.mm(torch.tanh(x), self.mm_alias))

    loss_fn = staticmethod(mse)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, D, generator=g), torch.randn(8, D, generator=g)


def shape(plan):
    return [(r.name, r.modules, r.params, r.buffers) for r in plan.capture.regions]


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_pipe_split_gives_the_regions_of_the_equivalent_annotation(capture):
    torch.manual_seed(0)
    model = Stack()
    by_split = pn.compile(model, pn.schedules.gpipe(4, 4, place=True), batch(), capture=capture)
    model.split = False
    by_tags = pn.compile(pn.annotate(model, {f"layers.{i}": {"PP": i} for i in range(4)}),
                         pn.schedules.gpipe(4, 4, place=True), batch(), capture=capture)
    assert [r.name for r in by_split.regions] == ["PP=0", "PP=1", "PP=2", "PP=3"]
    assert shape(by_split) == shape(by_tags)


@pytest.mark.parametrize("points", [
    {"layers.1": SplitPoint.BEGINNING, "layers.3": SplitPoint.BEGINNING},
    {"layers.0": SplitPoint.END, "layers.2": "end"},     # the same cut, after layers 0, 2
])
def test_split_spec_gives_the_regions_of_the_equivalent_annotation(points):
    torch.manual_seed(0)
    model = Stack(split=False)
    tags = {"layers.0": {"PP": 0}, "layers.[12]": {"PP": 1}, "layers.3": {"PP": 2}}
    by_spec = pn.compile(pn.annotate(model, split_spec=points), pn.schedules.gpipe(3, 4, place=True),
                         batch())
    by_tags = pn.compile(pn.annotate(model, tags), pn.schedules.gpipe(3, 4, place=True), batch())
    assert shape(by_spec) == shape(by_tags)
    assert not any(hasattr(m, "_pn_split_point") or m._forward_pre_hooks or m._forward_hooks
                   for m in model.modules())   # the model is left as it was


@pytest.mark.dist
def test_hugging_face_llama_with_torchs_split_spec_trains_like_one_process(cluster2):
    import transformers
    model = tiny_llama(transformers)
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
    data = {"input_ids": ids, "labels": ids}
    program = pn.schedules.one_f_one_b(2, 2, place=True)
    plan = pn.compile(pn.annotate(model, split_spec={"model.layers.1": SplitPoint.BEGINNING}),
                      program, data)
    tags = pn.compile(pn.annotate(model, {"model.embed_tokens": {"PP": 0},
                                          "model.layers.0": {"PP": 0}, "model.layers.1": {"PP": 1},
                                          "model.norm": {"PP": 1}, "lm_head": {"PP": 1}}),
                      program, data)
    assert shape(plan) == shape(tags)     # the masks and rotary tables recomputed, not sent
    assert [r.inputs for r in plan.capture.regions] == [r.inputs for r in tags.capture.regions]
    result = pn.train(plan, [data], 1, pn.optim.SGD(0.1), cluster=cluster2)
    assert_like(result, *plain_loop(model, [data], 2, 0.1))


def test_root_parameters_go_with_the_stage_that_reads_them():
    torch.manual_seed(0)
    plan = pn.compile(RootParams(), pn.schedules.gpipe(3, 2, place=True), batch())
    held = {r.name: set(r.params) | set(r.buffers) for r in plan.capture.regions}
    assert held == {"PP=0": {"mm_param0"}, "PP=1": {"mm_param1", "lin0.weight", "lin0.bias"},
                    "PP=2": {"cval", "lin1.weight", "lin1.bias"}}


@pytest.mark.dist
@pytest.mark.parametrize("make, stages, schedule", [
    (RootParams, 3, "gpipe"), (Stack, 4, "one_f_one_b"), (Aliased, 2, "one_f_one_b"),
])
def test_zoo_models_train_like_one_process(make, stages, schedule, cluster4, one_thread):
    torch.manual_seed(0)
    model = make()
    data = [batch(0), batch(1)]
    program = getattr(pn.schedules, schedule)(stages, 4, place=True)
    plan = pn.compile(model, program, data[0])
    result = pn.train(plan, data, 2, pn.optim.SGD(0.1), cluster=cluster4)
    want_losses, want_state = plain_loop(model, data, 4, 0.1, mse)
    assert_like(result, want_losses, want_state)
    ref = pn.reference_train(model, data, 2, plan.reference_microbatches, pn.optim.SGD(0.1))
    torch.testing.assert_close(torch.tensor(ref.losses), torch.tensor(want_losses),
                               rtol=1e-5, atol=4e-5)


def test_split_spec_naming_no_module_is_a_plan_error():
    with pytest.raises(pn.PlanError, match=r"no submodule 'layer.1'.*did you mean layers.1"):
        pn.annotate(Stack(split=False), split_spec={"layer.1": SplitPoint.BEGINNING})
    with pytest.raises(pn.PlanError, match="SplitPoint.BEGINNING or SplitPoint.END"):
        pn.annotate(Stack(split=False), split_spec={"layers.1": "middle"})


def test_stages_marked_two_ways_is_a_plan_error():
    with pytest.raises(pn.PlanError, match="mark the stages one way"):
        pn.annotate(Stack(split=False), {"layers.0": {"PP": 0}},
                    split_spec={"layers.1": SplitPoint.BEGINNING})
    with pytest.raises(pn.PlanError, match="calls pipe_split.*mark the stages one way"):
        pn.compile(pn.annotate(Stack(), {"layers.0": {"PP": 0}}), pn.schedules.gpipe(4, 4, place=True),
                   batch())
