"""The simulator's rules on hand-written plans, each timeline checked in text form
(`label@start-end`). Costs: CostModel.uniform, so times are exact."""

from __future__ import annotations

import importlib

import pytest

import piper_nb as pn
from piper_nb import PlanError
from piper_nb.plan.instr import Instr
from piper_nb.sim import CostModel, HostModel, simulate
from piper_nb.sim.simulate import overlap_steps, run_timing


def test_a_recv_waits_for_its_send_and_both_span_the_transfer(hand_plan, spans):
    plan = hand_plan("r0:F0 r0:SEND_F0>1 wait(r0:SEND_F0>1)",
                     "r1:RECV_F0<0 wait(r1:RECV_F0<0) r1:F0")
    trace = simulate(plan, CostModel.uniform(F=1, comm=0.5))
    assert spans(trace, 0) == ["r0:F0@0-1", "r0:SEND_F0>1@1-1.5"]
    assert spans(trace, 1) == ["r1:RECV_F0<0@1-1.5", "r1:F0@1.5-2.5"]
    assert trace.step_time == 2.5


def test_messages_on_one_stream_go_first_in_first_out_while_compute_runs_on(hand_plan, spans):
    plan = hand_plan("r0:F0 r0:SEND_F0>1 r0:F1 r0:SEND_F1>1 wait(r0:SEND_F0>1) wait(r0:SEND_F1>1)",
                     "r1:RECV_F0<0 r1:RECV_F1<0 wait(r1:RECV_F0<0) r1:F0 wait(r1:RECV_F1<0) r1:F1")
    trace = simulate(plan, CostModel.uniform(F=1, comm=2))
    assert spans(trace, 0) == ["r0:F0@0-1", "r0:F1@1-2", "r0:SEND_F0>1@1-3", "r0:SEND_F1>1@3-5"]
    assert spans(trace, 1, "compute") == ["r1:F0@3-4", "r1:F1@5-6"]


def test_a_collective_starts_when_every_member_posted_it_and_ends_together(hand_plan, spans):
    plan = hand_plan("r0:F0 r0:B0 AR wait(AR) r0:U", "r1:F0 AR wait(AR) r1:U")
    trace = simulate(plan, CostModel.uniform(F=1, B=2, comm=1))
    assert spans(trace, 0) == ["r0:F0@0-1", "r0:B0@1-3", "AR@3-4", "r0:U@4-4"]
    assert spans(trace, 1) == ["r1:F0@0-1", "AR@3-4", "r1:U@4-4"]


def test_an_overlap_slot_costs_fb_and_its_passes_share_the_span(hand_plan, spans):
    plan = hand_plan("r0:F0 (r0:F1;r0:B0) r0:B1")
    trace = simulate(plan, CostModel.uniform(F=1, B=2, FB=2.5))
    assert spans(trace, 0) == ["r0:F0@0-1", "r0:B0@1-3.5", "r0:F1@1-3.5", "r0:B1@3.5-5.5"]
    assert trace.bubble(0) == 0
    # without FB the slot costs F + B
    assert simulate(plan, CostModel.uniform(F=1, B=2)).step_time == 6


def test_waits_between_overlapped_passes_gate_the_slot_and_issues_follow_it():
    instrs = [Instr.of("RECV", "r", "pp", peer=1, tag=1, grad=True),        # 0
              Instr.of("F", "f", region=0, mb=1, overlap=0),                 # 1
              Instr.of("SEND", "s", "pp", region=0, mb=1, peer=1, tag=2),    # 2 sends F's output
              Instr.of("WAIT", "r", "pp", target=0),                         # 3 B's input
              Instr.of("B", "b", region=1, mb=0, overlap=0)]                 # 4
    assert overlap_steps(instrs) == [0, 3, (1, 4), 2]


def test_a_plan_whose_waits_cross_cannot_finish(hand_plan):
    plan = hand_plan("r0:RECV_F0<1 wait(r0:RECV_F0<1) r0:SEND_F0>1 wait(r0:SEND_F0>1)",
                     "r1:RECV_F0<0 wait(r1:RECV_F0<0) r1:SEND_F0>0 wait(r1:SEND_F0>0)")
    with pytest.raises(PlanError, match="cannot finish"):
        simulate(plan, CostModel.uniform())


def test_every_instruction_of_a_compiled_plan_gets_a_time(compile_schedule):
    plan = compile_schedule(pn.models.MLP(dim=8, depth=16), pn.schedules.one_f_one_b, 4, 4, 8)
    timing = run_timing(plan, CostModel.uniform(comm=0.25))
    assert all(t >= 0 for row in timing.end for t in row)
    assert all(s <= e for rs, re_ in zip(timing.start, timing.end, strict=True)
               for s, e in zip(rs, re_, strict=True))


def _host_model(**kw) -> CostModel:
    """Unit costs plus the CPU host model of a profiled cost model."""
    base = CostModel.uniform(F=1, B=2, W=1, comm=0.5)
    return CostModel(name="host", unit="unit", passes=base.passes, comm=0.5, host=HostModel(**kw))


def test_a_host_synchronous_device_pays_its_overhead_and_issue_calls(hand_plan, spans):
    plan = hand_plan("r0:F0 r0:SEND_F0>1 r0:F1 wait(r0:SEND_F0>1)",
                     "r1:RECV_F0<0 wait(r1:RECV_F0<0) r1:F0")
    trace = simulate(plan, _host_model(sync=True, overhead=0.25, issue={"SEND": 0.5}))
    # F0, its bookkeeping; the send posts at 1.25 and keeps the host 0.5 more; F1 after
    assert spans(trace, 0) == ["r0:F0@0-1", "r0:SEND_F0>1@1.25-1.75", "r0:F1@2-3"]
    # the receiver posts at 0 and pays 0.25 per instruction: F0 after its WAIT's bookkeeping
    assert spans(trace, 1) == ["r1:RECV_F0<0@1.25-1.75", "r1:F0@2-3"]
    assert trace.meta["host_end"] == 3.5              # F1's and the last WAIT's bookkeeping


def test_a_synchronous_host_runs_an_overlap_slot_one_pass_after_the_other(hand_plan, spans):
    plan = hand_plan("r0:F0 (r0:F1;r0:B0) r0:B1")
    slot = simulate(plan, CostModel.uniform(F=1, B=2, FB=2))
    assert spans(slot, 0) == ["r0:F0@0-1", "r0:B0@1-3", "r0:F1@1-3", "r0:B1@3-5"]
    sync = simulate(plan, _host_model(sync=True))
    assert spans(sync, 0) == ["r0:F0@0-1", "r0:F1@1-2", "r0:B0@2-4", "r0:B1@4-6"]


def test_devices_computing_at_once_share_the_cores(hand_plan, spans):
    plan = hand_plan("r0:F0", "r0:F0", "r0:F0", "r0:F0")
    assert simulate(plan, _host_model(sync=True)).step_time == 1
    shared = simulate(plan, _host_model(sync=True, cores=2))
    assert shared.step_time == pytest.approx(2, rel=0.01)          # 4 passes on 2 cores
    two = hand_plan("r0:F0", "r0:F0")
    assert simulate(two, _host_model(sync=True, cores=2)).step_time == 1
    busy = simulate(two, _host_model(sync=True, cores=2, background=2))   # 2 other tasks:
    assert busy.step_time == pytest.approx(2 / 1.5, rel=0.01)    # 4 on 2 cores, profiled at 3
    staggered = hand_plan("r0:F0 r0:SEND_F0>1 wait(r0:SEND_F0>1)",      # never two at once
                          "r1:RECV_F0<0 wait(r1:RECV_F0<0) r1:F0")
    assert simulate(staggered, _host_model(sync=True, cores=1)).step_time == 2.5


def test_tasks_outnumbering_cores_also_pay_what_time_slicing_costs(hand_plan):
    four = hand_plan("r0:F0", "r0:F0", "r0:F0", "r0:F0")
    sliced = simulate(four, _host_model(sync=True, cores=2, slicing=1.1))
    assert sliced.step_time == pytest.approx(2 * 1.1, rel=0.01)     # 2 a core, sliced
    two = hand_plan("r0:F0", "r0:F0")
    assert simulate(two, _host_model(sync=True, cores=2, slicing=1.1)).step_time == 1
    three = hand_plan("r0:F0", "r0:F0", "r0:F0")       # 1.5 a core: half of the slicing cost
    assert simulate(three, _host_model(sync=True, cores=2, slicing=1.1)).step_time == \
        pytest.approx(1.5 * 1.05, rel=0.01)


def test_a_sliced_pass_draws_its_time_from_the_jitter_and_a_collective_waits_for_the_unluckiest(
        hand_plan):
    """Four devices on two cores: each pass takes twice its time on the mean (processor
    sharing), but drawn as time-slicing does it (here: full speed three times in four, five
    times as long once); every all-reduce waits for the slowest of the four."""
    row = "r0:F0 AR@0 wait(AR@0) r0:F1 AR@1 wait(AR@1) r0:F2 AR@2 wait(AR@2)"
    four = hand_plan(row, row, row, row)
    smooth = simulate(four, _host_model(sync=True, cores=2)).step_time
    assert smooth == pytest.approx(3 * (2 + 0.5), rel=0.01)
    jitter = (1.0, 1.0, 1.0, 5.0)
    sliced = simulate(four, _host_model(sync=True, cores=2, jitter=jitter)).step_time
    assert sliced > smooth * 1.2
    assert simulate(four, _host_model(sync=True, cores=2, jitter=jitter)).step_time == sliced
    two = hand_plan(row, row)   # a core each: no slicing, no jitter
    assert simulate(two, _host_model(sync=True, cores=2, jitter=jitter)).step_time == \
        simulate(two, _host_model(sync=True, cores=2)).step_time


def test_messages_cost_the_fit_of_their_kind_and_group_size():
    from piper_nb.plan.sizes import message_bytes
    plan = pn.compile(*_dp_plan_args())
    ar = next(i for i in plan[0].instrs if i.kind == "ALL_REDUCE")
    nbytes = message_bytes(plan, ar)
    cost = CostModel(links={("ALL_REDUCE", 2): (1.0, 100.0), ("p2p", 2): (5.0, 1.0)})
    assert cost.message(plan, ar, 0) == pytest.approx(1.0 + nbytes / 100.0)  # nearest size
    assert cost.message(plan, Instr.of("SEND", peer=1), 0) == 5.0


def _dp_plan_args():
    model = pn.models.MLP(dim=8, depth=2)
    spec = pn.annotate(model, pn.cut_stages(model, 1))
    return spec, [pn.split({}, "MB", 2), pn.replicate({}, [0, 1, 2, 3])], \
        model.example_batch(batch_size=8, seed=0)


def test_a_collective_in_flight_shares_the_cores_with_the_passes_it_overlaps(hand_plan):
    plan = hand_plan("AR r0:F1 wait(AR)", "AR r0:F1 wait(AR)")
    assert simulate(plan, _host_model(sync=True, cores=2)).step_time == 1
    # 2 passes and the collective's 2 members: 4 loads on 2 cores while it runs. It was
    # profiled with the cores to itself, so it takes 2 x 0.5; a pass of length x runs at a
    # share of (2x + 2 * 1) / x / 2, so x = 1 + 1 / x: the golden ratio
    loaded = simulate(plan, _host_model(sync=True, cores=2, comm_cores=1.0))
    ar = [e for e in loaded.events if e.kind == "ALL_REDUCE"]
    assert [(e.start, e.end) for e in ar] == [(0, pytest.approx(1.0, rel=0.01))] * 2
    assert loaded.step_time == pytest.approx((1 + 5 ** 0.5) / 2, rel=0.01)
    # timed while 2 more processes computed (a link profile of 4), it was already slowed 2x
    four = simulate(plan, _host_model(sync=True, cores=2, comm_cores=1.0, link_world=4))
    assert [e.end for e in four.events if e.kind == "ALL_REDUCE"] == [pytest.approx(0.5)] * 2


def test_a_message_in_flight_takes_a_core_on_its_receiver(hand_plan, monkeypatch):
    plan = hand_plan("r0:SEND_F0>1 wait(r0:SEND_F0>1)", "r1:RECV_F0<0 r1:F1 wait(r1:RECV_F0<0)", "r2:F1")
    assert simulate(plan, _host_model(sync=True, cores=2)).step_time == 1
    # two passes and the message's reader (0.5 long): a pass of length x runs at a share
    # of (2x + 0.5) / x / 2, so x = 1 + 0.25 / x = (1 + sqrt 2) / 2; the message keeps 0.5
    loaded = simulate(plan, _host_model(sync=True, cores=2, comm_cores=1.0))
    recv = next(e for e in loaded.events if e.kind == "RECV")
    assert (recv.start, recv.end) == (0, 0.5)
    assert loaded.step_time == pytest.approx((1 + 2 ** 0.5) / 2, rel=0.01)
    # with the rate the sender's call writes at, the reader is busy only while it copies:
    # 1000 bytes at 4000 per unit, half the span, so x = 1 + 0.125 / x
    module = importlib.import_module("piper_nb.sim.core_sharing")   # where the reader is timed
    monkeypatch.setattr(module, "message_bytes", lambda plan, ins: 1000)
    copying = simulate(plan, _host_model(sync=True, cores=2, comm_cores=1.0,
                                         issue={"SEND": (0.0, 4000.0)}))
    assert copying.step_time == pytest.approx((1 + 1.5 ** 0.5) / 2, rel=0.01)


def test_a_collective_pays_its_packing_before_the_call_and_its_unpacking_after_the_wait(
        hand_plan, spans):
    plan = hand_plan("AR wait(AR) r0:F0", "AR wait(AR) r0:F0")
    trace = simulate(plan, _host_model(sync=True, packing={("ALL_REDUCE", -1): (0.25, 0.5)}))
    # flattened by 0.25, moved in 0.5, put back by 1.25: the pass starts then
    assert spans(trace, 0) == ["AR@0.25-0.75", "r0:F0@1.25-2.25"]


def test_a_forward_dispatch_first_gathers_token_counts_and_blocks_the_host():
    """runtime.exchange all-gathers each member's token counts before a forward dispatch
    (blocking): the exchange starts that long after its last member posted it, and the
    host goes on only then; the other exchanges do not block."""
    import dataclasses
    import math

    from piper_nb.strategies import compile_strategy
    plan = compile_strategy("pp2-dp2-ep2")[0]
    inf = math.inf
    links = {("ALL_GATHER", 2): (0.5, inf), ("ALL_TO_ALL", 2): (0.25, inf),
             ("p2p", 2): (0.1, inf), ("ALL_REDUCE", 2): (0.1, inf)}
    cost = dataclasses.replace(CostModel.uniform(F=1, B=2, W=1), comm=None, links=links)
    timing = run_timing(plan, cost)
    forward, other, free = 0, 0, 0
    for d, dp in enumerate(plan.devices):
        for i, ins in enumerate(dp.instrs):
            if ins.kind != "ALL_TO_ALL":
                continue
            st, en = timing.start[d][i], timing.end[d][i]
            assert en == pytest.approx(st + 0.25)
            if ins.purpose == "dispatch" and not ins.data.grad:
                forward += 1
                assert st >= timing.posted[d][i] + 0.5 - 1e-12
                assert timing.posted[d][i + 1] >= st   # the host waited for the counts
            else:
                other += 1
                nxt = dp.instrs[i + 1]
                if not (nxt.kind == "WAIT" and nxt.data.target == i):
                    free += 1
                    assert timing.posted[d][i + 1] < en    # issued, not waited for
    assert forward == other // 3 > 0 and free > 0
