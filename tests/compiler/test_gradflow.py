"""Gradient completeness: each backward sees every reader's contribution once, each update
every backward's; correct plans pass, and plans broken by hand fail before anything runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import piper_nb as pn
from piper_nb.compiler.checks import check_plan
from piper_nb.compiler.lower import lower
from piper_nb.ir.kinds import Op
from piper_nb.ir.node import Edge
from piper_nb.plan.instr import Instr
from piper_nb.plan.plan import DevicePlan


class Skip(nn.Module):
    """Four Linear stages; stage `dst` also adds the output of stage `src` (a skip edge)."""

    def __init__(self, src: int, dst: int, dim: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.s = nn.ModuleList(nn.Linear(dim, dim) for _ in range(4))
        self.src, self.dst = src, dst

    def forward(self, x):
        outs = []
        for i, stage in enumerate(self.s):
            x = stage(x)
            if i == self.dst:
                x = x + outs[self.src]
            x = torch.tanh(x)
            outs.append(x)
        return x

    def loss_fn(self, out, y):
        return F.mse_loss(out, y)


def skip_plan(schedule: str, src: int, dst: int):
    model = Skip(src, dst)
    spec = pn.annotate(model, {f"s.{i}": {"PP": i} for i in range(4)})
    batch = (torch.randn(8, 8), torch.randn(8, 8))
    program = {"interleaved": lambda: pn.schedules.interleaved_1f1b(2, 4, chunks=2, place=True),
               "dualpipev": lambda: pn.schedules.dualpipev(2, 4, place=True)}[schedule]()
    return pn.compile(spec, program, batch)


def grad_sends(plan, device: int, value: str) -> list[str]:
    return [str(i) for i in plan[device].instrs
            if i.kind == "SEND" and i.data.grad and value in i.data.values]


def test_a_value_read_on_another_rank_by_a_later_chunk_is_summed_there_and_sent_once():
    # interleaved 2 x 2: stage 0 on rank 0; its output is read by stages 1 and 3, on rank 1
    plan = skip_plan("interleaved", 0, 3)
    skip = plan.regions[0].outputs[0]
    sends = grad_sends(plan, 1, skip)
    assert sends == ["r1:SEND_B0>0", "r1:SEND_B1>0", "r1:SEND_B2>0", "r1:SEND_B3>0"]
    # after both backwards that read it, not after the first
    text = plan[1].text()
    assert text.index("r3:B0") < text.index("r1:B0") < text.index("r1:SEND_B0>0")


def test_a_value_read_by_both_arms_of_a_v_is_summed_before_it_is_sent():
    # DualPipeV on 2 ranks: rank 1 holds stages 1 and 2, both reading stage 0's output
    plan = skip_plan("dualpipev", 0, 2)
    skip = plan.regions[0].outputs[0]
    assert len(grad_sends(plan, 1, skip)) == plan.microbatches


def test_an_activation_read_by_two_stages_of_one_rank_travels_once():
    plan = skip_plan("interleaved", 0, 3)
    skip = plan.regions[0].outputs[0]
    forward_sends = [i for i in plan[0].instrs if i.kind == "SEND" and not i.data.grad
                     and skip in i.data.values]
    assert len(forward_sends) == plan.microbatches


def per_edge_send_recv(plan):
    """The plan as lowered before the fix: one SEND/RECV per edge, so a device that holds
    two readers of one value sends its running sum twice."""
    dag = plan.dag
    nodes = [n for n in dag.nodes if n.op not in (Op.SEND, Op.RECV)]
    edges = [e for e in dag.edges if dag[e.src].op not in (Op.SEND, Op.RECV)
             and dag[e.dst].op not in (Op.SEND, Op.RECV)]
    for send in (n for n in dag.nodes if n.op == Op.SEND):
        (hop,) = dag.out_edges(send.id)
        recv = dag[hop.dst]
        for a in (e.src for e in dag.in_edges(send.id)):
            for b in (e.dst for e in dag.out_edges(recv.id)):
                values = tuple(v for v in send.attr("values")
                               if any(v in e.values for e in dag.in_edges(send.id) if e.src == a))
                s = dataclasses.replace(send, id=f"SEND({a}->{b})")
                r = dataclasses.replace(recv, id=f"RECV({a}->{b})")
                nodes += [s, r]
                edges += [Edge(a, s.id, "data", values), Edge(s.id, r.id, "data", values),
                          Edge(r.id, b, "data", values)]
    dag = dag.replace(nodes=nodes, edges=edges)
    return dataclasses.replace(plan, devices=lower(dag, plan.buckets, plan.world), dag=dag)


@pytest.mark.parametrize("schedule,src,dst", [("interleaved", 0, 3), ("dualpipev", 0, 2)])
def test_the_plans_that_trained_wrong_fail_the_check(schedule, src, dst):
    old = per_edge_send_recv(skip_plan(schedule, src, dst))
    with pytest.raises(pn.PlanError, match=r"adds the contribution of \{PP=\d\} on device 1 to "
                                           r"the gradient of tanh@0 a second time"):
        check_plan(old)


def mutate(plan, device: int, edit):
    """`plan` with device `device`'s instruction list replaced by `edit(list)`. A WAIT keeps
    pointing at the instruction object it waited for; `("wait", instr)` adds a new one."""
    instrs = list(plan[device].instrs)
    target = {id(ins): instrs[ins.data.target] for ins in instrs if ins.kind == "WAIT"}
    new = edit(instrs)
    out = []
    for ins in new:
        if isinstance(ins, tuple):
            t = ins[1]
            ins = Instr.of("WAIT", t.node, t.stream)
            target[id(ins)] = t
        if ins.kind == "WAIT":
            where = next(k for k, x in enumerate(out) if x is target[id(ins)])
            ins = ins.with_data(target=where)
        out.append(ins)
    devices = list(plan.devices)
    devices[device] = DevicePlan(device, tuple(out))
    return dataclasses.replace(plan, devices=tuple(devices))


def index(instrs, text: str) -> int:
    for k, ins in enumerate(instrs):
        label = f"wait({instrs[ins.data.target]})" if ins.kind == "WAIT" else str(ins)
        if label == text:
            return k
    raise AssertionError(f"{text} not in {[str(i) for i in instrs]}")


def move(instrs, what: str, after: str) -> list:
    k, a = index(instrs, what), index(instrs, after)
    ins = instrs.pop(k)
    instrs.insert(a if a > k else a + 1, ins)
    return instrs


def one_f_one_b():
    model = pn.models.MLP(dim=8, depth=4)
    spec = pn.annotate(model, pn.cut_stages(model, 2))
    return pn.compile(spec, pn.schedules.one_f_one_b(2, 2, place=True),
                      model.example_batch(8, seed=0))


def test_correct_plans_pass():
    check_plan(one_f_one_b())
    check_plan(skip_plan("interleaved", 0, 3))


def test_a_backward_before_its_gradient_arrives_fails():
    broken = mutate(one_f_one_b(), 0, lambda x: move(x, "wait(r0:RECV_B0<1)", "r0:B0"))
    with pytest.raises(pn.PlanError, match=r"device 0: r0:B0 runs before the gradient of "
                       r"\S+@0 is complete: it lacks the contribution of \{PP=1\} on device 1"):
        check_plan(broken)


def test_a_gradient_freed_before_its_backward_fails():
    plan = one_f_one_b()
    value = plan.regions[0].outputs[0]
    free = Instr.of("FREE", "x", "compute", keys=(f"grad:{value}@0",))
    broken = mutate(plan, 0, lambda x: x[:index(x, "r0:B0")] + [free] + x[index(x, "r0:B0"):])
    with pytest.raises(pn.PlanError, match="r0:B0 runs before the gradient"):
        check_plan(broken)


def dp_plan(zero: int):
    model = pn.models.MLP(dim=8, depth=2)
    spec = pn.annotate(model, {"layers": {"PP": 0}})
    return pn.compile(spec, [pn.replicate({}, [0, 1], zero=zero), pn.split({}, "MB", 2)],
                      model.example_batch(8, seed=0))


@pytest.mark.parametrize("device", [0, 1])
def test_an_update_before_the_all_reduce_completes_fails_on_any_replica(device):
    plan = dp_plan(0)
    assert plan.stamps() == {1: 0}   # device 1 is a stamp of device 0's instructions
    broken = mutate(plan, device, lambda x: move(x, "wait(b0:AR)", "r0:U"))
    assert broken.stamps() == {}     # so both are replayed
    with pytest.raises(pn.PlanError, match=rf"device {device}: r0:U updates bucket 0 .* before "
                                           "its gradient is complete"):
        check_plan(broken)


def test_a_reduce_scatter_before_the_last_backward_loses_a_microbatch():
    plan = dp_plan(1)   # ZeRO-1: one reduce-scatter after the last backward
    broken = mutate(plan, 0, lambda x: move(x, "r0:B1", "wait(b0:RS)"))
    with pytest.raises(pn.PlanError, match=r"r0:U updates bucket 0 .* it lacks \{PP=0\} "
                                           "microbatch 1 replica 0"):
        check_plan(broken)


def test_a_gradient_all_reduced_twice_is_counted_twice():
    plan = dp_plan(0)
    def twice(x):
        again = dataclasses.replace(next(i for i in x if i.kind == "ALL_REDUCE"))
        k = index(x, "r0:U")
        return x[:k] + [again, ("wait", again)] + x[k:]

    broken = plan
    for d in (0, 1):
        broken = mutate(broken, d, twice)
    # the second all-reduce re-sums an already reduced bucket: every member holds all
    with pytest.raises(pn.PlanError, match="a second time"):
        check_plan(broken)


def test_the_check_names_the_order_directive_that_placed_the_backward():
    plan = skip_plan("interleaved", 0, 3)
    broken = mutate(plan, 0, lambda x: move(x, "wait(r0:RECV_B0<1)", "r0:B0"))
    with pytest.raises(pn.PlanError) as info:
        check_plan(broken)
    assert info.value.directive is not None and info.value.op == "order"
    assert str(info.value).startswith(f"directive #{info.value.directive} (order)")


def test_replica_classes_are_replayed_once_and_agree_with_a_full_replay():
    from piper_nb.compiler.checks import dry_run
    from piper_nb.compiler.gradflow import Flow

    model = pn.models.MLP(dim=8, depth=4)
    spec = pn.annotate(model, pn.cut_stages(model, 2))
    program = [pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
               pn.replicate({"PP": 0}, [0, 2], zero=2), pn.replicate({"PP": 1}, [1, 3], zero=2),
               *pn.schedules.one_f_one_b(2, 4)]
    plan = pn.compile(spec, program, model.example_batch(16, seed=0))
    deduped = Flow(plan)
    assert deduped.active == [True, True, False, False]
    dry_run(plan, deduped)
    dry_run(plan, Flow(plan, replicas=False))

