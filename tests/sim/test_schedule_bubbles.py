"""DualPipe's table (REFERENCES.md), reproduced by simulating compiled plans.

Costs: CostModel.uniform(F=1, B=2, W=1, FB=3), messages free. What is compared:
- bubble(device) = the step span (first event start to last event end, all devices)
  minus the union of that device's compute events; asserted for *every* device, for two
  microbatch counts (the bubble does not depend on them);
- live stashes = the peak count of (region, microbatch) activations alive on a device,
  each from the start of its F to the end of its last backward;
- parameters = the memory model's parameter bytes on a device at the step start.
PP is the number of stages: DualPipeV with N ranks has PP = 2N stages.
"""

from __future__ import annotations

import pytest

import piper_nb as pn
from piper_nb.sim import CostModel, simulate

F, B, W, FB = 1, 2, 1, 3
COST = CostModel.uniform(F=F, B=B, W=W, FB=FB)
MODEL = pn.models.MLP(dim=8, depth=16)

# name -> (builder, ranks(PP), bubble(PP))
TABLE = {
    "gpipe": (pn.schedules.gpipe, lambda pp: pp, lambda pp: (pp - 1) * (F + B)),
    "1f1b": (pn.schedules.one_f_one_b, lambda pp: pp, lambda pp: (pp - 1) * (F + B)),
    "zb1p": (pn.schedules.zero_bubble, lambda pp: pp, lambda pp: (pp - 1) * (F + B - 2 * W)),
    "dualpipe": (pn.schedules.dualpipe, lambda pp: pp,
                 lambda pp: (pp // 2 - 1) * (FB + B - 3 * W)),
    "dualpipev": (pn.schedules.dualpipev, lambda pp: pp // 2,
                  lambda pp: (pp // 2 - 1) * (FB + B - 3 * W)),
}


def plan_for(name: str, pp: int, microbatches: int):
    builder, ranks, _ = TABLE[name]
    spec = pn.annotate(MODEL, pn.cut_stages(MODEL, pp))
    program = builder(ranks=ranks(pp), microbatches=microbatches, place=True)
    return pn.compile(spec, program, MODEL.example_batch(batch_size=2 * microbatches, seed=0))


@pytest.mark.parametrize("pp", [4, 8])
@pytest.mark.parametrize("name", list(TABLE))
def test_bubble_per_device_is_the_published_one_for_any_microbatch_count(name, pp):
    expected = TABLE[name][2](pp)
    for m in (2 * pp, 2 * pp + 4):
        trace = simulate(plan_for(name, pp, m), COST)
        assert {d: trace.bubble(d) for d in trace.devices} == {d: expected for d in trace.devices}
        work = trace.step_time - expected  # every device does the same work
        stages_per_chunk_per_rank = 2 if name == "dualpipev" else 1
        assert work == m * (F + B) * stages_per_chunk_per_rank


@pytest.mark.parametrize("pp", [4, 8])
def test_live_activations_are_pp_for_1f1b_and_pp_plus_1_for_dualpipe(pp):
    m = 2 * pp
    one = simulate(plan_for("1f1b", pp, m), COST)
    assert one.live_stashes(0) == pp
    assert max(one.live_stashes(d) for d in one.devices) == pp
    assert simulate(plan_for("gpipe", pp, m), COST).live_stashes(0) == m
    for name in ("dualpipe", "dualpipev"):
        trace = simulate(plan_for(name, pp, m), COST)
        assert max(trace.live_stashes(d) for d in trace.devices) == pp + 1, name


@pytest.mark.parametrize("pp", [4, 8])
def test_dualpipe_holds_twice_the_parameters_of_1f1b(pp):
    def params(name):
        trace = simulate(plan_for(name, pp, 2 * pp), COST)
        first = {}
        for m in trace.memory:   # parameters held (no ZeRO-3: constant over the step)
            first.setdefault(m.device, m.params)
        return first

    one = params("1f1b")
    assert len(set(one.values())) == 1   # equal stages
    per_stage = one[0]
    assert set(params("dualpipe").values()) == {2 * per_stage}
    assert set(params("dualpipev").values()) == {2 * per_stage}


def test_the_dualpipe_examples_take_66_units_for_60_of_work():
    assert simulate(plan_for("dualpipev", 8, 10), COST).step_time == 66   # N=4, 10 chunks
    assert simulate(plan_for("dualpipe", 8, 20), COST).step_time == 66    # 8 ranks, 20 chunks
