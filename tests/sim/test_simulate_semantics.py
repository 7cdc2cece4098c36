"""The simulator's rules on hand-written plans, each timeline checked in text form
(`label@start-end`). Costs: CostModel.uniform, so times are exact."""

from __future__ import annotations

import pytest

import piper_nb as pn
from piper_nb import PlanError
from piper_nb.compiler.plan import Instr
from piper_nb.sim import CostModel, simulate
from piper_nb.sim.simulate import overlap_steps, run_timing


def test_a_recv_waits_for_its_send_and_both_span_the_transfer(hand_plan, spans):
    plan = hand_plan("0F0 0SEND_F0>1 wait(0SEND_F0>1)",
                     "1RECV_F0<0 wait(1RECV_F0<0) 1F0")
    trace = simulate(plan, CostModel.uniform(F=1, comm=0.5))
    assert spans(trace, 0) == ["0F0@0-1", "0SEND_F0>1@1-1.5"]
    assert spans(trace, 1) == ["1RECV_F0<0@1-1.5", "1F0@1.5-2.5"]
    assert trace.step_time == 2.5


def test_messages_on_one_stream_go_first_in_first_out_while_compute_runs_on(hand_plan, spans):
    plan = hand_plan("0F0 0SEND_F0>1 0F1 0SEND_F1>1 wait(0SEND_F0>1) wait(0SEND_F1>1)",
                     "1RECV_F0<0 1RECV_F1<0 wait(1RECV_F0<0) 1F0 wait(1RECV_F1<0) 1F1")
    trace = simulate(plan, CostModel.uniform(F=1, comm=2))
    assert spans(trace, 0) == ["0F0@0-1", "0F1@1-2", "0SEND_F0>1@1-3", "0SEND_F1>1@3-5"]
    assert spans(trace, 1, "compute") == ["1F0@3-4", "1F1@5-6"]


def test_a_collective_starts_when_every_member_posted_it_and_ends_together(hand_plan, spans):
    plan = hand_plan("0F0 0B0 AR wait(AR) 0U", "1F0 AR wait(AR) 1U")
    trace = simulate(plan, CostModel.uniform(F=1, B=2, comm=1))
    assert spans(trace, 0) == ["0F0@0-1", "0B0@1-3", "AR@3-4", "0U@4-4"]
    assert spans(trace, 1) == ["1F0@0-1", "AR@3-4", "1U@4-4"]


def test_an_overlap_slot_costs_fb_and_its_passes_share_the_span(hand_plan, spans):
    plan = hand_plan("0F0 (0F1;0B0) 0B1")
    trace = simulate(plan, CostModel.uniform(F=1, B=2, FB=2.5))
    assert spans(trace, 0) == ["0F0@0-1", "0B0@1-3.5", "0F1@1-3.5", "0B1@3.5-5.5"]
    assert trace.bubble(0) == 0
    # without FB the slot costs F + B
    assert simulate(plan, CostModel.uniform(F=1, B=2)).step_time == 6


def test_waits_between_overlapped_passes_gate_the_slot_and_issues_follow_it():
    instrs = [Instr("RECV", "r", "pp", peer=1, tag=1, grad=True),        # 0
              Instr("F", "f", region=0, mb=1, overlap=0),                 # 1
              Instr("SEND", "s", "pp", region=0, mb=1, peer=1, tag=2),    # 2 sends F's output
              Instr("WAIT", "r", "pp", target=0),                         # 3 B's input
              Instr("B", "b", region=1, mb=0, overlap=0)]                 # 4
    assert overlap_steps(instrs) == [0, 3, (1, 4), 2]


def test_a_plan_whose_waits_cross_cannot_finish(hand_plan):
    plan = hand_plan("0RECV_F0<1 wait(0RECV_F0<1) 0SEND_F0>1 wait(0SEND_F0>1)",
                     "1RECV_F0<0 wait(1RECV_F0<0) 1SEND_F0>0 wait(1SEND_F0>0)")
    with pytest.raises(PlanError, match="cannot finish"):
        simulate(plan, CostModel.uniform())


def test_every_instruction_of_a_compiled_plan_gets_a_time(compile_schedule):
    plan = compile_schedule(pn.models.MLP(dim=8, depth=16), pn.schedules.one_f_one_b, 4, 4, 8)
    timing = run_timing(plan, CostModel.uniform(comm=0.25))
    assert all(t >= 0 for row in timing.end for t in row)
    assert all(s <= e for rs, re_ in zip(timing.start, timing.end, strict=True)
               for s, e in zip(rs, re_, strict=True))
