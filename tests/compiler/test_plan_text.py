"""Plans read like schedules: expected per-device instruction lists in text form."""

import pytest

import piper_nb as pn
from piper_nb.compiler.plan import Plan


def stages(model, n):
    return pn.annotate(model, pn.cut_stages(model, n))


def test_one_f_one_b_two_ranks_with_sends_receives_and_waits(mlp):
    model, batch = mlp
    plan = pn.compile(stages(model, 2), pn.schedules.one_f_one_b(2, 2, place=True), batch)
    assert plan[0].text() == ["0F0", "0SEND_F0>1", "0RECV_B0<1", "0F1", "0SEND_F1>1",
                              "0RECV_B1<1", "0B0", "0B1", "0U"]
    assert plan[1].text() == ["1RECV_F0<0", "1F0", "1RECV_F1<0", "1B0", "1SEND_B0>0", "1F1",
                              "1B1", "1SEND_B1>0", "1U"]
    # receives are issued a pass ahead and waited for right before their consumer
    assert plan[1].text(waits=True)[:9] == [
        "1RECV_F0<0", "wait(1RECV_F0<0)", "1F0", "free(act:model_layers_3_1@0)", "1RECV_F1<0",
        "1B0", "1SEND_B0>0", "wait(1RECV_F1<0)", "1F1"]


def test_zero_levels_lower_to_distinct_collectives(mlp):
    model, batch = mlp
    spec = stages(model, 1)
    seen = {}
    for zero in range(4):
        plan = pn.compile(spec, [pn.replicate({}, [0, 1], zero=zero), pn.split({}, "MB", 2)], batch)
        seen[zero] = [str(i) for i in plan[0].instrs if i.is_issue]
    assert seen[0] == ["AR0"]
    assert seen[1] == ["RS0", "AG0"]
    assert seen[2] == ["RS0@0", "RS0@1", "AG0"]
    # no order directive and nothing to wait for from peers: F0 B0 F1 B1, as gradient
    # accumulation runs (F1's gather is prefetched during B0)
    assert seen[3] == ["AG0@0", "AG0@0", "AG0@1", "RS0@0", "AG0@1", "RS0@1"]


def test_zero3_frees_gathered_parameters_after_every_pass(mlp):
    model, batch = mlp
    plan = pn.compile(stages(model, 1), [pn.replicate({}, [0, 1], zero=3)], batch)
    assert plan[0].text(waits=True) == [
        "AG0", "AG0", "wait(AG0)", "0F", "free(param:0)", "wait(AG0)", "0B", "free(param:0)",
        "RS0", "wait(RS0)", "0U"]
    frees = [i for i in plan[0].instrs if i.kind == "FREE" and "param:0" in i.keys]
    assert len(frees) == 2


def test_plan_json_round_trips(mlp):
    model, batch = mlp
    plan = pn.compile(stages(model, 4), pn.schedules.dualpipev(2, 4, place=True), batch)
    again = Plan.from_json(plan.to_json())
    assert again.devices == plan.devices and again.buckets == plan.buckets
    assert again.grid() == plan.grid()


def test_dag_text_and_json_round_trip(mlp):
    from piper_nb.ir.text import dag_from_json, dag_from_text

    model, batch = mlp
    plan = pn.compile(stages(model, 2), [
        pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
        pn.replicate({"PP": 0}, [0, 2], zero=1), pn.replicate({"PP": 1}, [1, 3], zero=1),
        *pn.schedules.one_f_one_b(2, 4)], batch)
    dag = plan.dag
    again = dag_from_text(dag.text())
    assert (again.nodes, again.edges, again.history) == (dag.nodes, dag.edges, dag.history)
    again = dag_from_json(dag.to_json())
    assert (again.nodes, again.edges) == (dag.nodes, dag.edges)
    pn.validate(again, placed=True)


def test_zero3_without_reshard_gathers_once_and_reduces_once(mlp):
    model, batch = mlp
    plan = pn.compile(stages(model, 1), [pn.replicate({}, [0, 1], zero=3, reshard=False),
                                         pn.split({}, "MB", 2)], batch)
    assert plan[0].text(waits=True) == [
        "AG0", "wait(AG0)", "0F0", "0B0", "0F1", "0B1", "free(param:0)", "RS0", "wait(RS0)", "0U"]
    with pytest.raises(pn.PlanError, match="only applies to zero=3"):
        pn.replicate({}, [0, 1], zero=2, reshard=False)
