"""Regions captured on the CPU, retargeted to another device (`runtime.bundle.to_device`)
and run there. The meta device stands in for a GPU: a CPU device literal left in a graph,
or a CPU tensor constant, fails there with a device mismatch as it does on CUDA, so CI
needs no GPU to see it. The Hugging Face families are the tiny ones of
test_hf_families.py, cut in two stages."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.fx as fx
from torch import nn

import piper_nb as pn
from piper_nb.capture.meta_routing import balanced_routing
from piper_nb.runtime.bundle import to_device
from piper_nb.sim.flops import region_inputs

META = torch.device("meta")


def run_on_meta(plan) -> None:
    """Every region of `plan`, a copy retargeted to meta, run on meta inputs of its shapes
    (balanced routing: a mixture-of-experts' `nonzero` has no values to read on meta)."""
    for r, module in enumerate(plan.capture.modules):
        region = to_device(copy.deepcopy(module), META, region=str(r))
        with balanced_routing():
            outs = region(*region_inputs(plan, r, device=META))
        # activations and the loss (a size crossing regions is a host tensor: `pack_size`)
        acts = [o for o in outs if isinstance(o, torch.Tensor) and o.dtype == torch.float32]
        assert acts and all(o.device == META for o in acts)


class Rotary(nn.Module):
    """Positions made as Hugging Face's rotary embeddings make them: inside an
    autocast-disabled block, on the input's device. torch.export nests the block in a
    graph of its own (`submod_1`), whose `arange` records the capture's device."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast(device_type=x.device.type, enabled=False):
            pos = torch.arange(x.shape[1], device=x.device).float()
        return self.proj(x) + pos[None, :, None]


def _mse(out, target):
    return (out - target).pow(2).mean()


def test_a_nested_graph_follows_the_device():
    x, t = torch.randn(4, 6, 8), torch.randn(4, 6, 8)
    plan = pn.compile(Rotary(), [pn.place({}, [0])], (x, t), loss_fn=_mse, capture="export")
    nested = [p for p, m in plan.capture.modules[0].named_modules()
              if p and isinstance(m, fx.GraphModule)]
    assert nested, "export no longer nests the autocast block: this test tests nothing"
    run_on_meta(plan)


def test_an_autocast_block_follows_the_device_type():
    """On a GPU, the rotary block must turn off CUDA's autocast, not the CPU's: its
    `wrap_with_autocast('cpu', ...)` becomes `'cuda'` (the graph only: no GPU here)."""
    from piper_nb.runtime.bundle import _retarget
    x, t = torch.randn(4, 6, 8), torch.randn(4, 6, 8)
    plan = pn.compile(Rotary(), [pn.place({}, [0])], (x, t), loss_fn=_mse, capture="export")
    graph = copy.deepcopy(plan.capture.modules[0]).graph
    blocks = [n for n in graph.nodes if n.target is torch.ops.higher_order.wrap_with_autocast]
    assert blocks and all(n.args[0] == "cpu" for n in blocks)
    assert _retarget(graph, torch.device("cuda", 0))
    assert all(n.args[0] == "cuda" for n in blocks)


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x) * torch.tensor([1.0, 2.0, 3.0, 4.0])


def test_a_plain_tensor_constant_follows_the_device():
    """A tensor made in `forward` is a constant of the graph; torch 2.11's export left it a
    plain attribute (`_tensor_constant1`), not a buffer, which `module.to` does not move."""
    gm = fx.symbolic_trace(Scaled())
    gm._tensor_constant0 = gm._buffers.pop("_tensor_constant0")   # plain, as 2.11 left it
    assert "_tensor_constant0" in vars(gm)
    out = to_device(gm, META)(torch.empty(2, 4, device=META))
    assert out.device == META and gm._tensor_constant0.device == META


def _first(devices: frozenset) -> torch.device:
    return next(iter(devices))


def test_a_cpu_device_the_rewrite_cannot_reach_is_a_plan_error():
    """A device inside a set is one the rewrite does not enter; it runs on the CPU, and
    retargeted it would make a CPU tensor among meta (GPU) ones: refused, by node and op."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    dev = graph.call_function(_first, (frozenset({torch.device("cpu")}),))
    ones = graph.call_function(torch.ones, (4,), {"device": dev})
    graph.output(graph.call_function(torch.add, (x, ones)))
    gm = fx.GraphModule(nn.Module(), graph)
    assert gm(torch.zeros(4)).tolist() == [1.0] * 4
    said = r"region 3: node _first \(call_function _first\) in the top-level graph still says"
    with pytest.raises(pn.PlanError, match=said):
        to_device(gm, META, region="3")
    on_cpu = to_device(copy.deepcopy(gm), torch.device("cpu"))   # to the CPU: as it was
    assert on_cpu(torch.zeros(4)).tolist() == [1.0] * 4


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_hf_families import FAMILIES, STRATEGIES, batch, stages  # noqa: E402


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_family_regions_run_retargeted_to_meta(family, one_thread):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    plan = pn.compile(pn.annotate(model, stages(family, 2)), STRATEGIES["pp2_1f1b"][1](),
                      batch(), capture="export")
    run_on_meta(plan)
