"""A cut whose stages are not contiguous in the forward is refused before any schedule check."""

import pytest
import torch
from torch import nn

import piper_nb as pn


class NormFirst(nn.Module):
    """Declares `norm` before the layers but runs it after them (OPT's final norm)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.norm(x)

    def loss_fn(self, out, y):
        return nn.functional.mse_loss(out, y)


class Shared(NormFirst):
    """Calls `norm` after the first layer and again after the last (a shared layer)."""

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i in (0, 3):
                x = self.norm(x)
        return x


def batch():
    torch.manual_seed(0)
    return torch.randn(8, 8), torch.randn(8, 8)


def definition_order(model):
    return {"norm": {"PP": 0}, "layers.0": {"PP": 0}, "layers.1": {"PP": 0},
            "layers.2": {"PP": 1}, "layers.3": {"PP": 1}}


def test_a_module_first_run_after_a_later_stage_is_refused_with_the_order():
    model = NormFirst()
    with pytest.raises(pn.PlanError) as e:
        pn.compile(pn.annotate(model, definition_order(model)),
                   pn.schedules.one_f_one_b(2, 4, place=True), batch())
    msg = str(e.value)
    assert "stage 0 is not contiguous" in msg
    assert "norm (PP 0) first runs after layers.2, layers.3 (PP 1)" in msg
    assert "the order 0, 1, 0" in msg
    assert "pn.cut_stages" in msg and "deadlock" not in msg


def test_the_same_model_cut_in_execution_order_compiles():
    model = NormFirst()
    plan = pn.compile(pn.annotate(model, pn.cut_stages(model, 2, example=batch())),
                      pn.schedules.one_f_one_b(2, 4, place=True), batch())
    assert [r.name for r in plan.regions] == ["PP=0", "PP=1"]


def test_a_stage_calling_its_own_layer_again_after_a_later_stage_is_legal():
    model = Shared()
    plan = pn.compile(pn.annotate(model, definition_order(model)),
                      pn.schedules.gpipe(2, 4, place=True), batch())
    assert [r.name for r in plan.regions] == ["PP=0", "PP=1", "PP=0,SEG=1"]
