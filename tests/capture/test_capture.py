"""Capture: annotations, patterns, region splitting, skip connections, tied weights."""

import pytest
import torch
from torch import nn

import piper_nb as pn
from piper_nb.capture import run_reference


class Skip(nn.Module):
    """Three linear layers; layer 0's output also feeds layer 2 (a skip across a region)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        h0 = self.layers[0](x)
        h1 = torch.tanh(self.layers[1](h0))
        return self.layers[2](h1) + h0

    def loss_fn(self, out, y):
        return nn.functional.mse_loss(out, y)


class InCode(nn.Module):
    """Piper's in-code form: repeated `pn.region("PP")` scopes are numbered in trace order."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        with pn.region("PP"):
            x = torch.relu(self.a(x))
        with pn.region("PP"):
            x = self.b(x)
        return x

    def loss_fn(self, out, y):
        return nn.functional.mse_loss(out, y)


def test_patterns_select_modules_and_children_inherit():
    model = pn.models.TinyGPT(layers=4)
    spec = pn.annotate(model, {"embed": {"PP": 0}, "blocks.[0-1]": {"PP": 0},
                               "blocks.[2-3]": {"PP": 1}, "head": {"PP": 1}})
    assert spec.tags_of("blocks.1.attn") == {"PP": 0}
    assert spec.tags_of("blocks.3") == {"PP": 1}
    assert spec.tags_of("blocks.*") == {}  # a pattern is not a module path


def test_nested_tags_extend_parents():
    model = pn.models.TinyMoE(layers=1, experts=2)
    spec = pn.annotate(model, {"*": {"PP": 0}, "blocks.0.moe.experts.1": {"EP": 1},
                               "blocks.0.moe.experts.0": {"EP": 0}})
    assert spec.tags_of("blocks.0.moe.experts.1.0") == {"PP": 0, "EP": 1}


def test_skip_connection_is_an_edge_between_regions():
    model = Skip()
    spec = pn.annotate(model, {"layers.0": {"PP": 0}, "layers.1": {"PP": 1}, "layers.2": {"PP": 2}})
    cap = spec.capture()
    assert [r.name for r in cap.regions] == ["PP=0", "PP=1", "PP=2"]
    (skip,) = [v for v, p in cap.producer.items() if p == 0]
    assert cap.consumers[skip] == (1, 2)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(run_reference(cap, x, y), model.loss_fn(model(x), y))


def test_tied_embedding_is_recorded_across_first_and_last_stage():
    model = pn.models.TinyGPT(layers=2, tie_embeddings=True)
    spec = pn.annotate(model, {"embed": {"PP": 0}, "blocks.0": {"PP": 0},
                               "blocks.1": {"PP": 1}, "head": {"PP": 1}})
    cap = spec.capture()
    assert cap.tied == {"embed.tok.weight": (0, 1)}
    x, y = model.example_batch(batch_size=2, seed=0)
    torch.testing.assert_close(run_reference(cap, x, y), model.loss_fn(model(x), y))


def test_in_code_regions_are_numbered_in_trace_order():
    model = InCode()
    cap = pn.annotate(model).capture()
    assert [dict(r.tags) for r in cap.regions] == [{"PP": 0}, {"PP": 1}]
    assert cap.regions[0].params == ("a.weight", "a.bias")


def test_modules_without_tags_are_an_error_naming_them():
    model = pn.models.TinyGPT(layers=2)
    spec = pn.annotate(model, {"embed": {"PP": 0}, "blocks.0": {"PP": 0}, "head": {"PP": 1}})
    with pytest.raises(pn.PlanError, match=r"blocks\.1\.[a-z]"):
        spec.capture()


def test_pattern_matching_nothing_lists_the_modules():
    with pytest.raises(pn.PlanError, match="matches no module.*embed"):
        pn.annotate(pn.models.TinyGPT(layers=1), {"decoder.*": {"PP": 0}})


@pytest.mark.parametrize("by", ["params", "flops"])
def test_cut_stages_is_contiguous_and_even(by):
    model = pn.models.TinyGPT(layers=6)
    cut = pn.cut_stages(model, 3, by=by)
    stages = list(cut.values())
    assert [s["PP"] for s in stages] == sorted(s["PP"] for s in stages)
    assert {s["PP"] for s in stages} == {0, 1, 2}
    cap = pn.annotate(model, cut).capture()
    sizes = [sum(dict(model.named_parameters())[p].numel() for p in r.params) for r in cap.regions]
    assert max(sizes) < 2.2 * min(sizes)


def test_cut_stages_rejects_more_stages_than_units():
    with pytest.raises(pn.PlanError, match="at most 4"):
        pn.cut_stages(pn.models.MLP(depth=4), 5)
