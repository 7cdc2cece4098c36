"""The NCCL check: plans stepped through NCCL's in-order communicator streams. The plans
PyTorch's default layout (both directions of a pair on one communicator) would deadlock,
and the receives posted out of their sender's order, fail; every builder's plans pass."""

from __future__ import annotations

import pytest

import piper_nb as pn
from piper_nb.compiler import lower as lowering
from piper_nb.compiler.nccl import check_nccl

S = pn.schedules


def mlp_plan(stages: int, program, check: bool = True):
    model = pn.models.MLP(dim=8, depth=stages)
    spec = pn.annotate(model, pn.cut_stages(model, stages))
    return pn.compile(spec, program, model.example_batch(24, seed=0), check=check)


def test_1f1b_deadlocks_when_both_directions_share_one_communicator():
    plan = mlp_plan(2, S.one_f_one_b(2, 4, place=True))
    check_nccl(plan)   # the runtime's layout: one communicator per direction
    with pytest.raises(pn.PlanError) as info:
        check_nccl(plan, channels="pair")
    text = str(info.value)
    assert text.startswith("NCCL deadlock")
    # rank 0 waits on RECV_B0 at the head, rank 1 on RECV_F1, queued behind rank 0's RECV_B0
    assert ">r0:RECV_B0<1< rec(d2) wait(i4) r0:SEND_F1>1" in text     # on nccl:pair:0,1
    assert ">r1:RECV_F1<0< rec(d4) wait(i6) r1:SEND_B0>0" in text
    assert "compute: (rec(i1)) (rec(i2)) (r0:F1) (rec(i4)) >wait(d2)@5<" in text


def test_receives_out_of_their_senders_order_would_swap_messages(monkeypatch):
    program = S.dualpipev(4, 8, place=True)
    plan = mlp_plan(8, program)
    check_nccl(plan)
    # the plan as lowered before receives followed their sender's order
    monkeypatch.setattr(lowering, "in_send_order", lambda programs, *rest: programs)
    old = mlp_plan(8, program, check=False)
    with pytest.raises(pn.PlanError, match=r"NCCL would swap messages: device (\d)'s send "
                                           r"r\d+:SEND_F\d+>(\d) meets device \2's receive "
                                           r"r\d+:RECV_B0<\1"):
        check_nccl(old)


def test_receives_follow_their_senders_order():
    plan = mlp_plan(8, S.dualpipev(4, 8, place=True))
    for dp in plan.devices:
        for peer in range(plan.world):
            got = [i.data.tag for i in dp.instrs if i.kind == "RECV" and i.data.peer == peer]
            sent = [i.data.tag for i in plan[peer].instrs if i.kind == "SEND" and i.data.peer == dp.device]
            assert got == sent


PLANS = {
    "gpipe": (4, lambda: S.gpipe(4, 8, place=True)),
    "1f1b": (4, lambda: S.one_f_one_b(4, 8, place=True)),
    "interleaved": (8, lambda: S.interleaved_1f1b(4, 8, chunks=2, place=True)),
    "zb1p": (4, lambda: S.zero_bubble(4, 8, place=True)),
    "dualpipev": (8, lambda: S.dualpipev(4, 8, place=True)),
    "dualpipe": (4, lambda: S.dualpipe(4, 8, place=True)),
    "grid": (3, lambda: S.from_grid("0F0 0F1 0B0 0F2 0B1 0B2\n"
                                    "1F0 2F0 2B0 1F1 1B0 2F1 2B1 1F2 1B1 2F2 2B2 1B2",
                                    place=True)),
}


@pytest.mark.parametrize("name", sorted(PLANS))
@pytest.mark.parametrize("channels", ["direction", "pair"])
def test_every_builder_runs_under_nccl(name, channels):
    stages, program = PLANS[name]
    plan = mlp_plan(stages, program())
    if channels == "direction":
        check_nccl(plan)
        check_nccl(plan, replicas=False)
        return
    try:   # PyTorch's default layout: some run, and when one does not, the check says so
        check_nccl(plan, channels="pair")
    except pn.PlanError as err:
        assert str(err).startswith(("NCCL deadlock", "NCCL would swap"))


def test_pp_dp_zero3_and_expert_parallel_plans_run_under_nccl():
    from piper_nb.strategies import compile_strategy
    for name in ("pp2-dp2-zero3", "pp2-dp2-ep2", "dualpipe-4ranks"):
        plan, _ = compile_strategy(name)
        check_nccl(plan)
        check_nccl(plan, replicas=False)


def test_an_expert_dispatch_waits_for_its_hosts_to_meet():
    """A forward dispatch first exchanges token counts between the group's hosts (once
    each has run its own compute): every member's host meets there."""
    from piper_nb.compiler.nccl import _Run
    from piper_nb.strategies import compile_strategy
    plan, _ = compile_strategy("pp2-dp2-ep2")
    run = _Run(plan, plan.streams(), replicas=False)
    assert run.run() == []
    assert run.arrived and all(len(m) == 2 for m in run.arrived.values())
