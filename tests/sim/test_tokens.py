"""A routing sizes the expert buffers: own rows on the replica side, the group's on the owner.

PP 2 x DP 2 x EP 2 on TinyMoE: stage 0 on devices 0 and 2, expert 0 of each block on the
group's first device, expert 1 on its second.
"""

from __future__ import annotations

from piper_nb.plan.sizes import value_bytes
from piper_nb.plan.token_rows import captured_rows
from piper_nb.sim import CostModel, MemorySettings, simulate
from piper_nb.sim.tokens import Routing
from piper_nb.strategies import compile_strategy


def _plan():
    return compile_strategy("pp2-dp2-ep2")[0]


def _expert(plan, stage: int, e: int):
    return next(r for r in plan.regions if dict(r.tags) == {"PP": stage, "EP": e})


def test_without_a_routing_every_member_routes_as_captured():
    plan = _plan()
    routing = Routing(plan)
    hints = captured_rows(plan.rows, plan.values)
    (value,) = _expert(plan, 0, 0).inputs
    s = plan.rows[value]
    assert routing.counts(s, 0) == (hints[s], hints[s])
    assert routing.rows(s, 0, 2, total=False) == hints[s]
    assert routing.rows(s, 0, 0, total=True) == 2 * hints[s]


def test_a_routing_sizes_values_and_saved_bytes_per_device():
    plan = _plan()
    region = _expert(plan, 0, 0)
    (value,) = region.inputs
    routing = Routing(plan, {f"{value}@1": [3, 11]})   # device 0 sends 3 rows, device 2 11
    row = value_bytes(plan.values[value]) // plan.values[value].shape[0]
    assert routing.value_bytes(value, 1, 0) == 3 * row
    assert routing.value_bytes(value, 1, 2) == 11 * row
    assert routing.value_bytes(value, 1, 0, total=True) == 14 * row
    per_row = plan.saved_rows[region.index][plan.rows[value]]
    base = plan.saved[region.index] - per_row * plan.values[value].shape[0]
    assert routing.saved(region.index, 1, 0) == base + 14 * per_row   # the owner runs all 14
    other = routing.counts(plan.rows[value], 0)                      # microbatch 0: captured
    assert routing.saved(region.index, 0, 0) == base + sum(other) * per_row


def test_more_tokens_for_an_expert_raise_its_owners_peak():
    plan = _plan()
    (value,) = _expert(plan, 0, 0).inputs
    hint = plan.values[value].shape[0]
    skewed = {f"{value}@{mb}": [hint, 4 * hint] for mb in range(plan.microbatches)}

    def peak(tokens):
        trace = simulate(plan, CostModel.uniform(), memory=MemorySettings(tokens=tokens))
        return {d: trace.peak_memory[d] for d in range(plan.world)}
    base, more = peak(None), peak(skewed)
    assert more[0] > base[0]          # device 0 owns expert 0: it holds everyone's rows
    assert more[2] > base[2]          # device 2 routes more of its own tokens there
    assert more[1] == base[1] and more[3] == base[3]   # stage 1 routes as captured
