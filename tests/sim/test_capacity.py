"""Memory capacity: each HardwareSpec knows its device memory; a trace simulated with an
analytic cost model says whether the plan fits, and names each device that does not with
its peak and largest kind of memory; the memory view draws the capacity line; the Designer
lists the overflow as a problem."""

from __future__ import annotations

import pytest
import torch

import piper_nb as pn
from piper_nb.sim.cost import HARDWARE
from piper_nb.ui.compute import simulate_plan
from piper_nb.ui.state import DesignerState

transformers = pytest.importorskip("transformers")
GiB = 2**30


def test_the_hardware_knows_its_memory():
    assert {k: v.memory / GiB for k, v in HARDWARE.items()} == {
        "A100": 80, "A100-40GB": 40, "H100": 80, "H100-96GB": 96, "H200": 141}


def meta_llama(vocab: int):
    """One layer of a Llama with a huge vocabulary on the meta device: the embedding and
    head alone set the memory (vocab x 4096 x 2 matrices x 8 bytes per parameter)."""
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=4096, intermediate_size=8192,
                                   num_hidden_layers=1, num_attention_heads=32,
                                   num_key_value_heads=8, attn_implementation="eager")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.zeros(4, 16, dtype=torch.long, device="meta")
    plan = pn.compile(pn.annotate(model, {"": {"PP": 0}}),
                      [pn.place({"PP": 0}, [0]), pn.split({}, "MB", 2)], (ids, ids))
    return model, plan


@pytest.fixture(scope="module")
def big():
    return meta_llama(vocab=2_000_000)           # 16.4 G parameters: 131 GB of weights+grads


def test_a_plan_over_the_devices_memory_is_named_with_its_largest_kind(big):
    _, plan = big
    h100 = pn.simulate(plan, pn.CostModel.analytic(plan, "H100"))
    assert h100.memory_capacity == 80 * GiB
    assert not h100.fits()
    (line,) = h100.over_capacity()
    assert line.startswith("device 0 peaks at ") and "of 80.0 GiB (largest: params" in line
    assert h100.fits(capacity=1e15)


def test_a_plan_within_memory_fits_and_a_trace_without_hardware_says_so():
    _, plan = meta_llama(vocab=1000)
    assert pn.simulate(plan, pn.CostModel.analytic(plan, "A100-40GB")).fits()
    with pytest.raises(pn.PlanError, match="knows no device memory"):
        pn.simulate(plan, pn.CostModel.uniform()).fits()


def test_the_memory_view_draws_the_capacity(big):
    _, plan = big
    fig = pn.simulate(plan, pn.CostModel.analytic(plan, "H100")).figure()
    lines = [s for s in fig.layout.shapes if s.type == "line" and s.y0 == s.y1]
    assert len(lines) == 1 and lines[0].y0 == pytest.approx(80.0)   # drawn in GiB
    assert any("capacity 80 GiB" in a.text for a in fig.layout.annotations)


def test_the_designer_lists_a_plan_that_does_not_fit(big):
    model, plan = big
    state = DesignerState(model=model, batch=(torch.zeros(4, 16, dtype=torch.long),) * 2,
                          cost="analytic")
    trace, problems = simulate_plan(state, plan)
    assert trace is not None
    assert [p.stage for p in problems] == ["memory"]
    assert "device 0 peaks at" in problems[0].text() and "largest: params" in problems[0].text()
