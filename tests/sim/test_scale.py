"""Plans at scale: the lowering stamps replicas lazily, the checks and the simulator run one
template per class of replicas (`sim.replicas`), and the Trace that stands for the rest is
the full simulation's, event for event and sample for sample. Each plan is simulated as
lowered (stamped) and as the same instructions without stamps (every device simulated)."""

from __future__ import annotations

import dataclasses

import pytest

import piper_nb as pn
from piper_nb.compiler.checks import check_plan
from piper_nb.errors import PlanError
from piper_nb.ir.kinds import Op
from piper_nb.optim import check_optimizer
from piper_nb.plan.plan import DevicePlan, Plan, StampedDevicePlan
from piper_nb.sim import MemorySettings
from piper_nb.sim.cost import CostModel
from piper_nb.sim.replicas import CompactTrace, replica_runs, state_offsets

NODES = dict(latency=1.0, bandwidth=1e3, inter_latency=4.0, inter_bandwidth=1e2, node_size=2,
             passes={(-1, "F"): 3.0, (-1, "B"): 5.0, (-1, "BI"): 3.0, (-1, "BW"): 2.0,
                     (-1, "U"): 1.0})


def compile_pp_dp(pp: int, dp: int, micro: int, zero: int = 1, schedule=None,
                  spread=None) -> Plan:
    """`pp` stages of an MLP, each replicated over `dp` devices (stage s: s + pp * k unless
    `spread(s, k)` says otherwise)."""
    schedule = schedule or pn.schedules.one_f_one_b
    model = pn.models.MLP(dim=8, depth=pp)
    spec = pn.annotate(model, {f"layers.{i}": {"PP": i} for i in range(pp)})
    program = [*schedule(ranks=pp, microbatches=micro, place=False)]
    for s in range(pp):
        devices = [spread(s, k) if spread else s + pp * k for k in range(dp)]
        program += [pn.place({"PP": s}, devices=devices),
                    pn.replicate({"PP": s}, devices=devices, zero=zero)]
    return pn.compile(spec, program, model.example_batch(batch_size=micro * dp, seed=0))


def unstamped(plan: Plan) -> Plan:
    """The same instructions, every device its own list: nothing to stand for."""
    return dataclasses.replace(plan, devices=tuple(DevicePlan(dp.device, dp.instrs)
                                                   for dp in plan.devices))


def same_answers(fast, full) -> None:
    for d in full.devices:    # a device's own events, asked before the replicas expand
        assert fast.events_of(d) == full.events_of(d)
        assert fast.memory_of(d) == full.memory_of(d)
    assert fast == full and full == fast
    assert fast.events == full.events and fast.memory == full.memory
    assert fast.step_time == full.step_time and fast.devices == full.devices
    assert fast.peak_memory == full.peak_memory
    assert list(fast.peak_memory) == list(full.peak_memory)
    assert fast.bubble_fraction() == full.bubble_fraction()
    for d in full.devices:
        assert fast.bubble(d) == full.bubble(d)
        assert fast.bubble_fraction(d) == full.bubble_fraction(d)
        assert fast.live_stashes(d) == full.live_stashes(d)
    half = max(full.peak_memory.values()) / 2
    assert fast.over_capacity(half) == full.over_capacity(half) != []
    assert fast.fits(half) is full.fits(half) is False
    assert fast.to_json() == full.to_json()


def simulate_both(plan: Plan, cost: CostModel, compact: bool = True, memory=None):
    fast = pn.simulate(plan, cost, memory=memory)
    full = pn.simulate(unstamped(plan), cost, memory=memory)
    assert isinstance(fast, CompactTrace) is compact
    assert type(full) is pn.Trace
    same_answers(fast, full)
    return fast


@pytest.mark.parametrize("pp, dp, zero", [(2, 2, 1), (4, 4, 1), (4, 4, 3)])
def test_one_replica_per_class_simulates_the_whole_plan(pp, dp, zero):
    plan = compile_pp_dp(pp, dp, micro=2 * pp, zero=zero)
    assert isinstance(plan[pp], StampedDevicePlan) and plan.stamps()[pp] == 0
    assert sum(replica_runs(plan, CostModel.analytic(plan, "H100"))) == pp
    simulate_both(plan, CostModel.analytic(plan, "H100"))
    simulate_both(plan, CostModel(**NODES))   # nodes of 2: stages cross them alike


def test_ties_in_every_step_start_in_one_order_on_both_paths():
    # integer costs: many ops get ready at once, on the streams they share
    plan = compile_pp_dp(4, 2, micro=8, schedule=pn.schedules.zero_bubble)
    simulate_both(plan, CostModel.uniform(F=1, B=2, W=1, comm=0.5))


def test_asymmetric_links_fall_back_to_every_device():
    # 3 stages on nodes of 2: replica 0's stages 1-2 cross a node, replica 1's 0-1 do
    plan = compile_pp_dp(3, 2, micro=3)
    cost = CostModel(**NODES)
    assert plan.stamps() and replica_runs(plan, cost) is None
    simulate_both(plan, cost, compact=False)


@pytest.mark.parametrize("schedule, pp, zero", [
    (pn.schedules.one_f_one_b, 4, 1), (pn.schedules.zero_bubble, 4, 3),
    (pn.schedules.gpipe, 3, 2)])
def test_messages_that_take_no_time_simulate_one_replica_per_class(schedule, pp, zero):
    # the Designer's default costs: every op starts when ready, whatever order ties pop in
    plan = compile_pp_dp(pp, 3, micro=2 * pp, zero=zero, schedule=schedule)
    uniform = CostModel.uniform(F=1, B=2, W=1, comm=0.0)
    assert sum(replica_runs(plan, uniform)) == pp
    simulate_both(plan, uniform)


def test_some_free_and_some_timed_messages_fall_back_to_every_device():
    # zero latency: an empty message is free, a full one is not; neither argument holds
    plan = compile_pp_dp(2, 2, micro=2)
    mixed = CostModel(latency=0.0, bandwidth=1e3, passes=NODES["passes"])
    assert replica_runs(plan, mixed) is None
    simulate_both(plan, mixed, compact=False)


@pytest.mark.parametrize("first_step", [False, True])
def test_replicas_whose_shards_keep_other_state_are_simulated_once(first_step):
    # 72 parameters per stage over 5 replicas: shards of 15, the last of 12 (padding), so
    # the last replica keeps less of Adam's state than its template: same times, its own
    # memory (from the start of a steady step, from the update on in a first one)
    plan = compile_pp_dp(2, 5, micro=2)
    cost = CostModel.analytic(plan, "H100")
    adam = MemorySettings(optimizer=pn.optim.AdamW(1e-3), first_step=first_step)
    assert sum(replica_runs(plan, cost, adam)) == 2
    offsets = state_offsets(plan, adam)
    assert set(offsets) == {8, 9}   # stage 0's and stage 1's last replica
    assert all(extra < 0 for steps in offsets.values() for _, extra in steps)
    assert [i for i, _ in offsets[8]] == ([plan[0].instrs.index(next(
        ins for ins in plan[0].instrs if ins.kind == Op.U))] if first_step else [0])
    fast = simulate_both(plan, cost, memory=adam)
    assert fast.peak_memory[8] < fast.peak_memory[0]   # stage 0: the short shard, its template
    assert fast.over_capacity(fast.peak_memory[8] + 1)[0].startswith("device 0 ")
    # parameter groups cut one shard where another is whole: one more piece, one more step
    even = compile_pp_dp(2, 4, micro=2)
    spec = check_optimizer(pn.optim.AdamW(1e-3), param_groups=[{"params": "*.bias"}])
    assert state_offsets(even, MemorySettings(optimizer=pn.optim.AdamW(1e-3))) == {}
    grouped = MemorySettings(optimizer=spec, first_step=first_step)
    assert state_offsets(even, grouped) and sum(replica_runs(even, cost, grouped)) == 2
    simulate_both(even, cost, memory=grouped)


def test_tensor_parallel_ranks_keep_the_state_of_their_own_bucket_copies():
    # TP rank 1 is a stamp of rank 0; its update names its own copies of rank 0's buckets
    from piper_nb.strategies import compile_strategy
    plan, _ = compile_strategy("tp2-dp2-zero3")
    adam = MemorySettings(optimizer=pn.optim.AdamW(1e-3))
    assert plan.stamps()[1] == 0 and state_offsets(plan, adam) == {}
    fast = simulate_both(plan, CostModel.uniform(), memory=adam)
    assert min(m.optim for m in fast.memory_of(1)) > 0


def test_replicas_whose_peers_are_crossed_fall_back():
    # stage 1's replicas listed [3, 1]: device 0 (a template) sends to 3 (a stamp of 1),
    # so a replica's messages do not mirror its template's: every device is simulated
    plan = compile_pp_dp(2, 2, micro=2, spread=lambda s, k: [[0, 2], [3, 1]][s][k])
    cost = CostModel(**NODES)
    assert plan.stamps() == {2: 0, 3: 1} and replica_runs(plan, cost) is None
    simulate_both(plan, cost, compact=False)


def test_stamped_lists_are_made_on_demand_and_checked_through_their_template():
    plan = compile_pp_dp(2, 4, micro=2)
    stamped = plan[3 * 2 + 1]
    assert stamped._instrs is None            # not made by compile, checks or simulation
    pn.simulate(plan, CostModel.analytic(plan, "H100"))
    assert stamped._instrs is None
    assert stamped == DevicePlan(stamped.device, stamped.stamped())
    assert Plan.from_json(plan.to_json()).devices == plan.devices
    # a template edited after the lowering no longer stands for its replicas
    bad = list(plan.devices)
    bad[1] = DevicePlan(1, plan[1].instrs[1:])
    with pytest.raises(PlanError):
        check_plan(dataclasses.replace(plan, devices=tuple(bad)))


def test_clipping_keeps_replicas_stamped_and_the_fast_path_exact():
    from piper_nb.compiler.clip import with_grad_clipping
    plan = with_grad_clipping(compile_pp_dp(4, 4, 4, zero=1), 1.0)
    assert sum(isinstance(dp, StampedDevicePlan) for dp in plan.devices) == 12
    cost = CostModel(**NODES)
    fast = pn.simulate(plan, cost)
    assert isinstance(fast, CompactTrace)
    assert sum(e.label == "norm:AR" for e in fast.events) == 16
    same_answers(fast, pn.simulate(unstamped(plan), cost))
